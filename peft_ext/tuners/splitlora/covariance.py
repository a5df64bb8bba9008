"""SplitLoRA's running input statistics, as pure functions on tensors: the uncentered input covariance, kept dense or
as a frequent-directions sketch.

Everything here follows docs/methods.md (SplitLoRA). A linear layer's weight gradient is ``G = sum_tokens g x^T``, so
its row space lies in the span of the layer's inputs ``x``; SplitLoRA therefore estimates the "gradient space of old
tasks" from the uncentered input covariance ``C = mean over all tokens of all tasks so far of x x^T``
(:mod:`.subspace` splits it).

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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from ...distributed.features import FeatureShards

__all__ = [
    "accumulate_covariance",
    "accumulate_covariance_lower",
    "fd_append",
    "fd_compress",
    "fd_update",
    "symmetrize_lower_",
]


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
    in ``tests/test_splitlora_statistics.py``.

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
