"""The adapter types (one package each) and the skeleton they are built on.

A new adapter type needs a config, a layer on :class:`AdapterLayer` / :class:`AdapterLinear`, a tuner on
:class:`AdapterTuner` and a registration; docs/adding_an_adapter.md walks through it.
"""

from __future__ import annotations

from ._common import matches_targets, require_linear_target, require_positive_int, validate_target_selection
from .adapter_config import AdapterConfig
from .adapter_layer import AdapterLayer, AdapterLinear, delta_matmul
from .adapter_tuner import AdapterTuner

__all__ = [
    "AdapterConfig",
    "AdapterLayer",
    "AdapterLinear",
    "AdapterTuner",
    "delta_matmul",
    "matches_targets",
    "require_linear_target",
    "require_positive_int",
    "validate_target_selection",
]
