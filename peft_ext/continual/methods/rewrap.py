"""What the re-wrapping baselines (InfLoRA-style, O-LoRA, OSF) share: a fresh PEFT adapter before every task, the
previous one merged into the backbone.

Folding a finished task by merging its adapter into the (copied) backbone is the same function as keeping it as a
frozen adapter; the classification head trains in place across tasks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .base import ContinualMethod, saved_head
from .covariance import backbone_of

if TYPE_CHECKING:
    from ..context import RunContext

__all__ = ["RewrapMethod"]


class RewrapMethod(ContinualMethod):
    """Wraps a fresh PEFT adapter before every task and merges the previous one into the backbone."""

    rewraps_model = True

    def _fold(self, model: nn.Module) -> nn.Module:
        from peft import PeftModel

        return model.merge_and_unload() if isinstance(model, PeftModel) else model

    def between_tasks(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        # Folding here rather than in the next before_task gives the same numbers, and the model a snapshot is taken
        # of has the structure of a fresh build (the plain backbone), so a resumed run can load it.
        return self._fold(model)

    def _wrap(self, backbone: nn.Module, config: Any, ctx: RunContext) -> nn.Module:
        from peft import get_peft_model

        model = get_peft_model(backbone, config)
        # The head is trained in place across tasks (like modules_to_save would, without a wrapper to unload); a
        # generation sequence keeps the pretrained LM head frozen (saved_head: none).
        for name in saved_head(backbone_of(model), ctx) or ():
            getattr(backbone_of(model), name).requires_grad_(True)
        return model
