"""Scoring a model on test examples: accuracy per head from one forward per batch, and the checks that a sequence can
serve a method's heads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ..data.tasks import Example
from .context import Collate, class_mask, length_order, model_logits, split_batches, to_device
from .heads import ContinualHead
from .heads.base import forward_with_features
from .heads.frozen import FrozenFeatures

__all__ = ["evaluate", "evaluate_heads"]


def evaluate(model: nn.Module, examples: Sequence[Example], *args: Any, **options: Any) -> float:
    """Accuracy of ``model`` on ``examples`` when it may only predict ``allowed_classes``: :func:`evaluate_heads`
    (same arguments, ``heads`` aside) scoring with the model's own output."""
    return evaluate_heads(model, examples, *args, heads={"": None}, **options)[""]


@torch.no_grad()
def evaluate_heads(
    model: nn.Module,
    examples: Sequence[Example],
    allowed_classes: Sequence[int],
    num_classes: int,
    collate: Collate,
    device: torch.device,
    heads: dict[str, Optional[ContinualHead]],
    batch_size: int = 128,
    progress: bool = False,
    desc: str = "eval",
    hits: Optional[list[bool]] = None,
    frozen_features: Optional[FrozenFeatures] = None,
) -> dict[str, float]:
    """Accuracy of each head on ``examples`` when it may only predict ``allowed_classes``, from one forward per batch.

    Args:
        heads: By name; ``None`` or a head that does not read features scores with the model's own output.
        hits: When given, filled with whether the first head of ``heads`` got each example right, in the order of
            ``examples`` (what a paired comparison of two methods on the same examples needs).
        frozen_features: Features of the model's frozen backbone kept from earlier passes (every head must read
            features): a batch seen before is not run through the model again.
    """
    if not examples:
        raise ValueError("cannot evaluate on an empty test set")
    was_training = model.training
    model.eval()
    mask = class_mask(num_classes, allowed_classes, device)
    reads = any(head is not None and head.reads_features for head in heads.values())
    if frozen_features is not None and not all(head is not None and head.reads_features for head in heads.values()):
        raise ValueError("frozen_features serves heads that read features; a head here scores the model's logits")
    correct = dict.fromkeys(heads, 0)
    first = next(iter(heads))
    order = length_order(examples)  # each example is scored on its own: batches of similar lengths pad less
    right: list[bool] = []
    chunks = split_batches([examples[i] for i in order], batch_size)
    for chunk in tqdm(chunks, desc=desc, disable=not progress, leave=False):
        batch = to_device(collate(chunk), device)
        if frozen_features is not None:  # a frozen backbone's features of this batch, once per job
            logits, features = None, frozen_features.features(model, chunk, batch)
        elif reads:
            logits, features = forward_with_features(model, batch)
        else:
            logits, features = model_logits(model, batch), None
        for name, head in heads.items():
            scores = head.scores(features) if head is not None and head.reads_features else logits
            hit = scores.masked_fill(~mask, float("-inf")).argmax(-1) == batch["labels"]
            correct[name] += hit.sum().item()
            if name == first and hits is not None:
                right += hit.tolist()
    model.train(was_training)
    if hits is not None:
        hits[:] = [False] * len(examples)
        for position, value in zip(order, right):
            hits[position] = value
    return {name: n / len(examples) for name, n in correct.items()}
