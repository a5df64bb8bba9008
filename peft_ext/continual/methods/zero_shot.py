"""``zero_shot``: the pretrained model as it is, scored on every task of an instruction sequence: the reference that
says what the tasks cost a model that was never tuned on them, and what tuning gained."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .base import ContinualMethod, MethodOptions, register_continual_method

if TYPE_CHECKING:
    from ..context import RunContext


@register_continual_method
class ZeroShot(ContinualMethod):
    """The base model untouched (``lr`` and ``weight_decay`` are not used); each task is scored once, since no row
    changes the model."""

    name = "zero_shot"
    task_kinds = ("generation",)
    trains = False
    is_continual_adapter = False

    def __init__(self, options: MethodOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        if self.options.adapt != "every_task":
            raise ValueError(f"`adapt` is for methods that train; {self.name!r} trains nothing")

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        return base_model.requires_grad_(False)
