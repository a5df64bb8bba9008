"""The subspace a projected matrix's Adam moments live in, as objects: :class:`SubspaceBasis` and its three kinds.

A basis says how the ``r``-dimensional subspace is chosen from a gradient (:meth:`~SubspaceBasis.select`, on the
first step and every ``update_proj_gap`` steps), how a gradient enters it and leaves it
(:meth:`~SubspaceBasis.project`, :meth:`~SubspaceBasis.project_back`), and how Adam's moments follow when it moves
(:meth:`~SubspaceBasis.carry`). :class:`~peft_ext.optim.SubspaceAdamW` speaks only this vocabulary, as a geoopt
optimizer speaks only a manifold's ``proju`` / ``retr`` / ``transp`` and GaLore's Adam only its projector's
``project`` / ``project_back``. The math lives in :mod:`.dct` and :mod:`.subspace`.

Unlike GaLore's projector, a basis object holds options only (score norm, DCT method, per-column bias correction),
declared and validated by its constructor, and is the same for every parameter of a group (which stores its name and
options, see :mod:`.components`); what defines one matrix's current basis (``r`` indices, or an ``r x n`` float32
matrix) is kept in that parameter's optimizer state under :attr:`SubspaceBasis.key`, so ``state_dict()`` stays
tensors and numbers (``torch.load(weights_only=True)`` works and a resumed run continues bit for bit).

Every basis is handed to the step as an ``(r, n)`` matrix with orthonormal rows in the gradient's dtype (for the
index bases, rows of the DCT matrix or unit vectors), so projecting is one product and so is mapping back.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist

from .components import Component, register
from .dct import DCT_METHODS, ScoreReduce, dct_matrix, dct_select, project, project_back
from .subspace import coordinate_select, one_hot_rows, power_refresh, rotate_by_overlap
from .subspace_state import rotate_selected

__all__ = ["CoordinateBasis", "DCTBasis", "Moments", "PowerBasis", "SubspaceBasis", "SubspaceSpec"]


class Moments(NamedTuple):
    """Adam's first and second moments of one projected matrix, in the subspace, and the age (steps seen) of each
    basis vector when column bias correction tracks them (else ``None``)."""

    m: torch.Tensor
    v: torch.Tensor
    ages: torch.Tensor | None


@dataclass(frozen=True)
class SubspaceSpec:
    """Where one projected matrix's subspace lives, as far as a basis needs to know.

    Attributes:
        side: ``"right"`` (the columns are compressed; moments ``(R, r)``) or ``"left"`` (rows; ``(r, C)``).
        rank: ``r``.
        reduce: For this process's rows of an FSDP2 row-sharded matrix: sums (or maxes) per-column partial results
            over the processes. ``None``: the gradient is the whole matrix.
        sync: Broadcast every new basis from rank 0, so all processes use the same one.
    """

    side: str
    rank: int
    reduce: ScoreReduce | None = None
    sync: bool = False

    @property
    def dim(self) -> int:
        """The gradient's dimension that is compressed (1 for ``"right"``)."""
        return 1 if self.side == "right" else 0


def check_selection_norm(value: Any) -> float:
    """``value`` if it is a valid score norm (a positive number or ``math.inf``), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value):
        raise ValueError(f"`selection_norm` must be a positive number or math.inf (paper: 1), got {value!r}")
    return value


def check_dct_method(value: Any) -> str:
    """``value`` if it names a DCT implementation (:data:`~.dct.DCT_METHODS`), else ``ValueError``."""
    if value not in DCT_METHODS:
        raise ValueError(f"`dct_method` must be one of {DCT_METHODS}, got {value!r}")
    return value


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``, else ``TypeError`` naming option ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {value!r}")
    return value


class SubspaceBasis(Component):
    """A way to pick and move the subspace of a projected matrix (see the module docstring).

    Subclasses declare their options as constructor keywords (:class:`~.components.Component`).
    """

    kind = "basis"
    #: How messages call its projection ("the row-local DCT projection").
    label: ClassVar[str]
    #: The per-parameter state entry that defines the current basis.
    key: ClassVar[str]
    #: Whether each basis vector is bias-corrected by its own age (only bases whose vectors persist across refreshes
    #: declare the option).
    column_bias_correction: bool = False

    @abstractmethod
    def select(
        self, grad: torch.Tensor, state: dict[str, Any], spec: SubspaceSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose the basis from ``grad`` (the first one, or a refresh), store it in ``state[self.key]``.

        Returns:
            ``(basis, low)``: the ``(r, n)`` basis in ``grad``'s dtype and ``grad`` projected onto it.
        """

    @abstractmethod
    def current(self, grad: torch.Tensor, state: dict[str, Any], spec: SubspaceSpec) -> torch.Tensor:
        """The basis stored in ``state`` as an ``(r, n)`` matrix in ``grad``'s dtype and on its device."""

    def project(self, grad: torch.Tensor, basis: torch.Tensor, spec: SubspaceSpec) -> torch.Tensor:
        """``grad`` in the subspace: ``G B^T`` (right, ``(R, r)``) or ``B G`` (left, ``(r, C)``)."""
        return project(grad, basis, spec.side)

    def project_back(self, low: torch.Tensor, basis: torch.Tensor, spec: SubspaceSpec) -> torch.Tensor:
        """A subspace matrix in the full shape: ``u B`` (right) or ``B^T u`` (left)."""
        return project_back(low, basis, spec.side)

    @abstractmethod
    def carry(self, moments: Moments, old: torch.Tensor, new: torch.Tensor, spec: SubspaceSpec) -> Moments:
        """Adam's moments (and per-basis-vector ages, when tracked) carried from the basis stored as ``old`` to the
        one stored as ``new`` (both as in ``state[self.key]``)."""


def _dct_select(grad: torch.Tensor, spec: SubspaceSpec, norm: float, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.dct.dct_select` for one matrix's spec: its rank, side and row-shard score reduction."""
    return dct_select(grad, spec.rank, spec.side, norm=norm, method=method, reduce=spec.reduce)


class _SelectedRows(SubspaceBasis):
    """A basis of ``r`` rows picked from a fixed orthonormal ``n x n`` matrix; only their indices are stored."""

    key = "indices"

    @abstractmethod
    def _select(self, grad: torch.Tensor, spec: SubspaceSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices sorted ascending, grad projected onto those rows)``."""

    @abstractmethod
    def rows(self, indices: torch.Tensor, like: torch.Tensor, spec: SubspaceSpec) -> torch.Tensor:
        """The ``(r, n)`` basis of ``indices`` in ``like``'s dtype and device."""

    def select(
        self, grad: torch.Tensor, state: dict[str, Any], spec: SubspaceSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        indices, low = self._select(grad, spec)
        if spec.sync:
            local = indices.clone()
            dist.broadcast(indices, src=0)
            if not torch.equal(local, indices):
                low = project(grad, self.rows(indices, grad, spec), spec.side)
        state[self.key] = indices
        return self.rows(indices, grad, spec), low

    def current(self, grad: torch.Tensor, state: dict[str, Any], spec: SubspaceSpec) -> torch.Tensor:
        return self.rows(state[self.key], grad, spec)

    def carry(self, moments: Moments, old: torch.Tensor, new: torch.Tensor, spec: SubspaceSpec) -> Moments:
        # the rows are orthonormal, so the paper's rotation Q[I_old] Q[I_new]^T is a 0/1 partial permutation: a row in
        # both selections keeps its moments (and age), a new one starts at zero
        ages = moments.ages
        return Moments(
            rotate_selected(moments.m, old, new, spec.dim),
            rotate_selected(moments.v, old, new, spec.dim),
            None if ages is None else rotate_selected(ages, old, new, 0),
        )


@register
class DCTBasis(_SelectedRows):
    """The ``r`` DCT-II basis vectors on which the gradient scores highest (DCT-AdamW, arXiv 2505.17967).

    The ``n x n`` DCT matrix is built once per size and shared by every layer (:func:`~.dct.dct_matrix`).

    Args:
        selection_norm: Vector norm of a basis vector's score (paper: 1; ``2`` ranks by energy, ``math.inf`` by peak).
        dct_method: The DCT's implementation: ``"auto"`` (FFT from :data:`~.dct.FFT_MIN_SIZE` on), ``"matmul"`` or
            ``"fft"``; all three select the same vectors up to floating-point ties.
        column_bias_correction: Bias-correct each selected vector by its own age (with ``rotate_moments`` only), so
            a vector that enters starts like a fresh Adam coordinate. Off, as in the paper (see
            :class:`~peft_ext.optim.SubspaceAdamW`).
    """

    name = "dct"
    label = "DCT"

    def __init__(
        self, selection_norm: float = 1.0, dct_method: str = "auto", column_bias_correction: bool = False
    ) -> None:
        self.selection_norm = check_selection_norm(selection_norm)
        self.dct_method = check_dct_method(dct_method)
        self.column_bias_correction = check_flag("column_bias_correction", column_bias_correction)

    def _select(self, grad: torch.Tensor, spec: SubspaceSpec) -> tuple[torch.Tensor, torch.Tensor]:
        return _dct_select(grad, spec, self.selection_norm, self.dct_method)

    def rows(self, indices: torch.Tensor, like: torch.Tensor, spec: SubspaceSpec) -> torch.Tensor:
        return dct_matrix(like.shape[spec.dim], like.dtype, like.device).index_select(0, indices)


@register
class CoordinateBasis(_SelectedRows):
    """The ``r`` plain coordinates (columns, or rows for ``side="left"``) whose gradient slices have the largest norm:
    a near-free baseline, no transform.

    Args:
        selection_norm: Vector norm of a coordinate's score.
        column_bias_correction: As :class:`DCTBasis`'s.
    """

    name = "coordinates"
    label = "coordinate"

    def __init__(self, selection_norm: float = 1.0, column_bias_correction: bool = False) -> None:
        self.selection_norm = check_selection_norm(selection_norm)
        self.column_bias_correction = check_flag("column_bias_correction", column_bias_correction)

    def _select(self, grad: torch.Tensor, spec: SubspaceSpec) -> tuple[torch.Tensor, torch.Tensor]:
        return coordinate_select(grad, spec.rank, spec.side, self.selection_norm, spec.reduce)

    def rows(self, indices: torch.Tensor, like: torch.Tensor, spec: SubspaceSpec) -> torch.Tensor:
        return one_hot_rows(indices, like.shape[spec.dim], like.dtype, like.device)


@register
class PowerBasis(SubspaceBasis):
    """An orthonormal basis tracked by one warm-started block power iteration per refresh (no SVD).

    The first basis is the DCT selection refined by one iteration. The basis is stored in float32 whatever the
    parameter's dtype (the QR runs in float64 for float64 gradients); moments are carried through the ``r x r``
    overlap ``O = B_old B_new^T``: ``m O`` and ``v (O * O)``, clamped at 0.

    Args:
        selection_norm: Score norm of the first (DCT) selection.
        dct_method: The DCT's implementation for the first selection (as :class:`DCTBasis`'s).
    """

    name = "power"
    label = "power-iteration"
    key = "basis"

    why_not: ClassVar[dict[str, str]] = {
        "column_bias_correction": "it ages individual DCT columns; the power basis rotates as a whole, so there are "
        "no columns to age"
    }

    def __init__(self, selection_norm: float = 1.0, dct_method: str = "auto") -> None:
        self.selection_norm = check_selection_norm(selection_norm)
        self.dct_method = check_dct_method(dct_method)

    def select(
        self, grad: torch.Tensor, state: dict[str, Any], spec: SubspaceSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old = state.get(self.key)
        if old is None:
            indices, _ = _dct_select(grad, spec, self.selection_norm, self.dct_method)
            start = dct_matrix(grad.shape[spec.dim], grad.dtype, grad.device).index_select(0, indices)
            new = power_refresh(grad, start.to(torch.float32), spec.side, spec.reduce)
        else:
            new = power_refresh(grad, old, spec.side, spec.reduce)
        if spec.sync:
            dist.broadcast(new, src=0)
        state[self.key] = new
        basis = new.to(grad.dtype)
        return basis, project(grad, basis, spec.side)

    def current(self, grad: torch.Tensor, state: dict[str, Any], spec: SubspaceSpec) -> torch.Tensor:
        return state[self.key].to(grad.dtype)

    def carry(self, moments: Moments, old: torch.Tensor, new: torch.Tensor, spec: SubspaceSpec) -> Moments:
        m, v = rotate_by_overlap(moments.m, moments.v, old, new, spec.side)
        return Moments(m, v.clamp_min(0), moments.ages)
