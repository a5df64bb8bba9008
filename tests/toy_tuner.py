"""A minimal adapter type used only by the tests to prove that registration works end to end.

"toyscale" rescales each output feature of a target ``nn.Linear``: ``y = base(x) + (x @ W.T) * s`` with a trainable
vector ``s`` (one entry per output feature). With ``s = 0`` (the default) the adapted model equals the base model.
Merging is exact in structure: ``W <- W * (1 + s)[:, None]``, and unmerging divides it out again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from peft.config import PeftConfig
from peft.utils import PeftType
from torch import nn

from peft_ext import register_peft_type
from peft_ext.tuners import AdapterLayer, AdapterLinear, AdapterTuner


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


class ToyScaleLayer(AdapterLayer):
    method_name = "toyscale"
    adapter_dict_name = "toyscale_s"
    adapter_layer_names: tuple[str, ...] = ("toyscale_s",)

    def __init__(self, base_layer: nn.Linear, **kwargs: Any) -> None:
        AdapterLayer.__init__(self, base_layer, **kwargs)
        self.toyscale_s = nn.ParameterDict({})

    def update_layer(self, adapter_name: str, config: ToyScaleConfig, inference_mode: bool = False) -> None:
        weight = self.get_base_layer().weight
        self.toyscale_s[adapter_name] = nn.Parameter(
            torch.full((self.out_features,), float(config.init_scale), dtype=weight.dtype, device=weight.device)
        )
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def adapter_output(self, x: torch.Tensor, adapter_name: str, rows: Optional[list[int]] = None) -> torch.Tensor:
        return F.linear(x, self.get_base_layer().weight) * self.toyscale_s[adapter_name]

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        return self.get_base_layer().weight * self.toyscale_s[adapter_name][:, None]

    # The merged weight W (1 + s) is exact to invert by division; subtracting s W' would not be.
    def merged_weight(self, weight: torch.Tensor, adapter_name: str) -> torch.Tensor:
        return weight * (1 + self.toyscale_s[adapter_name].detach())[:, None]

    def unmerged_weight(self, weight: torch.Tensor, adapter_name: str) -> torch.Tensor:
        return weight / (1 + self.toyscale_s[adapter_name].detach())[:, None]


class ToyScaleLinear(AdapterLinear, ToyScaleLayer):
    def __init__(self, base_layer: nn.Linear, adapter_name: str, config: ToyScaleConfig) -> None:
        super().__init__()
        ToyScaleLayer.__init__(self, base_layer)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config)


class ToyScaleModel(AdapterTuner):
    prefix: str = "toyscale_"
    tuner_layer_cls = ToyScaleLayer
    target_module_mapping: dict[str, list[str]] = {}

    def _update_target(
        self, target: ToyScaleLayer, peft_config: ToyScaleConfig, adapter_name: str, current_key: str
    ) -> None:
        target.update_layer(adapter_name, peft_config)

    def _new_layer(self, peft_config: ToyScaleConfig, adapter_name: str, target: nn.Module, current_key: str):
        return ToyScaleLinear(target, adapter_name, peft_config)


TOYSCALE = register_peft_type("toyscale", config_cls=ToyScaleConfig, model_cls=ToyScaleModel)
