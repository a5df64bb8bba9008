"""Riemannion: LoRA on the fixed-rank manifold (docs/methods.md (Riemannion)), registered with PEFT as
``"riemannion"``.

Example::

    from peft import get_peft_model
    from peft_ext import RiemannionConfig
    from peft_ext.optim import create_riemannion_optimizer
    from peft_ext.tuners.riemannion import initialize_loi

    model = get_peft_model(base, RiemannionConfig(r=16, target_modules=["q_proj", "v_proj"]))
    initialize_loi(model, calibration_batches)  # optional: the gradient-informed LOI start
    optimizer = create_riemannion_optimizer(model, lr=3e-2, aux_lr=3e-3)  # manifold lr, AdamW lr of the rest
"""

from __future__ import annotations

import importlib
from typing import Any

from ...registry import register_peft_type
from .config import RiemannionConfig
from .layer import AdapterRef, Linear, RiemannionLayer, find_adapters
from .loi import LoiResult, backprop_rsvd, initialize_loi
from .model import RiemannionModel

__all__ = [
    "RIEMANNION",
    "AdapterRef",
    "Linear",
    "LoiResult",
    "RiemannionConfig",
    "RiemannionLayer",
    "RiemannionModel",
    "backprop_rsvd",
    "find_adapters",
    "initialize_loi",
    "riemannian_parameters",
]

RIEMANNION = register_peft_type("riemannion", config_cls=RiemannionConfig, model_cls=RiemannionModel)


def __getattr__(name: str) -> Any:
    # geoopt is imported on first use of riemannian_parameters: its import (about half a second) is not needed by
    # the layer, the tuner or the Riemannion optimizer
    if name == "riemannian_parameters":
        return importlib.import_module(".geoopt_params", __name__).riemannian_parameters
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
