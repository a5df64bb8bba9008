"""Step 3 of docs/adding_an_adapter.md: the tuner that finds the target layers and wraps them."""

from __future__ import annotations

from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, get_quantization_kwargs
from torch import nn

from peft_ext.tuners import AdapterTuner

from .config import ScaledLowRankConfig
from .layer import Linear, ScaledLowRankLayer


class ScaledLowRankModel(AdapterTuner):
    """Scaled low-rank adapters on a model's linear layers; use it through ``get_peft_model``."""

    prefix: str = "scaledlr_"
    tuner_layer_cls = ScaledLowRankLayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    def _new_layer(
        self, peft_config: ScaledLowRankConfig, adapter_name: str, target: nn.Module, current_key: str
    ) -> nn.Module:
        return Linear(target, adapter_name, peft_config, **get_quantization_kwargs(self.model))
