"""The rank-pool gather: every sample adds its own subset of a pool of rank-1 components to a linear's output.

For a pool of ``N`` rank-1 components ``(a_i, b_i)`` stored as ``A_pool`` (in x N; column ``i`` is ``a_i``) and
``B_pool`` (N x out; row ``i`` is ``b_i``), and an index set ``S_b`` of ``K`` ranks per sample ``b``::

    y[b] = scale * sum_k gates[b, k] * (x[b] @ A_pool[:, S_b[k]]) * B_pool[S_b[k], :]

i.e. ``y[b] = scale * (x[b] @ A_pool[:, S_b]) @ B_pool[S_b, :]`` with hard 0/1 gates (docs/methods.md (PCLR), "The
gather"). ``x[b]`` is a single row or a sequence of tokens. ``gates`` is optional (all ones); a zero gate lets a
sample use fewer than ``K`` ranks (PCLR sets it when prototype routing leaves a sample fewer than ``K`` usable ranks).
An index repeated within one sample counts once per occurrence, in every variant.

Implementations (all pure functions of tensors, differentiable through autograd; dx, dA_pool and dB_pool
accumulate over samples that share a rank):

- :func:`rank_pool_gather_loop`: a Python loop over samples. Slow; the test oracle.
- :func:`rank_pool_gather_indexed`: gathers the ``K`` selected columns/rows per sample (B x K x in and B x K x out
  copies) and runs two batched matmuls. FLOPs scale with ``K``; pays for the copies.
- :func:`rank_pool_gather_masked`: one dense pass over all ``N`` ranks, then a per-sample count mask (exact because
  the gates are 0/1). No copies, ``N / K`` times the FLOPs; the better choice when ``K`` is close to ``N`` or the
  batch has many samples with few tokens.
- :func:`rank_pool_gather_shared`: the case where every sample selects the same ``K`` ranks (PCLR routing a batch
  as one stored task): the ``K`` ranks are gathered once and the batch goes through two plain matmuls. It is
  :func:`rank_pool_gather` with those indices repeated per sample (tested against it), without the per-sample
  copies and the batch of small matmuls: at 320 samples x 32 tokens, width 384, K = 16 of 64 ranks, about 3x less
  CPU time than the gathered version, the same values.

:func:`rank_pool_gather` is the dispatch point. It picks the fast kernel when one is registered and usable, else the
cheaper torch reference by a cost model (:func:`choose_reference`).

Dispatch
--------
``PEFT_EXT_KERNELS`` and the registry of fast kernels live in :mod:`.dispatch`: in ``auto`` / ``triton`` mode a
registered kernel that accepts the inputs runs (the fused Triton kernel of :mod:`.triton_rank_pool` is
registered lazily on the first CUDA call), else the cheaper torch reference. PCLR does not need to know which path
ran.
"""

from __future__ import annotations

import functools
from typing import Literal, Optional

import torch
from torch import Tensor

from .dispatch import fast_rank_pool_kernel

__all__ = [
    "check_gather_inputs",
    "choose_reference",
    "rank_pool_gather",
    "rank_pool_gather_indexed",
    "rank_pool_gather_loop",
    "rank_pool_gather_masked",
    "rank_pool_gather_shared",
]

_METHODS = ("auto", "indexed", "masked", "loop")

# Relative cost of copying one gathered weight element vs. one multiply-add in the cost model below. Gathers are
# memory-bound scatters of whole rows, so one copied element costs several FLOPs; 4 is a conservative CPU/GPU figure.
_COPY_COST = 4.0


def check_gather_inputs(
    x: torch.Tensor,
    A_pool: torch.Tensor,
    B_pool: torch.Tensor,
    indices: torch.Tensor,
    gates: Optional[torch.Tensor],
    check_range: bool = True,
) -> None:
    """Refuse inputs a rank-pool gather cannot take, naming the argument, its shape or dtype and what fits (shared by
    the one-pool gather here and the two-store gather of :mod:`.rank_pool_stores`)."""
    for name, t in (("x", x), ("A_pool", A_pool), ("B_pool", B_pool), ("indices", indices)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(f"`x` must be (batch, in) or (batch, tokens, in), got shape {tuple(x.shape)}")
    if A_pool.dim() != 2 or B_pool.dim() != 2:
        raise ValueError(
            f"`A_pool` must be (in, N) and `B_pool` (N, out); got {tuple(A_pool.shape)} and {tuple(B_pool.shape)}"
        )
    if A_pool.shape[0] != x.shape[-1]:
        raise ValueError(f"`A_pool` has {A_pool.shape[0]} input rows but `x` has width {x.shape[-1]}")
    if A_pool.shape[1] != B_pool.shape[0]:
        raise ValueError(f"`A_pool` has {A_pool.shape[1]} ranks but `B_pool` has {B_pool.shape[0]}")
    if indices.dim() != 2 or indices.shape[0] != x.shape[0]:
        raise ValueError(f"`indices` must be (batch={x.shape[0]}, K), got shape {tuple(indices.shape)}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"`indices` must be int64 or int32, got {indices.dtype}")
    # The range check reads the indices back to the host (a device sync); callers whose indices come from a top-K over
    # the pool itself (PCLR's router) pass check_range=False.
    if check_range and indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= A_pool.shape[1]):
        raise ValueError(
            f"`indices` must lie in [0, {A_pool.shape[1]}), got values in [{int(indices.min())}, {int(indices.max())}]"
        )
    if gates is not None and gates.shape != indices.shape:
        raise ValueError(f"`gates` must have the shape of `indices` {tuple(indices.shape)}, got {tuple(gates.shape)}")


def _as_3d(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (x.unsqueeze(1), True) if x.dim() == 2 else (x, False)


def _loop(x: Tensor, A_pool: Tensor, B_pool: Tensor, indices: Tensor, scale: float, gates: Tensor | None) -> Tensor:
    # the oracle: y[b] = scale * (x[b] A[:, S_b] diag(g_b)) B[S_b, :], one sample at a time
    rows = []
    for b in range(x.shape[0]):
        idx = indices[b].long()
        h = x[b] @ A_pool[:, idx]
        if gates is not None:
            h = h * gates[b].to(h.dtype)
        rows.append(scale * (h @ B_pool[idx, :]))
    return torch.stack(rows)


def _indexed(x: Tensor, A_pool: Tensor, B_pool: Tensor, indices: Tensor, scale: float, gates: Tensor | None) -> Tensor:
    x3, squeeze = _as_3d(x)
    idx = indices.long().reshape(-1)
    # Rows of the (N, in) transpose: when the pool is stored rank-major (PCLR stores A as N x in and passes its
    # transpose), each gathered rank is one contiguous row. index_select rather than A_pool.mT[indices]: the same
    # values, and its backward is one index_add, where advanced indexing's accumulating index_put made the gather's
    # forward + backward about 2x slower on CPU (width 2048, 4 x 64 tokens, K = 16 of a 64-rank pool).
    a = A_pool.mT.index_select(0, idx).view(*indices.shape, A_pool.shape[0])  # (batch, K, in); K or batch may be 0
    b = B_pool.index_select(0, idx).view(*indices.shape, B_pool.shape[1])  # (batch, K, out)
    h = torch.bmm(x3, a.mT)  # (batch, tokens, K)
    if gates is not None:
        h = h * gates.to(h.dtype).unsqueeze(1)
    y = torch.bmm(h, b) * scale
    return y.squeeze(1) if squeeze else y


def _masked(x: Tensor, A_pool: Tensor, B_pool: Tensor, indices: Tensor, scale: float, gates: Tensor | None) -> Tensor:
    x3, squeeze = _as_3d(x)
    weights = torch.zeros(indices.shape[0], A_pool.shape[1], dtype=x.dtype, device=x.device)
    src = torch.ones(indices.shape, dtype=x.dtype, device=x.device) if gates is None else gates.to(x.dtype)
    # scatter_add, not scatter: a rank a sample selects twice must count twice, as in the gathered version
    weights.scatter_add_(1, indices.long(), src)
    h = (x3 @ A_pool) * weights.unsqueeze(1)  # (batch, tokens, N)
    y = (h @ B_pool) * scale
    return y.squeeze(1) if squeeze else y


_REFERENCES = {"indexed": _indexed, "masked": _masked, "loop": _loop}


def choose_reference(tokens: int, n_ranks: int, k: int, width_in: int, width_out: int) -> str:
    """Which torch reference is cheaper: ``"indexed"`` or ``"masked"``, by a FLOP-plus-copy cost model.

    Per sample, the gathered version costs ``tokens * K * (in + out)`` multiply-adds plus ``K * (in + out)`` copied
    elements (weighted by a copy cost); the masked version costs ``tokens * N * (in + out)`` multiply-adds and no
    copy. Both share the ``(in + out)`` factor, so the choice only depends on tokens, ``N`` and ``K``.

    Args:
        tokens: Tokens per sample.
        n_ranks: Pool size ``N``.
        k: Ranks per sample ``K``.
        width_in: Input width (kept for kernels whose cost depends on it; unused by this model).
        width_out: Output width (idem).
    """
    gathered = k * (tokens + _COPY_COST)
    dense = float(n_ranks * tokens)
    return "masked" if dense <= gathered else "indexed"


def rank_pool_gather(
    x: torch.Tensor,
    A_pool: torch.Tensor,
    B_pool: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    gates: Optional[torch.Tensor] = None,
    method: Literal["auto", "indexed", "masked", "loop"] = "auto",
    *,
    check_range: bool = True,
) -> torch.Tensor:
    """``y[b] = scale * (x[b] @ A_pool[:, S_b]) @ B_pool[S_b, :]`` per sample; the entry point PCLR calls.

    Args:
        x: (batch, in) or (batch, tokens, in).
        A_pool: (in, N); pass the transpose of a rank-major (N, in) tensor so each rank is contiguous.
        B_pool: (N, out).
        indices: (batch, K) int64/int32 rank indices per sample; repeats count once per occurrence.
        scale: Output scale.
        gates: Optional (batch, K) 0/1 gates; default all ones.
        method: ``"auto"`` (fast kernel if registered and allowed by ``PEFT_EXT_KERNELS``, else the cheaper
            reference), or force ``"indexed"``, ``"masked"`` or ``"loop"``.
        check_range: Check that every index lies in ``[0, N)``. The check reads the indices back to the host (a
            device sync per call); pass ``False`` only for indices that are in range by construction (PCLR's top-K
            over the pool's own keys).

    Returns:
        The adapter output, (batch, out) or (batch, tokens, out).
    """
    if method not in _METHODS:
        raise ValueError(f"`method` must be one of {_METHODS}, got {method!r}")
    if method == "auto":
        fast = fast_rank_pool_kernel(x, indices, gates)
        if fast is not None:
            check_gather_inputs(x, A_pool, B_pool, indices, gates, check_range)
            return fast.fn(x, A_pool, B_pool, indices, scale, gates)
        tokens = 1 if x.dim() == 2 else x.shape[1]
        method = choose_reference(tokens, A_pool.shape[1], indices.shape[1], A_pool.shape[0], B_pool.shape[1])
    check_gather_inputs(x, A_pool, B_pool, indices, gates, check_range)
    return _REFERENCES[method](x, A_pool, B_pool, indices, scale, gates)


#: :func:`rank_pool_gather` forced to one torch reference (same arguments, less ``method``): the per-sample loop
#: (slow; the oracle of the tests), the gathered copies with two batched matmuls (BGMV style) and the masked dense
#: pass over all ``N`` ranks. Each checks its inputs as :func:`rank_pool_gather` does.
rank_pool_gather_loop = functools.partial(rank_pool_gather, method="loop")
rank_pool_gather_indexed = functools.partial(rank_pool_gather, method="indexed")
rank_pool_gather_masked = functools.partial(rank_pool_gather, method="masked")


def rank_pool_gather_shared(
    x: torch.Tensor,
    A_pool: torch.Tensor,
    B_pool: torch.Tensor,
    index: torch.Tensor,
    scale: float,
    gate: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y[b] = scale * (x[b] @ A_pool[:, S]) @ B_pool[S, :]`` with one index set ``S`` for every sample.

    Equals :func:`rank_pool_gather` with ``index`` (and ``gate``) repeated for every sample, computed as two
    matmuls over the ``K`` gathered ranks.

    Args:
        x: (batch, in) or (batch, tokens, in).
        A_pool: (in, N); pass the transpose of a rank-major (N, in) tensor so each rank is contiguous.
        B_pool: (N, out).
        index: (K,) int64/int32 rank indices shared by every sample, in ``[0, N)`` (not checked: a host read).
        scale: Output scale.
        gate: Optional (K,) 0/1 gates; default all ones.

    Returns:
        The adapter output, (batch, out) or (batch, tokens, out).
    """
    if index.dim() != 1:
        raise ValueError(f"`index` must be (K,), one index set for every sample, got shape {tuple(index.shape)}")
    gates = None if gate is None else gate.reshape(1, -1).expand(x.shape[0], -1)
    check_gather_inputs(x, A_pool, B_pool, index.reshape(1, -1).expand(x.shape[0], -1), gates, check_range=False)
    idx = index.long()
    h = x @ A_pool.mT.index_select(0, idx).mT  # (..., K)
    if gate is not None:
        h = h * gate.to(h.dtype)
    return (h @ B_pool.index_select(0, idx)) * scale
