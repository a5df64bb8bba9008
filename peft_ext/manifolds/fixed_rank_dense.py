"""Dense m x n references of the fixed-rank geometry, for tests on small sizes.

The textbook definitions that :mod:`.fixed_rank`'s factored functions are tested against (and the Riemannion
optimizer's dense reference step is built from). Half precision is computed in float32 and returned in the input's
dtype, as in :mod:`.fixed_rank`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..precision import is_half
from .fixed_rank import right_basis

__all__ = ["ortho_dense", "proju_dense", "retr_dense"]


def proju_dense(A: Tensor, B: Tensor, Z: Tensor) -> Tensor:
    """``P_T(Z) = A A^T Z + (I - A A^T) Z B_R B_R^T`` with m x n matrices.

    Args:
        A: Left factor of the point (orthonormal columns).
        B: Right factor of the point.
        Z: The m x n matrix to project.
    """
    P_A = A @ A.mT
    B_R = right_basis(B)
    return P_A @ Z + (Z - P_A @ Z) @ B_R @ B_R.mT


def retr_dense(Y: Tensor, r: int) -> Tensor:
    """Best rank-r approximation of the m x n matrix ``Y`` by a full SVD (Eckart-Young).

    Args:
        Y: The matrix.
        r: Target rank.
    """
    if is_half(Y.dtype):
        return retr_dense(Y.float(), r).to(Y.dtype)
    U, S, Vh = torch.linalg.svd(Y, full_matrices=False)
    return (U[:, :r] * S[:r]) @ Vh[:r]


def ortho_dense(Y: Tensor, rtol: float | None = None) -> Tensor:
    """``Y`` with its nonzero singular values set to 1, by a full SVD.

    Args:
        Y: The matrix.
        rtol: Relative threshold below which singular values count as zero (default ``max(m, n) * eps``).
    """
    if is_half(Y.dtype):
        return ortho_dense(Y.float(), rtol).to(Y.dtype)
    U, S, Vh = torch.linalg.svd(Y, full_matrices=False)
    if rtol is None:
        rtol = max(Y.shape) * torch.finfo(S.dtype).eps
    keep = (S > rtol * S[:1]).to(S.dtype)
    return (U * keep) @ Vh
