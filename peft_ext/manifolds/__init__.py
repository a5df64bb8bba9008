"""Manifolds in factored form, with geoopt's vocabulary (``proju``, ``egrad2rgrad``, ``retr``, ``transp``).

Exports everything public of :mod:`.fixed_rank`, :mod:`.fixed_rank_dense` and :mod:`.geoopt_manifold`; each module's
``__all__`` is the one list of its names. The geoopt module is imported on first use of one of its names: importing
geoopt (the TorchScript-compiled math of its hyperbolic manifolds) takes about half a second, which the Riemannion
layer and optimizer, importers of this package, do not need.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import fixed_rank, fixed_rank_dense
from .fixed_rank import *  # noqa: F403  (the names of fixed_rank.__all__)
from .fixed_rank_dense import *  # noqa: F403  (the names of fixed_rank_dense.__all__)

_GEOOPT_NAMES = ("STIEFEL", "FactoredFixedRank")  # geoopt_manifold.__all__, tested equal

__all__ = [*fixed_rank.__all__, *fixed_rank_dense.__all__, *_GEOOPT_NAMES]


def __getattr__(name: str) -> Any:
    if name in _GEOOPT_NAMES:
        return getattr(importlib.import_module(".geoopt_manifold", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
