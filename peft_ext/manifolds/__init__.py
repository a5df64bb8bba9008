"""Manifolds in factored form, with geoopt's vocabulary (``proju``, ``egrad2rgrad``, ``retr``, ``transp``)."""

from __future__ import annotations

from .fixed_rank import (
    FixedRankManifold,
    FixedRankPoint,
    TangentVector,
    egrad2rgrad,
    inner,
    ortho_dense,
    ortho_lowrank,
    orthogonalize,
    proju,
    proju_dense,
    random_point,
    retr,
    retr_dense,
    right_basis,
    tangent_factors,
    tangent_to_dense,
    to_dense,
    transp,
)

__all__ = [
    "FixedRankManifold",
    "FixedRankPoint",
    "TangentVector",
    "egrad2rgrad",
    "inner",
    "ortho_dense",
    "ortho_lowrank",
    "orthogonalize",
    "proju",
    "proju_dense",
    "random_point",
    "retr",
    "retr_dense",
    "right_basis",
    "tangent_factors",
    "tangent_to_dense",
    "to_dense",
    "transp",
]
