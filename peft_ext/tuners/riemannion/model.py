"""The Riemannion tuner: finds the target linear layers and wraps them in :class:`~.layer.Linear`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Optional

from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, resolve_quantization_backend
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

from .config import RiemannionConfig
from .layer import Linear, RiemannionLayer

__all__ = ["RiemannionModel"]


def _adapter_names_pre_forward_hook(
    module: nn.Module, args: tuple, kwargs: dict[str, Any], adapter_names: list[str]
) -> tuple[tuple, dict[str, Any]]:
    kwargs["adapter_names"] = adapter_names
    return args, kwargs


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
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        supported = isinstance(base, nn.Linear) or (
            (backend := resolve_quantization_backend(base)) is not None and backend.layer_type == "linear"
        )
        if not supported:
            raise ValueError(
                f"Riemannion supports torch.nn.Linear and quantized linear layers (bitsandbytes Linear8bitLt / "
                f"Linear4bit); the target {current_key!r} is a {type(base).__name__}. Adjust `target_modules`."
            )
        new_module = Linear(target, adapter_name, peft_config)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        # Mixed-adapter batches: PeftModel.forward routes `adapter_names` here; every layer receives it as a kwarg.
        adapter_names = kwargs.pop("adapter_names", None)
        if adapter_names is None:
            yield
            return
        if self.training:
            raise ValueError("`adapter_names` is for inference only; call model.eval() first")
        known = set()
        for module in self.modules():
            if isinstance(module, RiemannionLayer):
                known |= set(module.riemannion_A.keys())
        unknown = {name for name in adapter_names if name != "__base__"} - known
        if unknown:
            raise ValueError(f"`adapter_names` names unknown adapters {sorted(unknown)}; known: {sorted(known)}")
        handles = []
        for module in self.modules():
            # modules_to_save copies (AuxiliaryTrainingWrapper) pick their per-row adapter from the same kwarg
            if isinstance(module, (RiemannionLayer, AuxiliaryTrainingWrapper)):
                hook = partial(_adapter_names_pre_forward_hook, adapter_names=list(adapter_names))
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
