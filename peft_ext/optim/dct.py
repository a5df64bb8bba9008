"""The orthonormal DCT-II and DCT subspace selection: the pure math behind :class:`~peft_ext.optim.DCTAdamW`.

Reference: Modoranu, Safaryan, Alistarh et al., "SVD-Free Low-Rank Adaptive Gradient Optimization" / "FFT-based
Dynamic Subspace Selection" (arXiv 2505.17967); formulas in docs/methods.md (DCT-AdamW).

Conventions. ``Q = dct_matrix(n)`` is the orthonormal DCT-II matrix with
``Q[k, j] = sqrt(2/n) cos(pi k (2j + 1) / (2n))`` and row 0 scaled by ``1/sqrt(2)``, so ``Q @ x`` is the DCT-II of
``x`` and the *rows* of ``Q`` are the cosine basis vectors. docs/methods.md (DCT-AdamW) writes the projection as ``S =
G Q`` with
basis vectors as columns; with ``Q`` defined by the row formula above that product would be the DCT-III (the public
code's ``matmul`` path does exactly that, while its FFT path computes the DCT-II, so its two paths select in
different bases). Here both paths use the DCT-II basis: ``S = G Q^T`` (the DCT-II of every row of ``G``), computed
either as a matrix product or with Makhoul's FFT algorithm, and they agree to floating-point tolerance.

Projection side. For a gradient ``G`` of shape ``(R, C)`` the smaller dimension is compressed, as in the paper and in
GaLore: ``R >= C`` projects from the right (``a = G Q[I]^T``, shape ``(R, r)``, back-projection ``u Q[I]``);
``R < C`` projects from the left (``a = Q[I] G``, shape ``(r, C)``, back-projection ``Q[I]^T u``).

Row shards. The right projection transforms every row on its own, so a matrix split by rows over processes (FSDP2)
is projected where it lives; only the column scores, one number per basis vector, must be combined (``reduce`` in
:func:`dct_scores`). GaLore has no such split: its projector is an SVD of the whole matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch

__all__ = [
    "DCT_METHODS",
    "FFT_MIN_SIZE",
    "SIDES",
    "ScoreReduce",
    "clear_dct_cache",
    "dct2",
    "dct2_fft",
    "dct2_matmul",
    "dct_cache_bytes",
    "dct_matrix",
    "dct_scores",
    "dct_select",
    "project",
    "project_back",
    "projection_side",
    "reduced_norm",
    "resolve_dct_method",
]

DCT_METHODS = ("auto", "matmul", "fft")
SIDES = ("left", "right")

#: ``dct_method="auto"`` switches from the cached-matrix product to Makhoul's FFT at this transform size. Measured on
#: a 2-core x86 CPU (torch 2.13, fp32, one thread, square gradients): n = 128: matrix 0.04 ms, FFT 0.06 ms; n = 256:
#: 0.30 ms vs 0.13 ms; n = 1024: 19 ms vs 2.1 ms. The product costs O(R n^2) against the FFT's O(R n log n), so the
#: gap only widens above the crossover.
FFT_MIN_SIZE = 256

_DCT_CACHE: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # torch.fft has no bf16/fp16 CPU kernels and a half-precision n x n product loses the orthonormality the method
    # relies on, so low-precision inputs are transformed in fp32 (results are cast back by the caller).
    return torch.float64 if dtype == torch.float64 else torch.float32


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``Q`` (``n x n``); ``Q @ x`` is the DCT-II of ``x``, rows are basis vectors.

    Built once per ``(n, dtype, device)`` and shared by every caller (the paper stores one matrix per size for all
    layers; each layer keeps only its ``r`` selected indices). The angles are reduced exactly in integer arithmetic
    (``k (2j + 1) mod 4n``) and evaluated in float64, so the cached matrix is orthonormal to the precision of
    ``dtype`` even for large ``n``.

    Args:
        n: Transform size, a positive integer.
        dtype: Floating-point dtype of the returned (cached) matrix.
        device: Device of the returned matrix (default: CPU).

    Returns:
        The cached matrix. Do not modify it in place: every layer of that size shares it.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"`n` must be an int, got {type(n).__name__} {n!r}")
    if n < 1:
        raise ValueError(f"`n` must be a positive integer, got {n}")
    if not dtype.is_floating_point:
        raise TypeError(f"`dtype` must be a floating-point dtype, got {dtype}")
    device = torch.device("cpu") if device is None else torch.device(device)
    key = (n, dtype, device)
    cached = _DCT_CACHE.get(key)
    if cached is None:
        k = torch.arange(n, dtype=torch.int64).unsqueeze(1)
        j = torch.arange(n, dtype=torch.int64).unsqueeze(0)
        # cos(pi m / (2n)) has period 4n in m; reducing m = k (2j + 1) exactly keeps float64 angles small and exact.
        m = (k * (2 * j + 1)) % (4 * n)
        q = torch.cos(m.to(torch.float64) * (math.pi / (2 * n))) * math.sqrt(2.0 / n)
        q[0] *= math.sqrt(0.5)
        cached = q.to(dtype=dtype, device=device)
        _DCT_CACHE[key] = cached
    return cached


def clear_dct_cache() -> None:
    """Drop every cached DCT matrix and FFT plan (they are rebuilt on demand)."""
    _DCT_CACHE.clear()
    _MAKHOUL_CACHE.clear()


def dct_cache_bytes() -> int:
    """Bytes held by the shared DCT-matrix cache (one ``n x n`` matrix per size, dtype and device in use)."""
    return sum(q.numel() * q.element_size() for q in _DCT_CACHE.values())


def _check_method(method: str) -> None:
    if method not in DCT_METHODS:
        raise ValueError(f"`dct_method` must be one of {DCT_METHODS}, got {method!r}")


def resolve_dct_method(method: str, n: int) -> Literal["matmul", "fft"]:
    """The transform ``method`` stands for at size ``n``: ``"auto"`` picks ``"fft"`` from :data:`FFT_MIN_SIZE` on.

    Args:
        method: ``"auto"``, ``"matmul"`` or ``"fft"``.
        n: Transform size.
    """
    _check_method(method)
    if method == "auto":
        return "fft" if n >= FFT_MIN_SIZE else "matmul"
    return method  # type: ignore[return-value]


def dct2_matmul(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Orthonormal DCT-II of ``x`` along ``dim`` as a product with the cached :func:`dct_matrix` (O(n^2) per vector).

    The reference implementation; :func:`dct2_fft` is tested against it.
    """
    if not x.is_floating_point():
        raise TypeError(f"the DCT needs a floating-point tensor, got dtype {x.dtype}")
    work = _compute_dtype(x.dtype)
    xt = x.to(work).movedim(dim, -1)
    q = dct_matrix(xt.shape[-1], work, xt.device)
    return (xt @ q.T).movedim(-1, dim)


_MAKHOUL_CACHE: dict[tuple[int, torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}


def _makhoul_plan(n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-size constants of :func:`dct2_fft`: input order, twiddles, the upper-half gather and output weights."""
    key = (n, dtype, device)
    plan = _MAKHOUL_CACHE.get(key)
    if plan is None:
        ar = torch.arange(n, device=device)
        order = torch.cat([ar[::2], ar[1::2].flip(0)])  # v = [x0, x2, x4, ..., x5, x3, x1]
        k = torch.arange(n // 2 + 1, device=device, dtype=torch.float64)
        twiddle = torch.polar(torch.ones_like(k), -math.pi * k / (2 * n)).to(
            torch.complex128 if dtype == torch.float64 else torch.complex64
        )
        upper = torch.arange((n - 1) // 2, 0, -1, device=device)  # X_{n-k}, k = (n-1)//2 .. 1, in output order
        weights = torch.full((n,), math.sqrt(2.0 / n), dtype=dtype, device=device)
        weights[0] = math.sqrt(1.0 / n)
        plan = (order, twiddle, upper, weights)
        _MAKHOUL_CACHE[key] = plan
    return plan


def dct2_fft(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Orthonormal DCT-II of ``x`` along ``dim`` with Makhoul's algorithm: one real FFT, O(n log n) per vector.

    Makhoul (1980): reorder ``v = [x0, x2, x4, ..., x5, x3, x1]``; then ``X_k = w_k Re(exp(-i pi k / 2n) V_k)`` with
    ``V = FFT(v)``, ``w_0 = sqrt(1/n)``, ``w_k = sqrt(2/n)`` (docs/methods.md (DCT-AdamW)). Because ``v`` is real,
    ``V`` is
    Hermitian and only ``V_0 .. V_{n//2}`` are computed (``rfft``); the upper half of the spectrum follows from
    ``X_{n-k} = -w Im(exp(-i pi k / 2n) V_k)``, which halves the FFT work of the textbook form.
    """
    if not x.is_floating_point():
        raise TypeError(f"the DCT needs a floating-point tensor, got dtype {x.dtype}")
    work = _compute_dtype(x.dtype)
    xt = x.to(work).movedim(dim, -1)
    order, twiddle, upper, weights = _makhoul_plan(xt.shape[-1], work, xt.device)
    z = torch.fft.rfft(xt.index_select(-1, order), dim=-1).mul_(twiddle)
    out = torch.cat([z.real, z.imag.index_select(-1, upper).neg_()], dim=-1).mul_(weights)
    return out.movedim(-1, dim)


def dct2(x: torch.Tensor, dim: int = -1, method: str = "auto") -> torch.Tensor:
    """Orthonormal DCT-II of ``x`` along ``dim`` by ``method`` (``"auto"``, ``"matmul"`` or ``"fft"``).

    The result is in fp32 for half-precision inputs (fp64 stays fp64).
    """
    resolved = resolve_dct_method(method, x.shape[dim])
    return dct2_fft(x, dim) if resolved == "fft" else dct2_matmul(x, dim)


def projection_side(shape: torch.Size | tuple[int, ...]) -> Literal["left", "right"]:
    """Which side of an ``(R, C)`` gradient is projected: ``"right"`` (compress ``C``) if ``R >= C``, else ``"left"``.

    Compressing the smaller dimension keeps the low-rank state (``max(R, C) x r``) as small as it can be.
    """
    if len(shape) != 2:
        raise ValueError(f"DCT projection needs a 2-D shape, got {tuple(shape)}")
    return "right" if shape[0] >= shape[1] else "left"


def _check_side(side: str) -> None:
    if side not in SIDES:
        raise ValueError(f"`side` must be one of {SIDES}, got {side!r}")


def _check_norm(norm: float) -> None:
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not (norm > 0):
        raise ValueError(f"`norm` must be a positive number or math.inf (1 is the paper's L1 score), got {norm!r}")


#: ``reduce(partial, op)``: combines, in place, per-basis-vector partial scores over processes (``op`` "sum" or "max").
ScoreReduce = Callable[[torch.Tensor, str], None]


def reduced_norm(coeffs: torch.Tensor, norm: float, dim: int, reduce: ScoreReduce) -> torch.Tensor:
    """The ``norm`` of ``coeffs`` over ``dim`` when those entries live on several processes (``reduce`` combines the
    partial sums, or maxima for ``math.inf``, in place)."""
    # the norm over rows that live on several processes: reduce the partial sums of |c|^p (the max for inf), then
    # take the root
    if math.isinf(norm):
        partial = coeffs.abs().amax(dim) if coeffs.shape[dim] else coeffs.new_zeros(coeffs.shape[1 - dim])
        reduce(partial, "max")
        return partial
    partial = coeffs.abs().sum(dim) if norm == 1 else coeffs.abs().pow(norm).sum(dim)
    reduce(partial, "sum")
    return partial if norm == 1 else partial.pow(1 / norm)


def dct_scores(
    grad: torch.Tensor,
    side: str | None = None,
    norm: float = 1.0,
    method: str = "auto",
    reduce: ScoreReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DCT coefficients ``S`` of a 2-D ``grad`` and one score per basis vector: the ``norm`` of its coefficients.

    Args:
        grad: The ``(R, C)`` gradient (any float dtype; transformed in fp32 or fp64).
        side: ``"right"``: ``S = G Q^T`` (``R x C``), scores over columns; ``"left"``: ``S = Q G``, scores over rows.
            Default: :func:`projection_side`.
        norm: Vector norm of the score (paper: 1). ``2`` ranks by captured energy; ``math.inf`` by the peak.
        method: DCT implementation, see :func:`dct2`.
        reduce: For a ``grad`` that is this process's rows of a row-sharded matrix (``side="right"``): combines the
            partial scores over the processes, so every process ranks the whole matrix's columns. ``None``: ``grad``
            is the whole matrix.

    Returns:
        ``(S, scores)``; ``scores`` has length ``C`` (right) or ``R`` (left).
    """
    if grad.ndim != 2:
        raise ValueError(f"`grad` must be 2-D, got shape {tuple(grad.shape)}")
    side = projection_side(grad.shape) if side is None else side
    _check_side(side)
    _check_norm(norm)
    dim = 1 if side == "right" else 0
    coeffs = dct2(grad, dim=dim, method=method)
    if reduce is None:
        scores = torch.linalg.vector_norm(coeffs, ord=norm, dim=1 - dim)
    else:
        if side != "right":
            raise ValueError("scores of a row-sharded gradient need side='right' (the left DCT mixes rows)")
        scores = reduced_norm(coeffs, norm, 1 - dim, reduce)
    return coeffs, scores


def dct_select(
    grad: torch.Tensor, rank: int, side: str | None = None, **scoring: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the ``rank`` DCT basis vectors that score highest on ``grad``; also return ``grad`` projected onto them.

    Args:
        grad: The ``(R, C)`` gradient.
        rank: How many basis vectors to keep, ``1 <= rank <= n`` (``n`` = the projected dimension).
        side: Projection side (default: :func:`projection_side`).
        scoring: ``norm``, ``method`` and ``reduce``, as :func:`dct_scores` takes them (the paper's L1 norm, the
            default, favours directions where many rows (columns) agree over a single large entry).

    Returns:
        ``(indices, low_rank)``: ``indices`` (int64, length ``rank``) sorted ascending, so two selections can be
        matched with one ``searchsorted`` when moments are rotated; ``low_rank`` is ``G Q[I]^T`` (right) or
        ``Q[I] G`` (left), read straight from the transform (no second product).
    """
    side = projection_side(grad.shape) if side is None else side
    coeffs, scores = dct_scores(grad, side, **scoring)
    n = scores.numel()
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"`rank` must be an int, got {type(rank).__name__} {rank!r}")
    if not 1 <= rank <= n:
        raise ValueError(
            f"`rank` must be in [1, {n}] for a {side} projection of shape {tuple(grad.shape)}, got {rank}"
        )
    indices = torch.topk(scores, rank, sorted=False).indices.sort().values
    low_rank = coeffs.index_select(1 if side == "right" else 0, indices)
    return indices, low_rank


def project(grad: torch.Tensor, basis: torch.Tensor, side: str) -> torch.Tensor:
    """Project ``grad`` onto the rows of ``basis`` (``r x n``, orthonormal): ``G B^T`` (right) or ``B G`` (left)."""
    _check_side(side)
    return grad @ basis.T if side == "right" else basis @ grad


def project_back(low_rank: torch.Tensor, basis: torch.Tensor, side: str) -> torch.Tensor:
    """Map a low-rank matrix back to the full shape: ``u B`` (right) or ``B^T u`` (left); inverse of :func:`project`
    on the selected subspace."""
    _check_side(side)
    return low_rank @ basis if side == "right" else basis.T @ low_rank
