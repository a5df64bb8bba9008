"""The ``analytic`` head (RanPAC, McDonnell et al., NeurIPS 2023): a fixed random ReLU projection of the features to
``dim`` dimensions, then ridge regression onto one-hot labels, solved in closed form from two running sums.

With ``h = relu(x R)`` the statistics are the Gram matrix ``G = sum h h^T`` (``dim x dim``) and ``Q = sum h y^T``
(``dim x num_classes``); the weights are ``W = (G + lambda I)^-1 Q``. Both sums are additive, so the weights are the
same for any task order and any batch split (to float64 rounding), and no example is kept.

The ridge ``lambda`` is chosen per task: on the validation split when the run has one, otherwise by generalized
cross-validation, which needs nothing but ``G``, ``Q`` and the count (the residual and the effective degrees of
freedom follow from ``G``'s eigenvalues). Both grids are relative to ``G``'s mean eigenvalue, so the choice does not
depend on the features' scale.

No eigenvector of ``G`` is formed: ``G`` is reduced once per task to a tridiagonal ``T = Z^T G Z`` (LAPACK's
``sytrd``, ``Z`` kept as its Householder reflectors), and every ridge of the grid costs a tridiagonal solve
``(T + lambda I) W' = Z^T Q``, ``W = Z W'``; the degrees of freedom need only ``T``'s eigenvalues. The result is the
eigendecomposition's to float64 rounding, at about half its cost (0.4 s against 0.8 s per task at ``dim`` 2048 on
2 cores: ``python -m benchmarks.head_cost``).
A fixed ``ridge`` needs one Cholesky solve instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from .base import ContinualHead, HeadOptions, grow, masked_scores, reduce_sums_, register_head
from .selection import best_on_validation, validation_examples

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext

#: Ridge grid, in units of the Gram matrix's mean eigenvalue ``tr(G) / dim``.
RIDGE_GRID = tuple(10.0**k for k in range(-6, 3))


@dataclass
class AnalyticOptions(HeadOptions):
    """Options of the ``analytic`` head.

    Args:
        dim: Width of the random projection (RanPAC uses 10,000 on ViTs; the Gram matrix is ``dim^2`` float64).
        ridge: ``"auto"`` (on the validation split when the run has one, else generalized cross-validation),
            ``"validation"`` (the run must have a validation split), or a number: ``lambda`` in units of the Gram
            matrix's mean eigenvalue.
    """

    dim: int = 2048
    ridge: Union[float, str] = "auto"

    def validate(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"`head.dim` must be a positive integer, got {self.dim!r}")
        r = self.ridge
        if isinstance(r, str):
            if r not in ("auto", "validation"):
                raise ValueError(f"`head.ridge` must be a number > 0, 'auto' or 'validation', got {r!r}")
        elif isinstance(r, bool) or not r > 0:
            raise ValueError(f"`head.ridge` must be a number > 0, 'auto' or 'validation', got {r!r}")


class Tridiagonal:
    """A symmetric positive semi-definite ``G`` as ``Z T Z^T`` (``T`` tridiagonal, ``Z`` orthogonal), with the
    ridge solutions ``(G + lambda I)^-1 Q`` and the generalized cross-validation error of each ``lambda`` computed
    through ``T``: ``O(dim * C)`` per ridge after the one ``O(dim^3)`` reduction.

    Args:
        gram: ``(dim, dim)`` float64, symmetric.
        targets: ``(dim, C)`` float64 right-hand sides ``Q``.
    """

    def __init__(self, gram: torch.Tensor, targets: torch.Tensor) -> None:
        from scipy.linalg import eigvalsh_tridiagonal, lapack

        dim = gram.shape[0]
        if dim > 1:
            lwork, _ = lapack.dsytrd_lwork(dim, lower=1)
            packed, diagonal, off, tau, info = lapack.dsytrd(gram.numpy(), lower=1, lwork=int(lwork))
            if info != 0:
                raise RuntimeError(f"LAPACK dsytrd failed (info {info}) on the analytic head's Gram matrix")
            # below the subdiagonal, column i holds the Householder vector of Z's i-th reflector (unit first entry
            # on the subdiagonal): the layout of a QR factorization of the trailing (dim - 1) rows
            self._reflectors = torch.from_numpy(packed)[1:, : dim - 1]
            self._tau = torch.from_numpy(tau)
            self.eigenvalues = torch.from_numpy(eigvalsh_tridiagonal(diagonal, off, lapack_driver="sterf"))
        else:
            diagonal, off = gram.reshape(1).numpy().copy(), gram.new_zeros(0).numpy()
            self.eigenvalues = gram.reshape(1).clone()
        self._diagonal, self._off = diagonal, off
        self.eigenvalues = self.eigenvalues.clamp_min(0)
        self._rotated = self._apply_z(targets, transpose=True)  # Z^T Q

    def _apply_z(self, x: torch.Tensor, transpose: bool) -> torch.Tensor:
        if x.shape[0] == 1:
            return x.clone()
        out = x.clone()
        out[1:] = torch.ormqr(self._reflectors, self._tau, x[1:].contiguous(), left=True, transpose=transpose)
        return out

    def _solve_t(self, lam: float) -> torch.Tensor:
        """``W' = (T + lambda I)^-1 Z^T Q`` (positive definite for ``lambda > 0``: LAPACK's ``ptsv``)."""
        from scipy.linalg import lapack

        if len(self._diagonal) == 1:
            return self._rotated / (float(self._diagonal[0]) + lam)
        *_, solution, info = lapack.dptsv(self._diagonal + lam, self._off, self._rotated.numpy())
        if info != 0:
            raise RuntimeError(f"LAPACK dptsv failed (info {info}) at ridge {lam:.3g}")
        return torch.from_numpy(solution)

    def _times_t(self, x: torch.Tensor) -> torch.Tensor:
        d, e = torch.from_numpy(self._diagonal)[:, None], torch.from_numpy(self._off)[:, None]
        out = d * x
        out[:-1] += e * x[1:]
        out[1:] += e * x[:-1]
        return out

    def weight(self, lam: float) -> torch.Tensor:
        """``(G + lambda I)^-1 Q``, float64."""
        return self._apply_z(self._solve_t(lam), transpose=False)

    def gcv(self, lam: float, yy: float, n: float) -> float:
        """Generalized cross-validation error ``n * RSS / (n - dof)^2`` of ridge ``lam`` (``inf`` where the
        effective degrees of freedom reach ``n``); ``yy`` is ``sum |y|^2``, ``n`` the number of samples."""
        dof = float((self.eigenvalues / (self.eigenvalues + lam)).sum())
        if dof >= n:
            return float("inf")
        w = self._solve_t(lam)
        # RSS = |Y - H W|^2 = yy - 2 tr(Q^T W) + tr(W^T G W), in the rotated frame
        rss = yy - 2 * float((self._rotated * w).sum()) + float((w * self._times_t(w)).sum())
        return n * max(rss, 0.0) / (n - dof) ** 2


def gcv_ridge(system: Tridiagonal, yy: float, n: float, grid: list[float]) -> float:
    """The ridge of ``grid`` with the least generalized cross-validation error (the later one on a tie; the last
    where every ridge leaves no residual degree of freedom)."""
    best, best_score = grid[-1], float("inf")
    for lam in grid:
        score = system.gcv(lam, yy, n)
        if score <= best_score and score != float("inf"):
            best, best_score = lam, score
    return best


@register_head
class AnalyticHead(ContinualHead):
    """RanPAC's head: random ReLU projection, ridge regression in closed form (see the module docstring)."""

    name = "analytic"
    options_cls = AnalyticOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.projection: Optional[torch.Tensor] = None
        self.gram: Optional[torch.Tensor] = None
        self.targets: Optional[torch.Tensor] = None
        self.counts = torch.zeros(self.num_classes, dtype=torch.float64)
        self.weight: Optional[torch.Tensor] = None
        self.chosen: list[float] = []

    def needs_validation(self) -> Optional[str]:
        return "head.ridge: validation" if self.options.ridge == "validation" else None

    def _project(self, features: torch.Tensor) -> torch.Tensor:
        return torch.relu(features.float() @ self.projection.to(features.device))

    def begin_task(self, task_id: int, task: Task, width: int) -> None:
        M, C = self.options.dim, self.num_classes
        if self.projection is None:
            generator = torch.Generator().manual_seed(self.seed)
            self.projection = torch.randn(width, M, generator=generator)
        self._task = [
            torch.zeros(M, M, dtype=torch.float64),
            torch.zeros(M, C, dtype=torch.float64),
            torch.zeros(C, dtype=torch.float64),
        ]

    def accumulate(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        gram, targets, counts = self._task
        # in float64, so a batch's rounding does not depend on how the pass was cut into batches
        h = torch.relu(features.double() @ self.projection.double())
        gram.addmm_(h.T, h)
        targets.index_add_(1, labels, h.T)
        counts.index_add_(0, labels, torch.ones(len(labels), dtype=torch.float64))

    def end_task(self, model: nn.Module, task_id: int, ctx: RunContext) -> None:
        reduce_sums_(self._task, model)
        gram, targets, counts = self._task
        del self._task
        M, C = self.options.dim, self.num_classes
        self.gram = grow(self.gram, (M, M)) + gram
        self.targets = grow(self.targets, (M, C)) + targets
        self.counts = self.counts + counts
        self._solve(model, ctx)

    def _solve(self, model: nn.Module, ctx: RunContext) -> None:
        option = self.options.ridge
        # the mean eigenvalue is the trace over dim: no eigendecomposition needed for it
        unit = max(float(torch.trace(self.gram)) / self.options.dim, 1e-12)
        if not isinstance(option, str):  # a fixed ridge: one Cholesky solve
            lam = float(option) * unit
            eye = torch.eye(self.options.dim, dtype=self.gram.dtype)
            factor = torch.linalg.cholesky(self.gram + lam * eye)
            self.chosen.append(float(option))
            self.weight = torch.cholesky_solve(self.targets, factor).float()
            return
        system = Tridiagonal(self.gram, self.targets)
        grid = [g * unit for g in RIDGE_GRID]
        validation = validation_examples(ctx, self.counts > 0)
        if validation:
            candidates = {lam: system.weight(lam).float() for lam in grid}
            lam = best_on_validation(model, validation, ctx, lambda f, lam: self._scores(f, candidates[lam]), grid)
            self.weight = candidates[lam]
        else:
            n = float(self.counts.sum())
            lam = gcv_ridge(system, n, n, grid)
            self.weight = system.weight(lam).float()
        self.chosen.append(lam / unit)

    def _scores(self, features: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return masked_scores(self._project(features) @ weight.to(features.device), self.counts > 0)

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        return self._scores(features, self.weight)

    def state_dict(self) -> dict[str, Any]:
        return {
            "projection": self.projection,
            "gram": self.gram,
            "targets": self.targets,
            "counts": self.counts,
            "weight": self.weight,
            "chosen": list(self.chosen),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("projection", "gram", "targets", "counts", "weight"):
            setattr(self, key, state[key])
        self.chosen = list(state["chosen"])

    def describe(self) -> dict[str, Any]:
        return {"dim": self.options.dim, "ridge_per_task": [float(f"{r:.3g}") for r in self.chosen]}

    @classmethod
    def bytes_per_class(cls, options: HeadOptions, dim: int) -> int:
        return 8 * options.dim + 4 * options.dim + 8  # float64 column of Q, float32 column of W, a count
