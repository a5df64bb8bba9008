"""Heads the model trains: ``linear`` (the model's own linear classifier) and ``cosine`` (SEQ*'s cosine classifier
whose earlier classes' rows are frozen when a new task starts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .base import ContinualHead, HeadOptions, register_head

if TYPE_CHECKING:
    from ..context import RunContext


@register_head
class LinearHead(ContinualHead):
    """The model's linear classifier, trained with each task's logit mask (``train.train_logit_mask``)."""

    name = "linear"
    reads_features = False


class CosineClassifier(nn.Module):
    """Cosine-similarity logits, ``scale * <x / |x|, w_c / |w_c|>``, with rows that can be frozen.

    A frozen row is read from the buffer ``frozen_weight`` (its value when it was frozen), so no optimizer step, weight
    decay or gradient can move it: earlier classes' scores stay bitwise what they were, only the shared ``scale``
    (which cannot change their ranking) and the features move.

    Args:
        weight: ``(num_classes, dim)`` initial rows.
        scale: Initial value of the learnt scale (a cosine's range [-1, 1] is too narrow for a softmax).
    """

    def __init__(self, weight: torch.Tensor, scale: float = 16.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.scale = nn.Parameter(torch.tensor(float(scale), dtype=weight.dtype))
        self.register_buffer("frozen", torch.zeros(weight.shape[0], dtype=torch.bool))
        self.register_buffer("frozen_weight", torch.zeros_like(self.weight.detach()))

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.where(self.frozen[:, None], self.frozen_weight.to(self.weight.dtype), self.weight)
        x = nn.functional.normalize(x, dim=-1)
        return self.scale * x @ nn.functional.normalize(weight, dim=-1).T

    @torch.no_grad()
    def freeze_rows(self, rows: list[int]) -> None:
        """Freeze ``rows`` at their current values (rows frozen before keep their earlier value)."""
        weight = self.weight.detach()
        if hasattr(weight, "full_tensor"):  # an FSDP2 (DTensor) parameter between steps
            weight = weight.full_tensor()
        index = torch.tensor([r for r in rows if not self.frozen[r]], dtype=torch.long, device=self.frozen.device)
        if index.numel():
            self.frozen_weight[index] = weight[index].to(self.frozen_weight.dtype)
            self.frozen[index] = True


@dataclass
class CosineOptions(HeadOptions):
    """Options of the ``cosine`` head.

    Args:
        scale: Initial value of the learnt logit scale.
        freeze_old: Freeze the rows of earlier tasks' classes when a task starts (SEQ*); ``false`` trains every row.
    """

    scale: float = 16.0
    freeze_old: bool = True

    def validate(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"`head.scale` must be > 0, got {self.scale}")


@register_head
class CosineHead(ContinualHead):
    """SEQ* (Zheng et al., ACL 2024): a cosine classifier whose earlier classes' rows are frozen when a new task
    starts, so the new task's training cannot lower them; only the backbone's drift can move their scores."""

    name = "cosine"
    options_cls = CosineOptions
    reads_features = False
    shapes_training = True

    def attach(self, model: nn.Module) -> nn.Module:
        linear = getattr(model, "classifier", None)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"the cosine head replaces a linear `classifier` module; {type(model).__name__} has none")
        model.classifier = CosineClassifier(linear.weight, self.options.scale)
        return model

    def before_task(self, model: nn.Module, task_id: int, ctx: RunContext) -> None:
        if not self.options.freeze_old or task_id == 0:
            return
        rows = ctx.sequence.classes_seen(task_id - 1)
        for module in model.modules():
            if isinstance(module, CosineClassifier):  # PEFT's trained copy and its original
                module.freeze_rows(rows)

    def describe(self) -> dict[str, Any]:
        return {"freeze_old": self.options.freeze_old}
