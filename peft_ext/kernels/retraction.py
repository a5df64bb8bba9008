"""Batched retraction on the fixed-rank manifold: every same-shaped adapter in one pass, CholeskyQR2 on the GPU.

The retraction (docs/methods.md (Riemannion), :func:`peft_ext.manifolds.fixed_rank.retr`) takes the best rank-r
approximation of ``x_scale * X + u = [A_dot, A] [B_R, x_scale * B + B_dot]^T``: QR both tall m x 2r and n x 2r
factors, SVD the 2r x 2r core, keep the top r. The Riemannion optimizer stacks adapters of equal shape and retracts
the stack in one call (:func:`retract`); :func:`stack_by_shape` forms the stacks (the optimizer and
:func:`batched_retraction`, which retracts any list of adapters in place, both use it).

Methods (``method=``):

- ``"qr"``: :func:`~peft_ext.manifolds.fixed_rank.retr` itself (Householder QR via ``torch.linalg.qr``). The
  reference, and what CPU runs use, so Riemannion's CPU numbers are unchanged.
- ``"cholqr2"``: the fast algorithm with torch matmuls (a CPU-testable twin of ``"triton"``).
- ``"triton"``: the fast algorithm with the batched Gram ``X^T Y`` and ``X M`` products as Triton kernels
  (:mod:`.triton_retraction`); the Cholesky factorizations, triangular inverses and the 2r x 2r SVD stay batched torch
  calls (tiny).
- ``"auto"``: ``"triton"`` for fp32 CUDA tensors when Triton imports and ``PEFT_EXT_KERNELS`` is not ``torch``,
  else ``"qr"``.

The fast algorithm uses what the geometry already knows: ``A`` and ``B_R`` are orthonormal. So each tall factor is
an orthonormal block ``P`` plus a block ``W`` (``A_dot`` next to ``A``; ``x_scale * B + B_dot`` next to ``B_R``):
project ``W`` off ``P`` twice ("twice is enough", Giraud et al. 2005), then CholeskyQR2 (Fukaya et al. 2014) of the
n x r remainder with its columns equilibrated. A plain CholeskyQR of ``[B_R, x_scale * B + B_dot]`` would square a
condition number of about ``1 / lr`` (the second block is ``B`` plus a step of size ``lr``) and fail in fp32; the
remainder has only the step's own conditioning. Entries whose Gram matrix is still too ill-conditioned (Cholesky
fails or a pivot is below ``10 sqrt(eps)``, e.g. a zero step) are redone with ``"qr"``, one host sync per call.
Factors are defined up to rotations/signs, so fast and reference results agree in ``A B^T`` (tests check this).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Literal, Optional

import torch
from torch import Tensor

from ..manifolds.fixed_rank import FixedRankPoint, TangentVector, retr
from ..precision import is_half
from .dispatch import RetractionKernels, kernel_mode, load_retraction_kernels

__all__ = ["batched_retraction", "cholesky_qr2", "choose_retraction", "retract", "stack_by_shape"]

_METHODS = ("auto", "qr", "cholqr2", "triton")
Method = Literal["auto", "qr", "cholqr2", "triton"]
GramFn = Callable[[Tensor, Optional[Tensor]], Tensor]
MatmulFn = Callable[[Tensor, Tensor], Tensor]


def _torch_gram(x: Tensor, y: Optional[Tensor] = None) -> Tensor:
    return x.mT @ (x if y is None else y)


def _triton_kernels() -> RetractionKernels:
    kernels = load_retraction_kernels()
    if kernels is None:
        raise ImportError("method='triton' needs the `triton` package (Linux x86-64); use 'cholqr2' or 'qr'")
    return kernels


def choose_retraction(A: Tensor) -> str:
    """The method ``"auto"`` resolves to for factors like ``A``: ``"triton"`` or ``"qr"`` (see the module doc)."""
    if kernel_mode() == "torch" or not A.is_cuda or A.dtype != torch.float32:
        return "qr"
    kernels = load_retraction_kernels()
    return "triton" if kernels is not None and A.shape[-1] <= kernels.max_columns else "qr"


def cholesky_qr2(
    X: Tensor, gram: GramFn = _torch_gram, matmul: MatmulFn = torch.matmul
) -> tuple[Tensor, Tensor, Tensor]:
    """CholeskyQR2 of a batch of tall matrices: ``X = Q R`` with ``Q`` orthonormal and ``diag(R) > 0``.

    Columns are equilibrated (the Gram matrix scaled to unit diagonal) before the first Cholesky, so only the
    conditioning of the column directions counts, not their lengths.

    Args:
        X: (..., m, c) with m >= c.
        gram: Batched ``x^T y`` (``y`` defaults to ``x``); :func:`.triton_retraction.gram` on the GPU.
        matmul: Batched ``x @ m`` for a c x c ``m``; :func:`.triton_retraction.matmul_small` on the GPU.

    Returns:
        ``(Q, R, ok)``: ``ok`` (bool, one per matrix) is false where the factorization is not trustworthy (Cholesky
        failed or a pivot of the equilibrated Gram is below ``10 sqrt(eps)``); there ``Q`` and ``R`` are finite but
        meaningless and the caller must use another QR.
    """
    eye = torch.eye(X.shape[-1], dtype=X.dtype, device=X.device)
    G = gram(X, None).to(X.dtype)
    d = torch.diagonal(G, dim1=-2, dim2=-1).clamp_min(torch.finfo(X.dtype).tiny).sqrt()
    L, info = torch.linalg.cholesky_ex(G / (d.unsqueeze(-1) * d.unsqueeze(-2)))
    min_pivot = 10 * torch.finfo(X.dtype).eps ** 0.5
    ok = (info == 0) & (torch.diagonal(L, dim1=-2, dim2=-1).amin(-1) > min_pivot)
    ok &= torch.isfinite(L).flatten(-2).all(-1)
    R1 = torch.where(ok[..., None, None], L.mT * d.unsqueeze(-2), eye)  # R1 = L^T D
    Q1 = matmul(X, torch.linalg.solve_triangular(R1, eye, upper=True)).to(X.dtype)
    L2, info2 = torch.linalg.cholesky_ex(gram(Q1, None).to(X.dtype))
    ok &= (info2 == 0) & torch.isfinite(L2).flatten(-2).all(-1)
    R2 = torch.where(ok[..., None, None], L2.mT, eye)
    Q = matmul(Q1, torch.linalg.solve_triangular(R2, eye, upper=True)).to(X.dtype)
    return Q, R2 @ R1, ok


def _extend_basis(P: Tensor, W: Tensor, gram: GramFn, matmul: MatmulFn) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``W = P C + Q R`` with ``P`` orthonormal, ``Q`` orthonormal and orthogonal to ``P``; returns (Q, R, C, ok)."""
    C = gram(P, W).to(W.dtype)
    W_perp = W - matmul(P, C).to(W.dtype)
    C2 = gram(P, W_perp).to(W.dtype)
    W_perp = W_perp - matmul(P, C2).to(W.dtype)
    Q, R, ok = cholesky_qr2(W_perp, gram, matmul)
    return Q, R, C + C2, ok


def _retract_fast(point: FixedRankPoint, u: TangentVector, x_scale: float, gram: GramFn, matmul: MatmulFn):
    A, B_R = point.A, point.B_R
    r = A.shape[-1]
    # [A_dot, A] = [Q_a, A] [[R_a, 0], [C_a, I]]  and  [B_R, W] = [Q_w, B_R] [[0, R_w], [I, C_w]]
    Q_a, R_a, C_a, ok_a = _extend_basis(A, u.A_dot, gram, matmul)
    Q_w, R_w, C_w, ok_w = _extend_basis(B_R, point.B * x_scale + u.B_dot, gram, matmul)
    eye = torch.eye(r, dtype=A.dtype, device=A.device).expand_as(R_a)
    zero = torch.zeros_like(R_a)
    T_L = torch.cat([torch.cat([R_a, zero], -1), torch.cat([C_a, eye], -1)], -2)
    T_R = torch.cat([torch.cat([zero, R_w], -1), torch.cat([eye, C_w], -1)], -2)
    P, S, Qh = torch.linalg.svd(T_L @ T_R.mT, full_matrices=False)
    P_r, V_r = P[..., :r], Qh[..., :r, :].mT
    A_new = matmul(Q_a, P_r[..., :r, :].contiguous()).to(A.dtype) + matmul(A, P_r[..., r:, :].contiguous())
    B_new = matmul(Q_w, V_r[..., :r, :].contiguous()).to(A.dtype) + matmul(B_R, V_r[..., r:, :].contiguous())
    return A_new.to(A.dtype), (B_new * S[..., :r].unsqueeze(-2)).to(A.dtype), ok_a & ok_w


def retract(point: FixedRankPoint, u: TangentVector, x_scale: float = 1.0, method: Method = "auto") -> FixedRankPoint:
    """Best rank-r approximation of ``x_scale * X + u`` for a stack of same-shaped points, by ``method``.

    Same contract as :func:`peft_ext.manifolds.fixed_rank.retr` (which ``method="qr"`` calls); the Riemannion
    optimizer's retraction.

    Args:
        point: The points, factors of shape (..., m, r) and (..., n, r).
        u: Tangent vectors at them (already scaled by the step size).
        x_scale: Factor on ``X`` (decoupled weight decay).
        method: ``"auto"``, ``"qr"``, ``"cholqr2"`` or ``"triton"``; see the module docstring. Half-precision
            points are retracted in float32 and returned in their dtype.
    """
    if method not in _METHODS:
        raise ValueError(f"`method` must be one of {_METHODS}, got {method!r}")
    if is_half(point.A.dtype):
        # Cholesky and SVD need float32: half-precision points are retracted there and rounded back
        wide = FixedRankPoint(point.A.float(), point.B.float(), point.B_R.float())
        new = retract(wide, TangentVector(u.A_dot.float(), u.B_dot.float()), x_scale, method)
        return FixedRankPoint.from_factors(new.A.to(point.A.dtype), new.B.to(point.B.dtype))
    if method == "auto":
        method = choose_retraction(point.A)
    if method == "qr":
        return retr(point, u, x_scale)
    if method == "triton":
        kernels = _triton_kernels()
        gram, matmul = kernels.gram, kernels.matmul
    else:
        gram, matmul = _torch_gram, torch.matmul
    A_new, B_new, ok = _retract_fast(point, u, x_scale, gram, matmul)
    if not bool(ok.all()):
        bad = ~ok
        sub = retr(
            FixedRankPoint(point.A[bad], point.B[bad], point.B_R[bad]),
            TangentVector(u.A_dot[bad], u.B_dot[bad]),
            x_scale,
        )
        A_new[bad], B_new[bad] = sub.A, sub.B
    return FixedRankPoint.from_factors(A_new, B_new)


def stack_by_shape(
    rows: Sequence[Sequence[Tensor]], keys: Optional[Sequence[Hashable]] = None
) -> list[tuple[list[int], list[Tensor]]]:
    """Group adapters whose factors agree in shape, dtype and device, and stack each group in working precision.

    Same-shaped adapters are retracted (and, in the optimizer, orthogonalized) in one batched call: a transformer
    has many of them, and per-adapter QR/SVD calls would dominate the step.

    Args:
        rows: Per adapter: its factors ``A`` (m x r) and ``B`` (n x r), then any tensors of the same adapter to stack
            alongside (a tangent step, gradients, momentum). Rows of one group must have the same length.
        keys: An extra grouping key per row (e.g. whether the adapter already has momentum).

    Returns:
        Per group, in order of first appearance: the indices of its rows (in order) and each column of the rows
        stacked, cast to ``promote_types(A.dtype, float32)`` (half-precision factors are updated in fp32).
    """
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        A, B = row[0], row[1]
        key = (tuple(A.shape), tuple(B.shape), A.dtype, A.device, None if keys is None else keys[i])
        groups.setdefault(key, []).append(i)
    stacked = []
    for (_, _, dtype, _, _), indices in groups.items():
        work = torch.promote_types(dtype, torch.float32)
        columns = zip(*(rows[i] for i in indices))
        stacked.append((indices, [torch.stack([t.to(work) for t in column]) for column in columns]))
    return stacked


def batched_retraction(
    adapters: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]], x_scale: float = 1.0, method: Method = "auto"
) -> None:
    """Retract many adapters in place, one batched :func:`retract` per group of equal shape, dtype and device.

    Args:
        adapters: ``(A, B, A_dot, B_dot)`` per adapter: the point (``A`` orthonormal, m x r; ``B``, n x r) and the
            tangent step (m x r, n x r). ``A`` and ``B`` are overwritten with the new point's factors.
        x_scale: Factor on every ``X`` (decoupled weight decay).
        method: See :func:`retract`.
    """
    for indices, (A, B, A_dot, B_dot) in stack_by_shape(adapters):
        new = retract(FixedRankPoint.from_factors(A, B), TangentVector(A_dot, B_dot), x_scale, method)
        targets = [adapters[i][0] for i in indices] + [adapters[i][1] for i in indices]
        torch._foreach_copy_(targets, list(new.A.unbind(0)) + list(new.B.unbind(0)))
