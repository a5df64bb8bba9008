"""A minimal adapter type used only by the tests to prove that registration works end to end.

"toyscale" rescales each output feature of a target ``nn.Linear``: ``y = base(x) + (x @ W.T) * s`` with a trainable
vector ``s`` (one entry per output feature). With ``s = 0`` (the default) the adapted model equals the base model.
Merging is exact in structure: ``W <- W * (1 + s)[:, None]``, and unmerging divides it out again.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, check_adapters_to_merge
from peft.utils import PeftType
from torch import nn

from peft_ext import register_peft_type


@dataclass
class ToyScaleConfig(PeftConfig):
    """Config of the toy "toyscale" adapter.

    Args:
        target_modules: Names (or a regex) of the ``nn.Linear`` modules to adapt.
        init_scale: Initial value of every entry of ``s``; 0 makes the adapter start as the identity.
    """

    target_modules: Optional[Union[list[str], str]] = field(default=None, metadata={"help": "Modules to adapt."})
    init_scale: float = field(default=0.0, metadata={"help": "Initial value of the per-output scale s."})

    def __post_init__(self) -> None:
        super().__post_init__()
        # Looked up by name rather than through the module-level TOYSCALE: register_peft_type instantiates this config
        # to check it, before the module-level assignment has happened.
        self.peft_type = PeftType.TOYSCALE
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)


class ToyScaleLayer(BaseTunerLayer):
    adapter_layer_names: tuple[str, ...] = ("toyscale_s",)

    def __init__(self, base_layer: nn.Linear) -> None:
        self.base_layer = base_layer
        self.toyscale_s = nn.ParameterDict({})
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features

    def update_layer(self, adapter_name: str, init_scale: float) -> None:
        weight = self.get_base_layer().weight
        self.toyscale_s[adapter_name] = nn.Parameter(
            torch.full((self.out_features,), float(init_scale), dtype=weight.dtype, device=weight.device)
        )
        self.set_adapter(self.active_adapters)


class ToyScaleLinear(nn.Module, ToyScaleLayer):
    def __init__(self, base_layer: nn.Linear, adapter_name: str, init_scale: float) -> None:
        super().__init__()
        ToyScaleLayer.__init__(self, base_layer)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, init_scale)

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        weight = self.get_base_layer().weight
        for name in check_adapters_to_merge(self, adapter_names):
            if name not in self.toyscale_s:
                continue
            merged = weight.data * (1 + self.toyscale_s[name].detach())[:, None]
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(f"Merging adapter {name!r} produced non-finite weights.")
            weight.data = merged
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", UserWarning, stacklevel=2)
            return
        weight = self.get_base_layer().weight
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name in self.toyscale_s:
                weight.data = weight.data / (1 + self.toyscale_s[name].detach())[:, None]

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        unbiased = F.linear(x, self.get_base_layer().weight)
        for name in self.active_adapters:
            if name in self.toyscale_s:
                result = result + unbiased * self.toyscale_s[name]
        return result

    def __repr__(self) -> str:
        return "toyscale." + super().__repr__()


class ToyScaleModel(BaseTuner):
    prefix: str = "toyscale_"
    tuner_layer_cls = ToyScaleLayer
    target_module_mapping: dict[str, list[str]] = {}

    def _create_and_replace(
        self,
        peft_config: ToyScaleConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        *,
        parameter_name: Optional[str] = None,
    ) -> None:
        if isinstance(target, ToyScaleLayer):
            target.update_layer(adapter_name, peft_config.init_scale)
            return
        if not isinstance(target, nn.Linear):
            raise ValueError(f"toyscale only adapts torch.nn.Linear, got {type(target).__name__} at {current_key!r}.")
        new_module = ToyScaleLinear(target, adapter_name, peft_config.init_scale)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)


TOYSCALE = register_peft_type("toyscale", config_cls=ToyScaleConfig, model_cls=ToyScaleModel)
