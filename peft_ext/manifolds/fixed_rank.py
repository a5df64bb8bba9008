"""The manifold of fixed-rank matrices M_r = {X in R^{m x n} : rank X = r}, in factored form.

Reference: docs/methods.md (Riemannion; Bogachev et al., arXiv 2507.12142) and the standard fixed-rank geometry
(Vandereycken 2013; Absil, Mahony & Sepulchre 2008).

Representation, never an m x n matrix:

- a point is ``X = A B^T`` with ``A`` (m x r) having orthonormal columns and ``B`` (n x r); ``B_R = qr(B).Q``;
- a tangent vector at X is ``xi = A_dot B_R^T + A B_dot^T`` with ``A^T A_dot = 0``; its rank is at most 2r;
- an ambient low-rank matrix is a pair ``(U, V)`` meaning ``U V^T``.

Every factored operation costs O((m + n) r^2 + r^3) and accepts leading batch dimensions (a stack of same-shaped
points is processed in one call, which is how the optimizer updates many adapters at once). The textbook m x n
definitions, references for tests on small sizes, are in :mod:`.fixed_rank_dense`.

The :class:`FixedRankManifold` object speaks geoopt's vocabulary (``proju``, ``egrad2rgrad``, ``retr``, ``transp``,
``inner``) so optimizers can be written against it the way geoopt's optimizers are written against its manifolds;
:class:`~.geoopt_manifold.FactoredFixedRank` is the same geometry as a ``geoopt.Manifold``, for geoopt's optimizers.

Half precision: the functions that factor (:func:`right_basis`, :func:`ortho_lowrank`, :func:`retr`,
:func:`random_point` and the dense references) take bfloat16 / float16 factors, compute in float32 and return the
input's dtype (:func:`peft_ext.precision.compute_dtype`); CPU QR and SVD kernels do not exist in half precision. The
other functions are products and keep the input's dtype. Float32 and float64 inputs are computed as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..precision import is_half

__all__ = [
    "FixedRankManifold",
    "FixedRankPoint",
    "TangentVector",
    "egrad2rgrad",
    "inner",
    "ortho_lowrank",
    "orthogonalize",
    "proju",
    "random_point",
    "reorthonormalize",
    "retr",
    "right_basis",
    "stack_bases",
    "tangent_factors",
    "tangent_to_dense",
    "to_dense",
    "transp",
]


def _qr(M: Tensor) -> tuple[Tensor, Tensor]:
    """Reduced QR with the signs fixed so that diag(R) >= 0, which makes Q a function of span and order alone."""
    Q, R = torch.linalg.qr(M)
    # sign(d + 0.5 * [d == 0]) is +1 for d >= 0 and -1 for d < 0 (geoopt uses the same trick for its QR retraction)
    signs = torch.diagonal(R, dim1=-2, dim2=-1).sign().add(0.5).sign()
    return Q * signs.unsqueeze(-2), R * signs.unsqueeze(-1)


def right_basis(B: Tensor) -> Tensor:
    """``B_R``: an orthonormal basis (n x r) of the column space of ``B`` (n x r), the Q factor of its reduced QR.

    Deterministic for a given ``B`` (signs fixed), so the layer's forward pass and the optimizer obtain the same basis
    independently. A stack (..., n, r) is factored one matrix at a time: a batched QR rounds the last bits
    differently from the single-matrix one (it depends on where each matrix sits in memory), and the optimizer's
    stacked bases must equal, bit for bit, what each layer computes for its own ``B``.

    Args:
        B: The right factor of a point, shape (n, r) or (..., n, r); half precision is factored in float32 and the
            basis is returned in ``B``'s dtype.
    """
    if is_half(B.dtype):
        return right_basis(B.float()).to(B.dtype)
    if B.ndim == 2 or B.numel() == 0:
        return _qr(B)[0]
    flat = B.reshape(-1, *B.shape[-2:])
    return stack_bases([_qr(b)[0] for b in flat.unbind(0)]).reshape(B.shape)


def stack_bases(bases: Sequence[Tensor]) -> Tensor:
    """Stack right bases (n x r each) into (k, n, r) laid out as a batched QR lays out its Q (column-major matrices).

    Products with the stack then round exactly as products with a batched QR's output do: matmul picks its kernel by
    memory layout, and the last bits depend on it.

    Args:
        bases: :func:`right_basis` of each matrix, all of one shape.
    """
    return torch.stack([q.mT for q in bases]).mT


@dataclass(frozen=True)
class FixedRankPoint:
    """A point ``X = A B^T`` of M_r.

    Args:
        A: Left factor (m x r) with orthonormal columns.
        B: Right factor (n x r).
        B_R: Orthonormal basis of span(B), :func:`right_basis` of ``B``.
    """

    A: Tensor
    B: Tensor
    B_R: Tensor

    @classmethod
    def from_factors(cls, A: Tensor, B: Tensor) -> FixedRankPoint:
        """Build a point from ``A`` (orthonormal columns) and ``B``; computes ``B_R``.

        Args:
            A: Left factor, shape (m, r), orthonormal columns.
            B: Right factor, shape (n, r).
        """
        if A.ndim < 2 or A.shape[:-2] != B.shape[:-2] or A.shape[-1] != B.shape[-1]:
            raise ValueError(
                f"A point needs A (m x r) and B (n x r) with the same r (and the same leading batch shape); got "
                f"A {tuple(A.shape)}, B {tuple(B.shape)}"
            )
        return cls(A, B, right_basis(B))

    @property
    def rank(self) -> int:
        return self.A.shape[-1]


@dataclass(frozen=True)
class TangentVector:
    """A tangent vector ``xi = A_dot B_R^T + A B_dot^T`` at a point (A, B_R), with ``A^T A_dot = 0``.

    Tangent vectors at the same point add and scale componentwise.

    Args:
        A_dot: Shape (m, r), orthogonal to the point's ``A``.
        B_dot: Shape (n, r).
    """

    A_dot: Tensor
    B_dot: Tensor

    def __add__(self, other: TangentVector) -> TangentVector:
        return TangentVector(self.A_dot + other.A_dot, self.B_dot + other.B_dot)

    def __mul__(self, scale: float) -> TangentVector:
        return TangentVector(self.A_dot * scale, self.B_dot * scale)

    __rmul__ = __mul__


def random_point(
    m: int,
    n: int,
    r: int,
    scale: float = 1.0,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> FixedRankPoint:
    """A random point whose r singular values all equal ``scale``: ``A`` and ``B / scale`` are orthonormal.

    Args:
        m: Rows (out features).
        n: Columns (in features).
        r: Rank, at most min(m, n).
        scale: Every singular value of the point.
        generator: Optional RNG.
        dtype: Floating dtype of the factors.
    """
    if not 1 <= r <= min(m, n):
        raise ValueError(f"rank r must be in [1, min(m, n)] = [1, {min(m, n)}], got r={r} for an {m} x {n} matrix")
    if is_half(dtype):
        point = random_point(m, n, r, scale, generator=generator)
        return FixedRankPoint.from_factors(point.A.to(dtype), point.B.to(dtype))
    A = _qr(torch.randn(m, r, generator=generator, dtype=dtype))[0]
    B = _qr(torch.randn(n, r, generator=generator, dtype=dtype))[0] * scale
    return FixedRankPoint.from_factors(A, B)


def reorthonormalize(A: Tensor, B: Tensor) -> FixedRankPoint:
    """The point ``A B^T`` refactored so that ``A`` is orthonormal to working precision: ``A = Q R``, ``B <- B R^T``.

    For factors that were orthonormal only to a lower precision (e.g. rounded to bfloat16 and upcast again). Half
    precision factors are refactored in float32 and returned in their dtype.

    Args:
        A: Left factor, shape (..., m, r), nearly orthonormal columns.
        B: Right factor, shape (..., n, r).
    """
    if is_half(A.dtype):
        point = reorthonormalize(A.float(), B.float())
        return FixedRankPoint.from_factors(point.A.to(A.dtype), point.B.to(B.dtype))
    Q, R = _qr(A)
    return FixedRankPoint.from_factors(Q, B @ R.mT)


def to_dense(x: FixedRankPoint) -> Tensor:
    """``X = A B^T`` as an m x n matrix (tests and merging only).

    Args:
        x: The point.
    """
    return x.A @ x.B.mT


def tangent_factors(x: FixedRankPoint, u: TangentVector) -> tuple[Tensor, Tensor]:
    """``(U, V)`` with ``U V^T = u``: ``U = [A_dot, A]`` (m x 2r), ``V = [B_R, B_dot]`` (n x 2r).

    Args:
        x: The point ``u`` is tangent at.
        u: The tangent vector.
    """
    return torch.cat([u.A_dot, x.A], dim=-1), torch.cat([x.B_R, u.B_dot], dim=-1)


def tangent_to_dense(x: FixedRankPoint, u: TangentVector) -> Tensor:
    """The m x n matrix of a tangent vector (tests only).

    Args:
        x: The point ``u`` is tangent at.
        u: The tangent vector.
    """
    U, V = tangent_factors(x, u)
    return U @ V.mT


def egrad2rgrad(x: FixedRankPoint, grad_right: Tensor, grad_left: Tensor) -> TangentVector:
    """The Riemannian gradient P_T(G) from the two products of the Euclidean gradient G that it needs.

    ``A_dot = (I - A A^T) G B_R`` and ``B_dot = G^T A`` (docs/methods.md (Riemannion), "Tangent space"). The
    Riemannion layer delivers both products from one backward pass (``dL/dZ1 = G B_R`` and ``dL/dB = G^T A``), so
    G is never formed.

    Args:
        x: The point.
        grad_right: ``G B_R``, shape (m, r).
        grad_left: ``G^T A``, shape (n, r).
    """
    A_dot = grad_right - x.A @ (x.A.mT @ grad_right)
    return TangentVector(A_dot, grad_left)


def proju(x: FixedRankPoint, U: Tensor, V: Tensor) -> TangentVector:
    """Project the low-rank matrix ``U V^T`` onto the tangent space at ``x`` (the paper's ProjectLR).

    ``P_T(Z) = A A^T Z + (I - A A^T) Z B_R B_R^T``, evaluated as ``A_dot = (I - A A^T) U (V^T B_R)`` and
    ``B_dot = V (U^T A)``.

    Args:
        x: The point.
        U: Left factor, shape (m, k).
        V: Right factor, shape (n, k).
    """
    return egrad2rgrad(x, U @ (V.mT @ x.B_R), V @ (U.mT @ x.A))


def transp(x: FixedRankPoint, y: FixedRankPoint, u: TangentVector) -> TangentVector:
    """Vector transport of ``u`` (tangent at ``x``) to ``y`` by re-projection: ``P_{T_y}(u)``.

    Args:
        x: The point ``u`` is tangent at.
        y: The point to transport to.
        u: The tangent vector at ``x``.
    """
    return proju(y, *tangent_factors(x, u))


def ortho_lowrank(U: Tensor, V: Tensor, rtol: float | None = None) -> tuple[Tensor, Tensor]:
    """Orthogonalize the rank <= k matrix ``U V^T``: set its nonzero singular values to 1 (OrthoLR, without P_T).

    QR both tall factors, SVD the k x k core ``T_L T_R^T = P S Q^T``; the result is ``(Q_L P D)(Q_R Q)^T`` with
    ``D = diag(S > rtol * S_max)``. Exact, so no Newton-Schulz iteration is needed (docs/methods.md (Riemannion)
    step 3). The mask keeps the factor widths fixed (no data-dependent shapes, no host sync).

    Args:
        U: Left factor, shape (m, k).
        V: Right factor, shape (n, k).
        rtol: Singular values at or below ``rtol * S_max`` count as zero and stay zero. Default
            ``max(m, n) * eps(dtype)``, the usual numerical-rank threshold of the tall QRs.

    Returns:
        ``(U_o, V_o)`` with ``U_o V_o^T`` the orthogonalized matrix; the zero matrix maps to zero. Half-precision
        factors are orthogonalized in float32 and returned in their dtype.
    """
    if is_half(U.dtype):
        U_o, V_o = ortho_lowrank(U.float(), V.float(), rtol)
        return U_o.to(U.dtype), V_o.to(V.dtype)
    # a factor that is not tall (k >= its rows) goes into the core as it is: its QR would only rotate it by a square
    # Q. Riemannion's factored step passes 2r x 2r triangular factors, whose Householder Q is exactly diag(+-1).
    Q_L, T_L = _qr(U) if U.shape[-2] > U.shape[-1] else (None, U)
    Q_R, T_R = _qr(V) if V.shape[-2] > V.shape[-1] else (None, V)
    P, S, Qh = torch.linalg.svd(T_L @ T_R.mT, full_matrices=False)
    if rtol is None:
        rtol = max(U.shape[-2], V.shape[-2]) * torch.finfo(S.dtype).eps
    keep = (S > rtol * S[..., :1]).to(S.dtype)
    U_o, V_o = P * keep.unsqueeze(-2), Qh.mT
    return U_o if Q_L is None else Q_L @ U_o, V_o if Q_R is None else Q_R @ V_o


def orthogonalize(x: FixedRankPoint, u: TangentVector, rtol: float | None = None) -> TangentVector:
    """The Riemannion direction ``P_T(Ortho(u))`` (docs/methods.md (Riemannion) step 3): orthogonalize in
    factored form, re-project.

    The re-projection is needed because the polar factor of a tangent vector is in general not tangent: its part in
    ``range(A_dot) x range(B_dot)`` leaves the tangent space.

    Args:
        x: The point.
        u: A tangent vector at ``x`` (the momentum).
        rtol: See :func:`ortho_lowrank`.
    """
    return proju(x, *ortho_lowrank(*tangent_factors(x, u), rtol=rtol))


def retr(x: FixedRankPoint, u: TangentVector, x_scale: float = 1.0) -> FixedRankPoint:
    """Retraction: the best rank-r approximation of ``x_scale * X + u``, in factored form.

    ``x_scale * X + u = [A_dot, A] [B_R, x_scale * B + B_dot]^T`` has rank <= 2r; QR both tall factors, SVD the
    2r x 2r core, keep the top r triplets. ``x_scale`` carries decoupled weight decay ``(1 - lr * wd) X`` without
    leaving factored form. The result has rank exactly r unless ``x_scale * X + u`` itself has rank below r.

    Args:
        x: The point.
        u: Tangent vector at ``x`` (already scaled by the step size).
        x_scale: Factor applied to ``X`` before adding ``u``.

    Returns:
        The new point ``(A_new, B_new)`` with ``A_new`` orthonormal and ``B_new = Q_R V S``. Half-precision points
        are retracted in float32 and returned in their dtype (``A_new`` then orthonormal to that precision).
    """
    if is_half(x.A.dtype):
        new = retr(_to_dtype(x, torch.float32), TangentVector(u.A_dot.float(), u.B_dot.float()), x_scale)
        return FixedRankPoint.from_factors(new.A.to(x.A.dtype), new.B.to(x.B.dtype))
    r = x.rank
    Q_L, T_L = _qr(torch.cat([u.A_dot, x.A], dim=-1))
    Q_R, T_R = _qr(torch.cat([x.B_R, x.B * x_scale + u.B_dot], dim=-1))
    P, S, Qh = torch.linalg.svd(T_L @ T_R.mT, full_matrices=False)
    A_new = Q_L @ P[..., :r]
    B_new = (Q_R @ Qh[..., :r, :].mT) * S[..., :r].unsqueeze(-2)
    return FixedRankPoint.from_factors(A_new, B_new)


def _to_dtype(x: FixedRankPoint, dtype: torch.dtype) -> FixedRankPoint:
    return FixedRankPoint(x.A.to(dtype), x.B.to(dtype), x.B_R.to(dtype))


def inner(x: FixedRankPoint, u: TangentVector, v: TangentVector | None = None) -> Tensor:
    """Frobenius inner product of two tangent vectors at ``x``.

    The cross terms vanish because ``A^T A_dot = 0`` and ``B_R`` is orthonormal, so
    ``<u, v> = <A_dot_u, A_dot_v> + <B_dot_u, B_dot_v>``.

    Args:
        x: The point (unused: the formula holds at every point; kept for geoopt's signature).
        u: First tangent vector.
        v: Second tangent vector (default ``u``).
    """
    if v is None:
        v = u
    return (u.A_dot * v.A_dot).sum((-2, -1)) + (u.B_dot * v.B_dot).sum((-2, -1))


class FixedRankManifold:
    """The fixed-rank manifold with geoopt's method names, on :class:`FixedRankPoint` / :class:`TangentVector`.

    Stateless; every method forwards to the pure function of the same name in this module.
    """

    name = "FixedRank"

    @staticmethod
    def proju(x: FixedRankPoint, U: Tensor, V: Tensor) -> TangentVector:
        """Project ``U V^T`` onto the tangent space at ``x``; see :func:`proju`."""
        return proju(x, U, V)

    @staticmethod
    def egrad2rgrad(x: FixedRankPoint, grad_right: Tensor, grad_left: Tensor) -> TangentVector:
        """Riemannian gradient from ``G B_R`` and ``G^T A``; see :func:`egrad2rgrad`."""
        return egrad2rgrad(x, grad_right, grad_left)

    @staticmethod
    def retr(x: FixedRankPoint, u: TangentVector, x_scale: float = 1.0) -> FixedRankPoint:
        """Best rank-r approximation of ``x_scale * X + u``; see :func:`retr`."""
        return retr(x, u, x_scale)

    @staticmethod
    def transp(x: FixedRankPoint, y: FixedRankPoint, u: TangentVector) -> TangentVector:
        """Transport ``u`` from ``x`` to ``y`` by re-projection; see :func:`transp`."""
        return transp(x, y, u)

    @staticmethod
    def ortho(x: FixedRankPoint, u: TangentVector, rtol: float | None = None) -> TangentVector:
        """``P_T(Ortho(u))``; see :func:`orthogonalize`."""
        return orthogonalize(x, u, rtol)

    @staticmethod
    def inner(x: FixedRankPoint, u: TangentVector, v: TangentVector | None = None) -> Tensor:
        """Frobenius inner product of tangent vectors; see :func:`inner`."""
        return inner(x, u, v)

    @staticmethod
    def norm(x: FixedRankPoint, u: TangentVector) -> Tensor:
        """Frobenius norm of a tangent vector."""
        return inner(x, u).sqrt()
