"""The Riemannion tuner: finds the target linear layers and wraps them in :class:`~.layer.Linear`."""

from __future__ import annotations

from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from ...precision import is_half
from ..adapter_tuner import AdapterTuner
from .config import RiemannionConfig
from .layer import Linear, RiemannionLayer

__all__ = ["RiemannionModel"]


class RiemannionModel(AdapterTuner):
    """Riemannion adapters (LoRA on the fixed-rank manifold; METHODS.md section 1) on a model's linear layers.

    Use it through PEFT: ``get_peft_model(model, RiemannionConfig(r=16, target_modules=[...]))``, then train with
    :func:`peft_ext.optim.create_riemannion_optimizer`. Supports several adapters, merging, disabling, deleting and
    mixed-adapter batches (``model(..., adapter_names=[...])`` in eval mode) like PEFT's LoRA, on ``nn.Linear`` and
    bitsandbytes 8-bit / 4-bit linear layers.

    Args:
        model: The model to adapt.
        config: The adapter configuration.
        adapter_name: Name of the first adapter.
        low_cpu_mem_usage: Accepted for PEFT's signature; Riemannion adapters are small and always materialized.
    """

    prefix: str = "riemannion_"
    tuner_layer_cls = RiemannionLayer
    # Same defaults as LoRA (attention query/value projections), which is also what the paper adapts at least.
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    def _new_layer(
        self, peft_config: RiemannionConfig, adapter_name: str, target: nn.Module, current_key: str
    ) -> nn.Module:
        return Linear(target, adapter_name, peft_config)

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """PEFT's cast (half-precision adapters upcast to float32 when ``autocast_adapter_dtype``), then ``A`` made
        orthonormal in float32 again where the upcast adapter had been created in a half-precision base's dtype.

        Args:
            adapter_name: The adapter.
            autocast_adapter_dtype: Upcast bfloat16 / float16 adapters to float32 (PEFT's default).
        """
        super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype)
        for layer in self.adapter_layers():
            if not layer.carries_adapter(adapter_name):
                continue
            # PEFT's own notion of the base dtype, the one the adapter was created in: a bitsandbytes 4-bit layer's
            # compute dtype (its weight is uint8), else the weight's dtype
            _, base_dtype = layer._get_base_layer_device_and_dtype(layer.get_base_layer())
            if base_dtype is not None and is_half(base_dtype) and not is_half(layer.riemannion_A[adapter_name].dtype):
                layer.reorthonormalize(adapter_name)
