"""Choosing a head's regularizer on the validation split: the examples of the classes learned so far, scored by
accuracy over those classes. Validation examples are never trained on or added to statistics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .base import feature_batches

if TYPE_CHECKING:
    from ...data.tasks import Example
    from ..context import RunContext


def validation_examples(ctx: RunContext, learned: torch.Tensor) -> list[Example]:
    """The validation examples of the sequence whose class is ``learned`` (boolean ``(num_classes,)``)."""
    return [ex for task in ctx.sequence.tasks for ex in task.validation if bool(learned[ex.label])]


def best_on_validation(
    model: nn.Module,
    examples: Sequence[Example],
    ctx: RunContext,
    score: Callable[[torch.Tensor, Any], torch.Tensor],
    grid: Sequence[Any],
) -> Any:
    """The point of ``grid`` whose scores (``score(features, point)``) classify ``examples`` best; ties go to the
    later point (the grids run from weak to strong regularization, and the stronger one is the safer choice).

    Every process reads every example (``whole``), so all choose alike without a collective.
    """
    correct = torch.zeros(len(grid), dtype=torch.float64)
    for features, labels in feature_batches(model, examples, ctx, whole=True):
        for i, point in enumerate(grid):
            correct[i] += (score(features, point).argmax(-1) == labels).sum().item()
    best = int(max(range(len(grid)), key=lambda i: (correct[i].item(), i)))
    return grid[best]
