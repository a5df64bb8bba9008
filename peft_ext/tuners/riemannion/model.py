"""The Riemannion tuner: finds the target linear layers and wraps them in :class:`~.layer.Linear`."""

from __future__ import annotations

import warnings
from typing import Any

from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from ..adapter_tuner import AdapterTuner
from .config import RiemannionConfig
from .layer import Linear, RiemannionLayer

__all__ = ["RiemannionModel"]


class RiemannionModel(AdapterTuner):
    """Riemannion adapters (LoRA on the fixed-rank manifold; docs/methods.md (Riemannion)) on a model's linear layers.

    Use it through PEFT: ``get_peft_model(model, RiemannionConfig(r=16, target_modules=[...]))``, then train with
    :func:`peft_ext.optim.create_riemannion_optimizer`. Supports several adapters, merging, disabling, deleting and
    mixed-adapter batches (``model(..., adapter_names=[...])`` in eval mode) like PEFT's LoRA, on ``nn.Linear`` and
    bitsandbytes 8-bit / 4-bit linear layers.

    Args:
        model: The model to adapt.
        config: The adapter configuration.
        adapter_name: Name of the first adapter.
        low_cpu_mem_usage: Create the adapter weights on the meta device (PEFT's loading path), as LoRA does.
    """

    prefix: str = "riemannion_"
    tuner_layer_cls = RiemannionLayer
    # Same defaults as LoRA (attention query/value projections), which is also what the paper adapts at least.
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        """PEFT's injection; then one warning naming the layers narrower than ``r``, which got rank ``min(out, in)``
        (a rank-``r`` point does not exist there; LoRA accepts such layers, over-complete)."""
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        r = self.peft_config[adapter_name].r
        capped = [
            f"{name} ({layer.out_features} x {layer.in_features}: rank {layer.r[adapter_name]})"
            for name, layer in model.named_modules()
            if isinstance(layer, RiemannionLayer) and layer.r.get(adapter_name, r) < r
        ]
        if capped:
            warnings.warn(
                f"Riemannion: `r`={r} is larger than min(out_features, in_features) of {len(capped)} layer(s), "
                f"which get the largest rank they have: {', '.join(capped[:4])}{' ...' if len(capped) > 4 else ''}. "
                "Exclude them (`exclude_modules`) to leave them without an adapter.",
                UserWarning,
                stacklevel=3,
            )

    def _new_layer(
        self, peft_config: RiemannionConfig, adapter_name: str, target: nn.Module, current_key: str
    ) -> nn.Module:
        return Linear(target, adapter_name, peft_config)
