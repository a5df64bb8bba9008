"""The rank-pool gather over a pool held in two stores: frozen ranks first, then trainable ones.

PCLR keeps each layer's pool as two rank-major stores, the frozen ranks of finished tasks (buffers) and the current
task's trainable ranks (parameters); its selection indexes the pool ``[frozen..., trainable...]``.
:func:`rank_pool_gather_stores` is :func:`~.rank_pool.rank_pool_gather` over that pool without the caller
concatenating it. Where the gathered reference (``"indexed"``) is the path, it runs as one autograd node
(:class:`_StoresGather`) whose backward computes what the recorded graph of ``cat`` + ``index_select`` + two ``bmm``
+ the scalings would, less the frozen store's gradient (never used) and the graph's per-operation bookkeeping: at
width 256 (4 x 64 tokens, K = 16 of 48 frozen + 16 trainable ranks, one CPU thread of a loaded shared machine) the
forward and backward over a Llama block's 7 linears took 4.8-5.1 ms against 5.2-6.3 ms for the recorded graph
(LoRA's two products on the 16 trainable ranks: 3.3-4.0 ms).
The values are those of the indexed reference; the gradients too, up to float rounding (the ranks' gradient is one
batched product of the same terms in transposed order, with which some BLAS kernels round differently).

Everywhere else (a fast kernel accepts the inputs, the cost model picks the masked reference, the frozen store or the
gates require a gradient) the two stores are concatenated, as before, and :func:`~.rank_pool.rank_pool_gather` runs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .dispatch import fast_rank_pool_kernel
from .rank_pool import check_gather_inputs, choose_reference, rank_pool_gather

__all__ = ["pool_of_stores", "rank_pool_gather_stores"]


def pool_of_stores(frozen: tuple[Tensor, Tensor], trainable: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The pool ``(A, B)`` ``[frozen..., trainable...]`` of two rank-major stores: one store read in place when the
    other holds no rank (a full store's slice or a copy would cost a copy per call), else the two concatenated."""
    (A_f, B_f), (A_t, B_t) = frozen, trainable
    if A_t.shape[0] == 0:
        return A_f, B_f
    if A_f.shape[0] == 0:
        return A_t, B_t
    return torch.cat([A_f, A_t]), torch.cat([B_f, B_t])


def _gather(
    x: Tensor, A_f: Tensor, B_f: Tensor, A_t: Tensor, B_t: Tensor, idx: Tensor, k: int, gates: Optional[Tensor], scale
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # the indexed reference (rank_pool._indexed) over cat([frozen, trainable]): x is (batch, tokens, in), idx the
    # flattened (batch x K) int64 indices, gates (batch, 1, K) or None; returns y and what the backward needs
    A, B = pool_of_stores((A_f, B_f), (A_t, B_t))
    a = A.index_select(0, idx).view(x.shape[0], k, A.shape[1])  # (batch, K, in)
    b = B.index_select(0, idx).view(x.shape[0], k, B.shape[1])  # (batch, K, out)
    h = torch.bmm(x, a.mT)  # (batch, tokens, K)
    if gates is not None:
        h.mul_(gates)
    y = torch.bmm(h, b)
    if scale != 1.0:
        y.mul_(scale)
    return y, a, b, h


class _StoresGather(torch.autograd.Function):
    """:func:`_gather` as one autograd node: gradients for ``x`` and the trainable stores, none for the frozen one."""

    @staticmethod
    def forward(ctx, x, A_f, B_f, A_t, B_t, idx, k, gates, scale):  # type: ignore[override]
        y, a, b, h = _gather(x, A_f, B_f, A_t, B_t, idx, k, gates, scale)
        ctx.save_for_backward(x, a, b, h, idx, gates)
        ctx.scale, ctx.frozen, ctx.ranks = scale, A_f.shape[0], A_f.shape[0] + A_t.shape[0]
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, a, b, h, idx, gates = ctx.saved_tensors
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        grad_h = torch.bmm(grad, b.mT)
        if gates is not None:
            grad_h.mul_(gates)
        grad_x = torch.bmm(grad_h, a) if ctx.needs_input_grad[0] else None
        grad_A = grad_B = None
        # each slot's rows summed into its rank (index_select's backward), then the trainable store's share
        if ctx.needs_input_grad[3]:
            rows = torch.bmm(grad_h.mT, x).view(-1, a.shape[-1])
            grad_A = rows.new_zeros(ctx.ranks, rows.shape[1]).index_add_(0, idx, rows)[ctx.frozen :]
        if ctx.needs_input_grad[4]:
            rows = torch.bmm(h.mT, grad).view(-1, b.shape[-1])
            grad_B = rows.new_zeros(ctx.ranks, rows.shape[1]).index_add_(0, idx, rows)[ctx.frozen :]
        return grad_x, None, None, grad_A, grad_B, None, None, None, None


def rank_pool_gather_stores(
    x: Tensor,
    frozen: tuple[Tensor, Tensor],
    trainable: tuple[Tensor, Tensor],
    indices: Tensor,
    scale: float,
    gates: Optional[Tensor] = None,
) -> Tensor:
    """:func:`~.rank_pool.rank_pool_gather` over the pool ``[frozen..., trainable...]`` held as two stores.

    Args:
        x: (batch, in) or (batch, tokens, in).
        frozen: ``(A, B)`` of the frozen ranks, rank-major: (N_f, in) and (N_f, out); no gradient reaches them.
        trainable: ``(A, B)`` of the trainable ranks: (N_t, in) and (N_t, out).
        indices: (batch, K) int64/int32 indices into the pool of ``N_f + N_t`` ranks, in range (not checked: a
            host read).
        scale: Output scale.
        gates: Optional (batch, K) 0/1 gates; default all ones.

    Returns:
        The adapter output, (batch, out) or (batch, tokens, out).
    """
    (A_f, B_f), (A_t, B_t) = frozen, trainable
    if A_f.shape[1:] != A_t.shape[1:] or B_f.shape[1:] != B_t.shape[1:] or A_f.shape[0] != B_f.shape[0]:
        raise ValueError(
            f"the stores do not fit together: frozen A {tuple(A_f.shape)}, B {tuple(B_f.shape)}; trainable A "
            f"{tuple(A_t.shape)}, B {tuple(B_t.shape)}"
        )
    check_gather_inputs(x, A_t.mT, B_t, indices, gates, check_range=False)
    n_ranks, k = A_f.shape[0] + A_t.shape[0], indices.shape[1]
    tokens = 1 if x.dim() == 2 else x.shape[1]
    if (
        fast_rank_pool_kernel(x, indices, gates) is not None
        or A_f.requires_grad
        or B_f.requires_grad
        or (gates is not None and gates.requires_grad)
        or choose_reference(tokens, n_ranks, k, x.shape[-1], B_t.shape[1]) != "indexed"
    ):
        A, B = pool_of_stores(frozen, trainable)
        return rank_pool_gather(x, A.mT, B, indices, scale, gates, check_range=False)
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    idx = indices.reshape(-1).long()
    g = None if gates is None else gates.to(x.dtype).unsqueeze(1)
    if torch.is_grad_enabled() and (x.requires_grad or A_t.requires_grad or B_t.requires_grad):
        y = _StoresGather.apply(x3, A_f, B_f, A_t, B_t, idx, k, g, scale)
    else:
        y = _gather(x3, A_f, B_f, A_t, B_t, idx, k, g, scale)[0]
    return y.squeeze(1) if x.dim() == 2 else y
