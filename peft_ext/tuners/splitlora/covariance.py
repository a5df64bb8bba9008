"""Task statistics and the subspace split of SplitLoRA, as pure functions on tensors.

Everything here follows docs/methods.md (SplitLoRA). A linear layer's weight gradient is ``G = sum_tokens g x^T``, so
its row space lies in the span of the layer's inputs ``x``; SplitLoRA therefore estimates the "gradient space of old
tasks" from the uncentered input covariance ``C = mean over all tokens of all tasks so far of x x^T``.

Two ways to keep ``C``:

- dense: the exact ``n x n`` running sum of ``x x^T`` (``accumulate_covariance``; the layers use
  ``accumulate_covariance_lower``, which computes only the lower block triangle of each product, and mirror it once
  per task with ``symmetrize_lower_``). Exact under any batching.
- sketch: a frequent-directions sketch ``S`` (``l x n``, Liberty 2013; Ghashami et al. 2016) with the certified
  bound ``||X^T X - S^T S||_2 <= delta``, where ``delta`` accumulates what :func:`fd_compress` returns per shrink:
  the shrinkage (in exact arithmetic ``0 <= X^T X - S^T S <= shrinkage * I``, the shrinkage never more than
  ``(||X||_F^2 - ||S||_F^2) / l``) plus a rounding allowance (at most about ``2^-23 sqrt(l) ||X||_2^2`` per
  shrink for a float32 sketch). Memory ``l * n`` instead of ``n * n``: for a 4096-wide layer and ``l = 256`` that
  is 4 MB rather than 64 MB. The sketch is exact while the data have rank ``<= l``, and it is mergeable (stack two
  sketches and compress), which is what the DDP all-reduce uses. A layer streams into a ``2l x n`` buffer
  (:func:`fd_append`) and shrinks it once per ``l`` new rows, from ``eigh`` of the ``2l x 2l`` Gram matrix in
  float64: 110 ms per shrink at n = 4096, l = 256 on one CPU thread, about twice the float32 Gram's 52 ms (whose
  rounding could not be certified) and an eighth of the float64 thin SVD's 862 ms.

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
    "accumulate_covariance",
    "accumulate_covariance_lower",
    "closed_form_split",
    "covariance_spectrum",
    "fd_append",
    "fd_compress",
    "fd_update",
    "kaiming_lora_A",
    "minor_subspace_A",
    "primary_dimension",
    "seeded_generator",
    "sketch_spectrum",
    "split_objective",
    "choose_split",
    "symmetrize_lower_",
]


# --- accumulating statistics ---------------------------------------------------------------------------------------


def accumulate_covariance(cov_sum: torch.Tensor, rows: torch.Tensor) -> None:
    """Add ``rows^T rows`` to the running sum ``cov_sum`` in place.

    Args:
        cov_sum: ``(n, n)`` running sum of ``x x^T``.
        rows: ``(N, n)`` inputs, one token per row; cast to ``cov_sum``'s dtype first.
    """
    if rows.ndim != 2 or rows.shape[1] != cov_sum.shape[0]:
        raise ValueError(f"rows must have shape (N, {cov_sum.shape[0]}), got {tuple(rows.shape)}")
    rows = rows.to(cov_sum.dtype)
    cov_sum.addmm_(rows.T, rows)


def _gram_block(n: int) -> int:
    # at most 8 block rows, each at least 64 wide: measured side by side on one CPU thread (256 rows per batch), 8
    # blocks take 0.5-0.6 of the full product's time at n = 1024 .. 2048 and 4 take 0.65-0.75 at n = 256 .. 512;
    # narrower blocks lose more to the smaller products' efficiency than they save
    return max(64, -(-n // 8))


def accumulate_covariance_lower(cov_sum: torch.Tensor, rows: torch.Tensor) -> None:
    """Add ``rows^T rows`` to the lower block triangle of ``cov_sum`` in place; the rest is left as it was.

    The fast path of :func:`accumulate_covariance`: ``rows^T rows`` is symmetric, so only the block rows
    ``[i0, i1) x [0, i1)`` are multiplied (diagonal blocks whole), about ``(b + 1) / 2b`` of the products for ``b``
    blocks. Every entry on or below the diagonal is the same dot product as in the full update, summed in the same
    dtype, so after :func:`symmetrize_lower_` the sum equals :func:`accumulate_covariance`'s to float rounding
    (tested side by side). Entries above the diagonal blocks are never written: mirror before reading them.

    Args:
        cov_sum: ``(n, n)`` running sum of ``x x^T``; only its lower triangle is meaningful.
        rows: ``(N, n)`` inputs, one token per row; cast to ``cov_sum``'s dtype first.
    """
    n = cov_sum.shape[0]
    if rows.ndim != 2 or rows.shape[1] != n:
        raise ValueError(f"rows must have shape (N, {n}), got {tuple(rows.shape)}")
    rows = rows.to(cov_sum.dtype)
    step = _gram_block(n)
    for start in range(0, n, step):
        stop = min(start + step, n)
        cov_sum[start:stop, :stop].addmm_(rows[:, start:stop].T, rows[:, :stop])


def symmetrize_lower_(cov_sum: torch.Tensor) -> torch.Tensor:
    """Overwrite the upper triangle of ``cov_sum`` with the transposed lower one, in place; returns ``cov_sum``.

    Idempotent, so a sum kept by :func:`accumulate_covariance_lower` can be mirrored, read, and accumulated into
    again (a refused ``end_task`` and more batches) as often as needed.
    """
    return cov_sum.copy_(cov_sum.tril() + cov_sum.tril(-1).T)


def _float64_allowance(m: int, n: int, ell: int) -> float:
    """Spectral error, in units of ``||stacked||_F^2``, allowed for the float64 arithmetic of one shrink.

    First-order terms: the Gram product (its inner dimension), ``eigh``'s backward error and the loss of orthogonality
    of its eigenvectors (each taken as the matrix size, LAPACK's usual growth: that constant is the library's), and
    the product ``U^T stacked`` (``sqrt(ell)`` from the Frobenius norm of the scaled ``U``), doubled. 4e-11 at
    n = 4096, l = 256, far below the float32 storage term.
    """
    return 2 * (m + n) * (2 + math.sqrt(ell)) * torch.finfo(torch.float64).eps


def fd_compress(stacked: torch.Tensor, ell: int, shards: Optional[FeatureShards] = None) -> tuple[torch.Tensor, float]:
    """Shrink a stack of rows to an ``ell``-row frequent-directions sketch.

    With ``stacked = U diag(s) V^T`` and ``shrinkage = s_ell^2`` (the ``(ell + 1)``-th largest squared singular
    value, 0 when there are at most ``ell``), the sketch is ``diag(sqrt(max(s_i^2 - shrinkage, 0))) V^T`` for the top
    ``ell`` directions, so in exact arithmetic ``0 <= stacked^T stacked - sketch^T sketch <= shrinkage * I``.

    No SVD of the ``m x n`` stack is taken: the squared singular values and ``U`` come from ``eigh`` of the
    ``m x m`` Gram matrix ``stacked stacked^T`` (of ``stacked^T stacked`` when ``m > n``) and the sketch is
    ``diag(sqrt(max(s_i^2 - shrinkage, 0) / s_i^2)) U^T stacked``: two matrix products and an ``m x m`` eigensolve
    instead of a thin SVD. They run in float64 whatever ``stacked``'s dtype. The error of the computed shrink lies
    within ``||dG||_2`` of ``[0, shrinkage]``, ``dG`` the Gram's rounding (and ``eigh``'s backward error): in float32
    that is ``~sqrt(n) eps ||stacked||_2^2`` and exceeded the shrinkage on streams of widely varying row norms
    (measured: 1e3 times the bound after a few huge rows and many tiny ones, 1.2 times it for log-normal row norms),
    while a rigorous float32 bound (``n eps ||stacked||_F^2``) would swamp it. The returned ``delta`` adds to the
    shrinkage

    - the exact effect of rounding the float64 sketch ``S`` to ``stacked``'s dtype: with ``R`` the rounding residual,
      ``||S^T S - S_r^T S_r||_2 <= (2 ||S||_2 + ||R||_F) ||R||_F`` and ``||S||_2 <= ||stacked||_2``;
    - an allowance for the float64 arithmetic (:func:`_float64_allowance`: 4e-11 of ``||stacked||_F^2`` at
      n = 4096, l = 256),

    so ``||stacked^T stacked - sketch^T sketch||_2 <= delta`` holds for the returned sketch; errors of successive
    shrinks add up (triangle inequality), which is how the layers accumulate them. Tested against float64 covariances
    in ``tests/test_splitlora_stats.py``.

    With ``shards``, ``stacked`` holds this process's columns (input features) of the rows, and so does the sketch
    returned: the ``m x m`` Gram matrix is summed over the processes (one all-reduce, and one of a scalar for the
    rounding residual), so every process computes the same eigenpairs and its columns of the one-process sketch, to
    the rounding of that sum. A stack with more rows than features (never the layers' case: a sketch is only kept
    for layers wider than it) is gathered whole first.

    Args:
        stacked: ``(m, n)`` rows (a previous sketch stacked with new data or with other sketches).
        ell: Number of rows of the sketch.
        shards: The features' split over the processes, when ``stacked`` holds only this process's columns.

    Returns:
        ``(sketch, delta)``: ``sketch`` of shape ``(ell, n)`` in ``stacked``'s dtype (zero rows where the rank is
        lower) and the certified spectral-norm error ``delta`` it adds (the shrinkage plus the rounding terms; 0 when
        ``m <= ell``, where the rows are copied).
    """
    if ell < 1:
        raise ValueError(f"`ell` must be a positive integer, got {ell}")
    m, n = stacked.shape
    out = stacked.new_zeros(ell, n)
    if m <= ell:  # nothing to shrink: the rows themselves are an exact sketch
        out[:m] = stacked
        return out, 0.0
    width = n if shards is None else shards.size
    wide = m <= width
    if shards is not None and not wide:
        sketch, delta = fd_compress(shards.gather(stacked, 1), ell)
        return shards.local(sketch, 1), delta
    work = stacked.to(torch.float64)
    gram = work @ work.T if wide else work.T @ work
    if shards is not None:
        shards.all_reduce_(gram)
    values, vectors = torch.linalg.eigh(0.5 * (gram + gram.T))
    values, vectors = values.flip(0), vectors.flip(1)
    shrinkage = values[ell].clamp_min(0.0) if values.numel() > ell else values.new_zeros(())
    keep = min(ell, values.numel())
    top = values[:keep]
    shrunk = (top - shrinkage).clamp_min(0.0)
    if wide:
        scale = torch.where(top > shrinkage, (shrunk / top.clamp_min(torch.finfo(top.dtype).tiny)).sqrt(), 0.0)
        rows = (vectors[:, :keep] * scale).T @ work
    else:
        rows = shrunk.sqrt()[:, None] * vectors[:, :keep].T
    out[:keep] = rows.to(out.dtype)
    # rows - fl(rows) is exact in float64 (Sterbenz), so this is the true residual's norm up to its own rounding
    if shards is None:
        residual = torch.linalg.vector_norm(rows - out[:keep].to(torch.float64))
    else:
        residual = shards.all_reduce_((rows - out[:keep].to(torch.float64)).square().sum()).sqrt()
    # one device-to-host transfer per shrink
    shrinkage, residual, top_value, energy = torch.stack(
        [shrinkage, residual, values[0].clamp_min(0.0), gram.diagonal().sum()]
    ).tolist()
    storage = (2 * math.sqrt(top_value) + residual) * residual
    return out, shrinkage + storage + _float64_allowance(m, width, ell) * energy


def fd_append(
    buffer: torch.Tensor, fill: int, rows: torch.Tensor, shards: Optional[FeatureShards] = None
) -> tuple[int, float]:
    """Stream ``rows`` into a ``(2 ell, n)`` frequent-directions buffer in place, shrinking once per ``ell`` rows.

    The buffer's first ``fill`` rows hold the data so far (a shrunk sketch and raw rows after it). Rows are copied
    in until the buffer is full; only then is it compressed to ``ell`` rows (:func:`fd_compress`), so a stream of
    small batches pays one shrink per ``ell`` new rows, not one per batch. The buffer as a whole is a valid stack
    for :func:`fd_compress` at any time (unused rows are zero).

    Args:
        buffer: ``(2 ell, n)`` buffer, changed in place.
        fill: Number of rows of ``buffer`` in use.
        rows: ``(N, n)`` new inputs, cast to ``buffer``'s dtype.
        shards: The features' split, when ``buffer`` and ``rows`` hold this process's columns (every process
            appends the same rows, so all shrink together; :func:`fd_compress`).

    Returns:
        ``(fill, delta)``: the new fill and the sum of the shrinks' certified errors (the sketch's error bound grows
        by it, see :func:`fd_compress`).
    """
    two_ell, n = buffer.shape
    if two_ell < 2 or two_ell % 2:
        raise ValueError(f"the buffer must have an even number (2 ell >= 2) of rows, got {two_ell}")
    if rows.ndim != 2 or rows.shape[1] != n:
        raise ValueError(f"rows must have shape (N, {n}), got {tuple(rows.shape)}")
    rows = rows.to(buffer.dtype)
    total, start = 0.0, 0
    while start < rows.shape[0]:
        if fill == two_ell:
            sketch, delta = fd_compress(buffer, two_ell // 2, shards)
            buffer.zero_()
            buffer[: two_ell // 2] = sketch
            fill, total = two_ell // 2, total + delta
        take = min(two_ell - fill, rows.shape[0] - start)
        buffer[fill : fill + take] = rows[start : start + take]
        fill, start = fill + take, start + take
    return fill, total


def fd_update(sketch: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Stream ``rows`` into a frequent-directions sketch ``ell`` rows at a time.

    Each chunk of at most ``ell`` rows is stacked under the sketch and compressed with :func:`fd_compress` (through
    :func:`fd_append`), so every eigensolve is of a ``(<= 2 ell)``-square Gram matrix: the cost per token is
    ``O(ell * n)``, like the dense update's ``O(n^2)`` with ``ell`` in place of ``n``.

    Args:
        sketch: ``(ell, n)`` current sketch.
        rows: ``(N, n)`` new inputs.

    Returns:
        ``(new_sketch, delta)`` where ``delta`` is the sum of the shrinks' certified errors (:func:`fd_compress`); the
        sketch's error bound grows by it.
    """
    ell, n = sketch.shape
    if rows.ndim != 2 or rows.shape[1] != n:
        raise ValueError(f"rows must have shape (N, {n}), got {tuple(rows.shape)}")
    buffer = torch.cat([sketch, sketch.new_zeros(ell, n)])
    fill, total = fd_append(buffer, ell, rows)
    sketch, delta = fd_compress(buffer[:fill], ell)
    return sketch, total + delta


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
