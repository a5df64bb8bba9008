"""geoopt's optimizers on Riemannion adapters: the fixed-rank manifold as a ``geoopt.Manifold``, and the adapter's
factors as geoopt parameters.

geoopt (Kochurov et al.) steps each parameter on the manifold its ``ManifoldParameter`` names, through the
manifold's ``egrad2rgrad``, ``retr`` / ``retr_transp``, ``proju`` and ``inner``. Two routes follow from how the
factors are stored:

- :class:`FactoredFixedRank`: the fixed-rank manifold of :mod:`.fixed_rank` on one tensor ``[A; B]`` of shape
  ((m + n) x r). A point is ``X = A B^T``; a tangent vector ``[A_dot; B_dot]`` means ``A_dot B_R^T + A B_dot^T``
  (:class:`~.fixed_rank.TangentVector`'s representation). Every method forwards to the function of the same name in
  :mod:`.fixed_rank`, so ``geoopt.optim.RiemannianSGD`` on such a parameter takes the steps of
  :class:`peft_ext.optim.RiemannLoRA` without momentum (tested). For a module of your own that stores its low-rank
  matrix as one tensor.
- ``riemannian_parameters`` (:mod:`peft_ext.tuners.riemannion`): a Riemannion adapter keeps ``A`` and ``B`` as two
  parameters, and the fixed-rank step couples them (``A``'s direction needs ``B_R``; the retraction refactors both),
  which geoopt's one-parameter-at-a-time step cannot express. So the adapter is trained on the product St(m, r) x
  R^{n x r} of its factors: ``riemannion_A`` on ``geoopt.EuclideanStiefel`` (its orthonormal columns kept by geoopt's
  QR retraction), ``riemannion_B`` Euclidean. This is a different geometry from the Riemannion optimizer's: a move of
  ``A`` changes ``X`` by ``dA B^T``, so the steps depend on how ``X`` is split between ``A`` and ``B`` (their
  scales), which :class:`peft_ext.optim.Riemannion` avoids by stepping ``X`` itself.
"""

from __future__ import annotations

import geoopt
import torch
from torch import Tensor

from .fixed_rank import FixedRankPoint, TangentVector, inner, proju, reorthonormalize, retr, tangent_factors, transp

__all__ = ["STIEFEL", "FactoredFixedRank"]

#: The manifold ``peft_ext.tuners.riemannion.riemannian_parameters`` puts every ``riemannion_A`` on: the Euclidean
#: metric, as the fixed-rank geometry's inner product of ``A_dot`` (:func:`~.fixed_rank.inner`).
STIEFEL = geoopt.EuclideanStiefel()

# |A^T A - I| allowed for an adapter handed to geoopt, the Riemannion optimizer's bound for float32 / float64
#: How far ``A^T A`` may be from the identity for ``A`` to count as a point of the Stiefel manifold.
ORTHONORMAL_TOL = 1e-4


class FactoredFixedRank(geoopt.Manifold):
    """The manifold of rank-r matrices (m x n) as a geoopt manifold on the packed factors ``[A; B]``.

    ``A`` (the first ``m`` rows, m x r) has orthonormal columns, ``B`` (the other ``n`` rows) is free. Use it with
    ``geoopt.ManifoldParameter(manifold.pack_point(A, B), manifold=manifold)`` and any geoopt optimizer; read the
    factors back with :meth:`unpack_tensor`.

    The Euclidean gradient geoopt hands to :meth:`egrad2rgrad` is that of the packed tensor, ``[G B; G^T A]`` with
    ``G = dL/dX``; the Riemannian gradient needs ``G B_R = G B R_B^{-1}`` (``B = B_R R_B``), so ``B`` must have rank
    r, as it does at every point of the manifold. (The Riemannion layer avoids the inverse with its zero probe.)

    Args:
        m: Rows of the matrix (of ``A``).
    """

    name = "FactoredFixedRank"
    ndim = 2
    reversible = False

    def __init__(self, m: int) -> None:
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"`m` (rows of the matrix, of A) must be a positive integer, got {m!r}")
        super().__init__()
        self.m = m

    def extra_repr(self) -> str:
        return f"m={self.m}"

    # -- the packed representation ---------------------------------------------------------------------------------

    def pack_point(self, A: Tensor, B: Tensor) -> Tensor:
        """``[A; B]``, the tensor geoopt steps.

        Args:
            A: Left factor (..., m, r), orthonormal columns.
            B: Right factor (..., n, r).
        """
        if A.shape[-2] != self.m or A.shape[-1] != B.shape[-1]:
            raise ValueError(
                f"{self} packs A (m x r) with m={self.m} and B (n x r) of the same r; got A {tuple(A.shape)}, "
                f"B {tuple(B.shape)}"
            )
        return torch.cat([A, B], dim=-2)

    def unpack_tensor(self, tensor: Tensor) -> tuple[Tensor, Tensor]:
        """``(A, B)``, views of the packed tensor's first ``m`` rows and the rest.

        Args:
            tensor: A point (or a tangent vector: then ``(A_dot, B_dot)``).
        """
        return tensor[..., : self.m, :], tensor[..., self.m :, :]

    def _point(self, x: Tensor) -> FixedRankPoint:
        return FixedRankPoint.from_factors(*self.unpack_tensor(x))

    def _tangent(self, u: Tensor) -> TangentVector:
        return TangentVector(*self.unpack_tensor(u))

    def _pack_tangent(self, u: TangentVector) -> Tensor:
        return torch.cat([u.A_dot, u.B_dot], dim=-2)

    # -- checks geoopt calls (ManifoldParameter, check_point_on_manifold, check_vector_on_tangent) ------------------

    def _check_shape(self, shape: tuple[int, ...], name: str) -> tuple[bool, str | None]:
        ok, reason = super()._check_shape(shape, name)
        if not ok:
            return ok, reason
        n, r = shape[-2] - self.m, shape[-1]
        if n < 1 or not 1 <= r <= min(self.m, n):
            return False, (
                f"`{name}` on {self} must have shape (..., m + n, r) with n >= 1 and 1 <= r <= min(m, n); "
                f"got {tuple(shape)}"
            )
        return True, None

    def _check_point_on_manifold(
        self, x: Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        A, _ = self.unpack_tensor(x)
        gram = A.mT @ A
        if not torch.allclose(gram, torch.eye(A.shape[-1], dtype=A.dtype, device=A.device), atol=atol, rtol=rtol):
            return False, f"`A^T A != I` with atol={atol}, rtol={rtol}"
        return True, None

    def _check_vector_on_tangent(
        self, x: Tensor, u: Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        A, _ = self.unpack_tensor(x)
        A_dot, _ = self.unpack_tensor(u)
        overlap = A.mT @ A_dot
        if not torch.allclose(overlap, torch.zeros_like(overlap), atol=atol, rtol=rtol):
            return False, f"`A^T A_dot != 0` with atol={atol}, rtol={rtol}"
        return True, None

    # -- geometry: each forwards to the function of the same name in fixed_rank --------------------------------------

    def projx(self, x: Tensor) -> Tensor:
        """The same matrix ``A B^T`` refactored with ``A`` orthonormal (:func:`~.fixed_rank.reorthonormalize`)."""
        point = reorthonormalize(*self.unpack_tensor(x))
        return self.pack_point(point.A, point.B)

    def proju(self, x: Tensor, u: Tensor) -> Tensor:
        """Project the packed ``[a; b]``, meaning the matrix ``a B_R^T + A b^T``, onto the tangent space at ``x``.

        Tangent vectors are fixed points; see :func:`~.fixed_rank.proju`.
        """
        point = self._point(x)
        return self._pack_tangent(proju(point, *tangent_factors(point, self._tangent(u))))

    def egrad2rgrad(self, x: Tensor, u: Tensor) -> Tensor:
        """``P_T(G)`` from the packed tensor's gradient ``[G B; G^T A]`` (see the class docstring)."""
        point = self._point(x)
        grad_B, grad_left = self.unpack_tensor(u)  # G B, G^T A
        R_B = point.B_R.mT @ point.B  # B = B_R R_B, R_B upper triangular
        grad_right = torch.linalg.solve_triangular(R_B, grad_B, upper=True, left=False)  # G B_R
        A_dot = grad_right - point.A @ (point.A.mT @ grad_right)
        return self._pack_tangent(TangentVector(A_dot, grad_left))

    def retr(self, x: Tensor, u: Tensor) -> Tensor:
        """The best rank-r approximation of ``X + u``; see :func:`~.fixed_rank.retr`."""
        new = retr(self._point(x), self._tangent(u))
        return self.pack_point(new.A, new.B)

    def transp(self, x: Tensor, y: Tensor, v: Tensor) -> Tensor:
        """Transport ``v`` from ``x`` to ``y`` by re-projection; see :func:`~.fixed_rank.transp`."""
        return self._pack_tangent(transp(self._point(x), self._point(y), self._tangent(v)))

    def inner(self, x: Tensor, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """Frobenius inner product of the tangent vectors' m x n matrices; see :func:`~.fixed_rank.inner`."""
        product = inner(self._point(x), self._tangent(u), None if v is None else self._tangent(v))
        return product[..., None, None] if keepdim else product

    def expmap(self, x: Tensor, u: Tensor) -> Tensor:
        """Not available: the fixed-rank manifold has no closed-form exponential map; geoopt's optimizers use
        :meth:`retr`."""
        raise NotImplementedError(f"{self} has no exponential map; use retr (geoopt's optimizers do)")

    def random(self, n: int, r: int, *, dtype: torch.dtype | None = None, device=None) -> Tensor:
        """A random packed point with orthonormal ``A`` and Gaussian ``B`` (rank r almost surely).

        Args:
            n: Columns of the matrix (rows of ``B``).
            r: Rank.
            dtype: Floating dtype (default torch's).
            device: Device.
        """
        self._assert_check_shape((self.m + n, r), "x")
        A = torch.linalg.qr(torch.randn(self.m, r, dtype=dtype, device=device)).Q
        return geoopt.ManifoldTensor(self.pack_point(A, torch.randn(n, r, dtype=dtype, device=device)), manifold=self)
