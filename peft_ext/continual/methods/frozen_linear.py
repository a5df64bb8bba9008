"""``frozen_linear``: the frozen backbone with a linear head trained task after task (the lower bound)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from .base import ContinualMethod, head_module_name, register_continual_method

if TYPE_CHECKING:
    from ..context import RunContext


@register_continual_method
class FrozenLinear(ContinualMethod):
    """Lower bound: the backbone stays frozen; only the linear head learns, task after task."""

    name = "frozen_linear"
    is_continual_adapter = False

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        head = getattr(base_model, head_module_name(base_model))
        base_model.requires_grad_(False)
        head.requires_grad_(True)
        return base_model
