"""MoRA: modality-common and modality-specific low-rank adaptation of dual encoders (docs/methods.md (MoRA)).

Registered with PEFT as ``"mora"`` (``PeftType.MORA``; PEFT 0.21 ships no type of that name, and the unrelated
"MoRA: High-Rank Updating" is not in PEFT either).

Example::

    from peft import get_peft_model
    from peft_ext import MoRAConfig

    model = get_peft_model(clip_model, MoRAConfig(r=4, top_layers=2))  # attention of the top 2 layers, both towers
    text = model.get_text_features(input_ids=ids)  # one tower alone works too
"""

from __future__ import annotations

from ...registry import register_peft_type
from .config import MoRAConfig
from .layer import Linear, MoRALayer, SharedFactors, magnitude_scale, row_norm
from .model import MoRAModel, MoRATarget, plan_targets

__all__ = [
    "MORA",
    "Linear",
    "MoRAConfig",
    "MoRALayer",
    "MoRAModel",
    "MoRATarget",
    "SharedFactors",
    "magnitude_scale",
    "plan_targets",
    "row_norm",
]

MORA = register_peft_type("mora", config_cls=MoRAConfig, model_cls=MoRAModel)
