"""The Riemannion tuner: finds the target linear layers and wraps them in :class:`~.layer.Linear`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from peft.tuners.tuners_utils import BaseTuner
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from .._common import forward_adapter_names, require_linear_target
from .config import RiemannionConfig
from .layer import Linear, RiemannionLayer

__all__ = ["RiemannionModel"]


class RiemannionModel(BaseTuner):
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

    def _create_and_replace(
        self,
        peft_config: RiemannionConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        *,
        parameter_name: Optional[str] = None,
    ) -> None:
        if parameter_name is not None:
            raise ValueError(
                f"Riemannion adapts whole linear layers, not parameters; got target_parameters {parameter_name!r}"
            )
        if isinstance(target, RiemannionLayer):
            target.update_layer(adapter_name, peft_config, inference_mode=peft_config.inference_mode)
            return
        require_linear_target(target, current_key, "Riemannion")
        new_module = Linear(target, adapter_name, peft_config)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        # Mixed-adapter batches: PeftModel.forward routes `adapter_names` here; every layer receives it as a kwarg.
        names = kwargs.pop("adapter_names", None)
        with forward_adapter_names(
            self,
            names,
            lambda: set().union(*(m.riemannion_A.keys() for m in self.modules() if isinstance(m, RiemannionLayer))),
            (RiemannionLayer,),
        ):
            yield
