"""What the LoRA baselines share: PEFT's LoRA around the model, the head saved with it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from .base import ContinualMethod, LoraOptions, saved_head

if TYPE_CHECKING:
    from ..context import RunContext


class LoraMethod(ContinualMethod):
    options_cls = LoraOptions

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        from peft import get_peft_model

        config = self.options.adapter_config(modules_to_save=saved_head(base_model, ctx))
        return get_peft_model(base_model, config)
