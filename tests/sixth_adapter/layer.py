"""Step 2 of docs/adding_an_adapter.md: the layer. Only state and delta math; the skeleton does the rest."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from peft_ext.tuners import AdapterLayer, AdapterLinear, delta_matmul

from .config import ScaledLowRankConfig


class ScaledLowRankLayer(AdapterLayer):
    """Per adapter: ``scaledlr_A`` (``r x in``), ``scaledlr_B`` (``out x r``) and the scale ``alpha / r``."""

    method_name = "ScaledLowRank"
    adapter_dict_name = "scaledlr_A"
    adapter_layer_names: tuple[str, ...] = ("scaledlr_A", "scaledlr_B")
    other_param_names: tuple[str, ...] = ("r", "scaling")

    def __init__(self, base_layer: nn.Module, **kwargs: Any) -> None:
        AdapterLayer.__init__(self, base_layer, **kwargs)  # also scaledlr_A / scaledlr_B, empty ParameterDicts
        self.r, self.scaling = {}, {}  # per adapter: rank, alpha / r

    def update_layer(self, adapter_name: str, config: ScaledLowRankConfig, inference_mode: bool = False) -> None:
        """Add (or re-create) adapter ``adapter_name``.

        Args:
            adapter_name: Name of the adapter.
            config: Its configuration.
            inference_mode: Create it frozen.
        """
        r, n, m = config.r, self.in_features, self.out_features
        if r > min(m, n):
            raise ValueError(f"`r`={r} is larger than min(out_features, in_features) = {min(m, n)} for this layer")
        self.r[adapter_name] = r
        self.scaling[adapter_name] = config.scaling
        self.scaledlr_A[adapter_name] = nn.Parameter(torch.randn(r, n) / math.sqrt(n))
        b = torch.zeros(m, r) if config.init_weights else torch.randn(m, r) * 0.1
        self.scaledlr_B[adapter_name] = nn.Parameter(b)
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def adapter_output(self, x: torch.Tensor, adapter_name: str, rows: Optional[list[int]] = None) -> torch.Tensor:
        A, B = self.scaledlr_A[adapter_name], self.scaledlr_B[adapter_name]
        return (x @ A.mT) @ B.mT * self.scaling[adapter_name]

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        return delta_matmul(self.scaledlr_B[adapter_name], self.scaledlr_A[adapter_name]) * self.scaling[adapter_name]


class Linear(AdapterLinear, ScaledLowRankLayer):
    """A linear (or quantized linear) layer with scaled low-rank adapters.

    Args:
        base_layer: The layer to adapt.
        adapter_name: Name of the first adapter.
        config: Its configuration.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: ScaledLowRankConfig, **kwargs: Any) -> None:
        super().__init__()
        ScaledLowRankLayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, inference_mode=config.inference_mode)
