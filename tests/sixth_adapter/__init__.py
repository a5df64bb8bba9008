"""Step 4 of docs/adding_an_adapter.md: a test-only sixth adapter type, registered with PEFT as ``"scaledlr"``.

Built only through the documented steps, to prove them: ``tests/test_adding_an_adapter.py`` runs the tuner contract
over it.
"""

from __future__ import annotations

from peft_ext import register_peft_type

from .config import ScaledLowRankConfig
from .layer import Linear, ScaledLowRankLayer
from .model import ScaledLowRankModel

__all__ = ["SCALEDLR", "Linear", "ScaledLowRankConfig", "ScaledLowRankLayer", "ScaledLowRankModel"]

SCALEDLR = register_peft_type("scaledlr", config_cls=ScaledLowRankConfig, model_cls=ScaledLowRankModel)
