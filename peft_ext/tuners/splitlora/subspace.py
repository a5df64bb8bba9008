"""The subspace split of SplitLoRA, as pure functions on tensors: the spectrum of the running input statistics
(:mod:`.covariance`), the split ``k*`` into a primary and a minor subspace, and the next task's frozen ``A`` drawn
in the minor one (docs/methods.md (SplitLoRA)).

The split (``choose_split``): with eigenvalues ``l_1 >= l_2 >= ...`` of ``C``, ``p_i = l_i / trace(C)``, ``d = n``
and the 0-based index ``t`` of the task just finished,

    f(j) = (t + 1) * (1 - sum_{i <= j} p_i) - a * (d - j) / d,   j = 0 .. d - 1,   k* = argmin_j f(j),

and the primary subspace is the first ``max(k*, 1) + 1`` eigenvectors. Because ``f(j) - f(j - 1) = a / d -
(t + 1) p_j`` and ``p`` is non-increasing, the argmin has a closed form (``closed_form_split``): ``k* + 1`` is the
number of directions with ``p_i > a / ((t + 1) d)`` (at least one).
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from ...distributed.features import FeatureShards

__all__ = [
    "choose_split",
    "closed_form_split",
    "covariance_spectrum",
    "kaiming_lora_A",
    "minor_subspace_A",
    "primary_dimension",
    "seeded_generator",
    "sketch_spectrum",
    "split_objective",
]


# --- spectra ---------------------------------------------------------------------------------------------------------


def covariance_spectrum(
    cov_sum: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Eigen-decomposition of a dense (sum or mean) covariance.

    The eigensolve runs in ``dtype``: float32 by default, about 2x faster than float64 for the cubic ``eigh``, and,
    measured against float64 on covariances with decaying spectra (n = 256 .. 2048; docs/splitlora.md, "Cost at LLM
    scale"), it chooses the same ``k*`` and a minor subspace within 0.0012 degree. The split needs only the spectrum
    and the primary subspace, whose float32 error is ``~eps * l_1 / gap``; :func:`minor_subspace_A`
    re-orthonormalizes a float32 basis in float64 before projecting.

    Args:
        cov_sum: ``(n, n)`` symmetric positive semi-definite matrix.
        dtype: ``torch.float32`` (default) or ``torch.float64`` (the reference).

    Returns:
        ``(eigenvalues, eigenvectors, trace)``: eigenvalues in descending order (float64, clamped at 0), the matching
        eigenvectors as columns (float64, with ``dtype``'s accuracy) and the trace (the total energy ``p_i`` is
        normalized by).
    """
    _check_spectrum_dtype(dtype)
    sym = cov_sum.to(dtype)
    sym = 0.5 * (sym + sym.T)
    values, vectors = torch.linalg.eigh(sym)
    values = values.to(torch.float64).flip(0).clamp_min(0.0)
    return values, vectors.flip(1).to(torch.float64), float(cov_sum.diagonal().to(torch.float64).sum())


def _check_spectrum_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"`dtype` must be torch.float32 or torch.float64, got {dtype}")


def sketch_spectrum(
    sketch: torch.Tensor, trace: float, dtype: torch.dtype = torch.float32, shards: Optional[FeatureShards] = None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Top eigenpairs of ``sketch^T sketch``; the exact ``trace`` of the sketched data is passed through.

    Only ``ell`` eigenvalues are known; each is off by at most the sketch's certified error (the accumulated
    shrinkage, by which frequent directions underestimate, plus rounding).
    Normalizing by the exact trace (tracked separately as the sum of squared norms) keeps ``p_i`` on the same scale
    as the dense path. Computed from ``eigh`` of the ``ell x ell`` Gram matrix ``S S^T`` in ``dtype`` and
    ``V = S^T U`` (columns normalized): ``O(ell^2 n)``, no cubic term in ``n`` and no ``ell x n`` SVD (
    0.26 s instead of 3.5 s for ``ell = 256``, ``n = 14336``, one thread).

    Args:
        sketch: ``(ell, n)`` frequent-directions sketch.
        trace: Exact sum of squared norms of all rows that went into the sketch.
        dtype: ``torch.float32`` (default) or ``torch.float64``.
        shards: The features' split, when ``sketch`` holds this process's columns: the Gram matrix and the vectors'
            norms are summed over the processes, and the eigenvectors returned are this process's rows of them.

    Returns:
        ``(eigenvalues, eigenvectors, trace)`` as in :func:`covariance_spectrum`, with ``min(ell, n)`` pairs.
    """
    _check_spectrum_dtype(dtype)
    work = sketch.to(dtype)
    gram = work @ work.T
    if shards is not None:
        shards.all_reduce_(gram)
    values, u = torch.linalg.eigh(gram)
    keep = min(work.shape[0], work.shape[1] if shards is None else shards.size)
    values, u = values.flip(0)[:keep].clamp_min(0.0), u.flip(1)[:, :keep]
    vectors = work.T @ u
    if shards is None:
        norms = vectors.norm(dim=0)
    else:
        norms = shards.all_reduce_(vectors.square().sum(dim=0)).sqrt()
    # directions of (numerically) zero energy come out as zero columns; they never count as primary on their own
    vectors = vectors / norms.clamp_min(torch.finfo(dtype).tiny)
    return values.to(torch.float64), vectors.to(torch.float64), float(trace)


# --- the split -------------------------------------------------------------------------------------------------------


def _shares(eigenvalues: torch.Tensor, total: float | None) -> torch.Tensor:
    values = eigenvalues.to(torch.float64)
    if values.ndim != 1 or values.numel() == 0:
        raise ValueError(f"eigenvalues must be a non-empty 1-D tensor, got shape {tuple(values.shape)}")
    if bool((values[1:] > values[:-1]).any()):
        raise ValueError("eigenvalues must be sorted in descending order")
    denom = float(values.sum()) if total is None else float(total)
    if not math.isfinite(denom) or denom <= 0:
        raise ValueError(f"the total energy (trace) must be a positive finite number, got {denom}")
    return values / denom


def split_objective(
    eigenvalues: torch.Tensor, task_index: int, trade_off: float, dim: int | None = None, total: float | None = None
) -> torch.Tensor:
    """``f(j)`` of docs/methods.md (SplitLoRA) for ``j = 0 .. len(eigenvalues) - 1``.

    Args:
        eigenvalues: Eigenvalues of the covariance, descending.
        task_index: 0-based index ``t`` of the task that was just finished.
        trade_off: The coefficient ``a`` (default 20 in the paper).
        dim: ``d``, the input dimension (defaults to ``len(eigenvalues)``; pass ``n`` when only the top of the
            spectrum is known, as with a sketch).
        total: The trace the shares are normalized by (defaults to ``eigenvalues.sum()``).

    Returns:
        ``f`` as a float64 tensor of the same length as ``eigenvalues``.
    """
    p = _shares(eigenvalues, total)
    d = p.numel() if dim is None else int(dim)
    if d < p.numel():
        raise ValueError(f"`dim` ({d}) must be at least the number of eigenvalues ({p.numel()})")
    if task_index < 0:
        raise ValueError(f"`task_index` must be >= 0, got {task_index}")
    j = torch.arange(p.numel(), dtype=torch.float64, device=p.device)
    return (task_index + 1) * (1.0 - torch.cumsum(p, 0)) - trade_off * (d - j) / d


def choose_split(
    eigenvalues: torch.Tensor, task_index: int, trade_off: float, dim: int | None = None, total: float | None = None
) -> int:
    """``k* = argmin_j f(j)`` (the first minimizer), see :func:`split_objective` for the arguments."""
    return int(torch.argmin(split_objective(eigenvalues, task_index, trade_off, dim, total)))


def closed_form_split(
    eigenvalues: torch.Tensor, task_index: int, trade_off: float, dim: int | None = None, total: float | None = None
) -> int:
    """``k*`` without evaluating ``f``: one less than the number of shares above ``a / ((t + 1) d)`` (at least 0)."""
    p = _shares(eigenvalues, total)
    d = p.numel() if dim is None else int(dim)
    threshold = trade_off / ((task_index + 1) * d)
    return max(int((p > threshold).sum()) - 1, 0)


def primary_dimension(k_star: int, dim: int) -> int:
    """Number of primary directions for a split ``k*``: ``max(k*, 1) + 1``, as in the paper and the public code
    (``U[:, max(r, 1) + 1:]`` is the minor part), capped at ``dim``."""
    return min(max(k_star, 1) + 1, dim)


# --- initializing A --------------------------------------------------------------------------------------------------


def seeded_generator(seed: int, key: str, task_index: int) -> torch.Generator:
    """A CPU generator determined by (config seed, module name, task index) only.

    Using the global RNG would make the next task's ``A`` depend on whatever else consumed random numbers before
    ``end_task`` (data order, dropout, another process in DDP). With this generator, continuing a sequence after
    ``from_pretrained`` and every DDP rank draw exactly the same ``A``.
    """
    mixed = (int(seed) * 1_000_003 + zlib.crc32(key.encode()) * 1_009 + int(task_index)) % (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(mixed)


def kaiming_lora_A(r: int, n: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PEFT LoRA's default ``lora_A`` init, ``kaiming_uniform_(a=sqrt(5))``: uniform on ``[-1/sqrt(n), 1/sqrt(n)]``."""
    bound = 1.0 / math.sqrt(n)
    return (torch.rand(r, n, generator=generator, dtype=torch.float64) * 2 - 1).mul_(bound).to(dtype)


def minor_subspace_A(
    primary: torch.Tensor, r: int, target_norm: float, generator: torch.Generator, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A new frozen ``A`` (``r x n``) whose rows lie in the orthogonal complement of ``primary``.

    docs/methods.md (SplitLoRA) writes ``A^T = U_minor N`` with ``N`` Gaussian ``(d - k) x r``. We draw ``A^T = (I -
    U_p U_p^T) G`` with ``G`` Gaussian ``n x r`` instead: since ``U_minor^T G`` is again a standard Gaussian ``(d - k)
    x r`` matrix, this has exactly the same distribution, but it depends only on the primary *subspace*, not on the
    sign or basis the eigensolver picked for each eigenvector, and it never needs the (large) minor basis.

    Args:
        primary: ``(n, k)`` orthonormal basis of the primary subspace.
        r: Rank of the adapter.
        target_norm: Frobenius norm of the returned ``A``.
        generator: Source of the Gaussian draw (see :func:`seeded_generator`).
        dtype: dtype of the result.

    Returns:
        ``A`` of shape ``(r, n)``; all zero if the minor subspace is empty.
    """
    n = primary.shape[0]
    basis = primary.to(torch.float64)
    if 0 < basis.shape[1] < n:
        # a float32 eigenbasis (covariance_spectrum's default) is orthonormal to ~1e-6 only; the projection below
        # needs ~1e-15. O(n k^2) in float64, cheap next to the eigensolve; the subspace, hence A's law, is unchanged.
        basis = torch.linalg.qr(basis).Q
    # drawn on the CPU generator (same numbers on every device and rank), then moved to the basis' device
    g = torch.randn(n, r, generator=generator, dtype=torch.float64).to(basis.device)
    if basis.shape[1] >= n:
        return torch.zeros(r, n, dtype=dtype, device=basis.device)
    # Two projection passes: one pass leaves O(eps * ||g||) of the primary subspace in floating point, the second
    # removes that residue, so "A is orthogonal to the primary subspace" holds to ~1e-15 relative, not ~1e-8.
    for _ in range(2):
        g = g - basis @ (basis.T @ g)
    norm = float(torch.linalg.matrix_norm(g))
    # contiguous: a transposed view would make matmuls pick other kernels than after a save/load round trip, and
    # continuing a loaded sequence must reproduce the uninterrupted one bit for bit.
    return (g.T * (target_norm / norm)).to(dtype).contiguous()
