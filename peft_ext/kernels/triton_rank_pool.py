"""Triton kernels of the fused rank-pool gather (forward and backward).

Importing this module imports Triton, so nothing in ``peft_ext`` imports it at import time:
:func:`.dispatch.load_rank_pool_kernel` registers it on the first CUDA call. The torch reference is
:func:`.rank_pool.rank_pool_gather_indexed`; the tests run both under ``TRITON_INTERPRET=1`` on CPU and compile the
kernels for sm_80 / sm_90.

Rank-pool gather, in the shrink/expand form of S-LoRA's BGMV kernels, with per-sample rank indices:

- ``_shrink_kernel``: ``h[b, t, k] = scale * g[b, k] * sum_d x[b, t, d] * w[d, idx[b, k]]`` (fp32 ``h``; ``K`` is
  small, so ``h`` is a tiny intermediate and the big reads are ``x`` and the gathered columns of ``w``);
- ``_expand_kernel``: ``y[b, t, o] = scale * sum_k h[b, t, k] * w[idx[b, k], o]``;
- ``_wgrad_kernel``: ``out[idx[b, k], c] += sum_t p[b, t, k] * q[b, t, c]`` with fp32 atomic adds, so ranks that
  several samples (or one sample several times) select accumulate correctly.

Forward is shrink(x, A) then expand(h, B); backward reuses them with the weights transposed (strides only, no
copies): ``dh = shrink(dy, B^T)``, ``dx = expand(dh, A^T)``, ``dA^T[idx] += dh^T x``, ``dB[idx] += h^T dy``.
Gathered ranks are read in place through their indices; a rank-major pool (PCLR's ``A`` is N x in, passed as its
transpose) makes every gathered rank one contiguous row.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["supports", "triton_rank_pool_gather"]

# tl.dot needs every tile dimension >= 16; smaller problems are masked inside a 16-wide tile.
_MIN_BLOCK = 16


def _block(n: int, hi: int) -> int:
    return max(_MIN_BLOCK, min(hi, triton.next_power_of_2(max(n, 1))))


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: follow torch's own matmul setting, so the kernel is as exact as the reference it replaces (torch
    # defaults to full fp32, Triton to tf32). 16-bit inputs ignore the setting.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``tensors``, one after the other: the stride arguments of the kernels here, in their order."""
    return tuple(stride for tensor in tensors for stride in tensor.stride())


def _dot_options(dtype: torch.dtype) -> dict[str, object]:
    """The ``PRECISION`` and ``DOT_F32`` constexprs of every kernel here, for weights of ``dtype``."""
    # Triton's CPU interpreter multiplies bf16 tiles as their raw uint16 bits (np.matmul on the storage), so under
    # TRITON_INTERPRET=1 bf16 tiles are widened to fp32 before tl.dot. On a GPU the dot runs on bf16 tensor cores.
    dot_f32 = dtype == torch.bfloat16 and triton.knobs.runtime.interpret
    return {"PRECISION": _precision(dtype), "DOT_F32": dot_f32}


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc + a @ b`` with ``a`` cast to ``b``'s dtype (fp32 accumulation), or both widened (see _dot_options)."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    else:
        a = a.to(b.dtype)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _span(start, BLOCK: tl.constexpr, n):
    """The offsets ``start .. start + BLOCK - 1`` into a dimension of size ``n``, and the mask of those inside it."""
    offs = start + tl.arange(0, BLOCK)
    return offs, offs < n


@triton.jit
def _program_tiles(n1, n2, BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr):
    """This program's sample (grid axis 0, as int64) and its tiles of two dimensions of sizes ``n1`` and ``n2`` (grid
    axes 1 and 2): ``pid_b, offs_1, mask_1, offs_2, mask_2``."""
    offs_1, mask_1 = _span(tl.program_id(1) * BLOCK_1, BLOCK_1, n1)
    offs_2, mask_2 = _span(tl.program_id(2) * BLOCK_2, BLOCK_2, n2)
    return tl.program_id(0).to(tl.int64), offs_1, mask_1, offs_2, mask_2


@triton.jit
def _h_rows(h_ptr, pid_b, offs_t, T, K):
    """Pointers to rows ``offs_t`` of sample ``pid_b`` in the fp32 intermediate ``h`` (contiguous (batch, T, K))."""
    return h_ptr + pid_b * T * K + offs_t[:, None] * K


@triton.jit
def _load_ranks(idx_ptr, pid_b, offs_k, mask_k, stride_ib, stride_ik):
    """Sample ``pid_b``'s rank indices ``idx[pid_b, offs_k]`` as int64 (masked lanes read rank 0)."""
    return tl.load(idx_ptr + pid_b * stride_ib + offs_k * stride_ik, mask=mask_k, other=0).to(tl.int64)


@triton.jit
def _shrink_kernel(
    x_ptr,
    w_ptr,
    idx_ptr,
    gate_ptr,
    h_ptr,
    T,
    D,
    K,
    stride_xb,
    stride_xt,
    stride_xd,
    stride_wd,
    stride_wn,
    stride_ib,
    stride_ik,
    stride_gb,
    stride_gk,
    scale,
    HAS_GATES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_b, offs_t, mask_t, offs_k, mask_k = _program_tiles(T, K, BLOCK_T, BLOCK_K)
    x_rows = x_ptr + pid_b * stride_xb + offs_t[:, None].to(tl.int64) * stride_xt
    ranks = _load_ranks(idx_ptr, pid_b, offs_k, mask_k, stride_ib, stride_ik)
    w_cols = w_ptr + ranks[None, :] * stride_wn
    acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d, mask_d = _span(d0, BLOCK_D, D)
        x = tl.load(x_rows + offs_d[None, :] * stride_xd, mask=mask_t[:, None] & mask_d[None, :], other=0.0)
        w = tl.load(w_cols + offs_d[:, None] * stride_wd, mask=mask_d[:, None] & mask_k[None, :], other=0.0)
        acc = _dot(x, w, acc, PRECISION, DOT_F32)
    if HAS_GATES:
        g = tl.load(gate_ptr + pid_b * stride_gb + offs_k * stride_gk, mask=mask_k, other=0.0)
        acc = acc * g.to(tl.float32)[None, :]
    acc = acc * scale
    tl.store(_h_rows(h_ptr, pid_b, offs_t, T, K) + offs_k[None, :], acc, mask=mask_t[:, None] & mask_k[None, :])


@triton.jit
def _expand_kernel(
    h_ptr,
    w_ptr,
    idx_ptr,
    y_ptr,
    T,
    K,
    N_OUT,
    stride_wn,
    stride_wo,
    stride_ib,
    stride_ik,
    stride_yb,
    stride_yt,
    stride_yo,
    scale,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_O: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_b, offs_t, mask_t, offs_o, mask_o = _program_tiles(T, N_OUT, BLOCK_T, BLOCK_O)
    h_rows = _h_rows(h_ptr, pid_b, offs_t, T, K)
    acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k, mask_k = _span(k0, BLOCK_K, K)
        ranks = _load_ranks(idx_ptr, pid_b, offs_k, mask_k, stride_ib, stride_ik)
        h = tl.load(h_rows + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        w_ptrs = w_ptr + ranks[:, None] * stride_wn + offs_o[None, :] * stride_wo
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_o[None, :], other=0.0)
        acc = _dot(h, w, acc, PRECISION, DOT_F32)
    acc = acc * scale
    y_ptrs = y_ptr + pid_b * stride_yb + offs_t[:, None].to(tl.int64) * stride_yt + offs_o[None, :] * stride_yo
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_o[None, :])


@triton.jit
def _wgrad_kernel(
    p_ptr,
    q_ptr,
    idx_ptr,
    out_ptr,
    T,
    K,
    C,
    stride_qb,
    stride_qt,
    stride_qc,
    stride_ib,
    stride_ik,
    stride_on,
    stride_oc,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_b, offs_k, mask_k, offs_c, mask_c = _program_tiles(K, C, BLOCK_K, BLOCK_C)
    ranks = _load_ranks(idx_ptr, pid_b, offs_k, mask_k, stride_ib, stride_ik)
    acc = tl.zeros((BLOCK_K, BLOCK_C), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        offs_t, mask_t = _span(t0, BLOCK_T, T)
        p_ptrs = p_ptr + pid_b * T * K + offs_t[None, :] * K + offs_k[:, None]
        p = tl.load(p_ptrs, mask=mask_k[:, None] & mask_t[None, :], other=0.0)
        q_ptrs = q_ptr + pid_b * stride_qb + offs_t[:, None].to(tl.int64) * stride_qt + offs_c[None, :] * stride_qc
        q = tl.load(q_ptrs, mask=mask_t[:, None] & mask_c[None, :], other=0.0)
        acc = _dot(p, q, acc, PRECISION, DOT_F32)
    out_ptrs = out_ptr + ranks[:, None] * stride_on + offs_c[None, :] * stride_oc
    tl.atomic_add(out_ptrs, acc, mask=mask_k[:, None] & mask_c[None, :])


def _shrink(
    x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gates: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    """``scale * g[b, k] * (x[b] @ w[:, idx[b]])`` as fp32 (batch, tokens, K); ``w`` is (D, N) with any strides."""
    batch, tokens, width = x.shape
    k = idx.shape[1]
    h = torch.empty(batch, tokens, k, dtype=torch.float32, device=x.device)
    bt, bk, bd = _block(tokens, 64), _block(k, 64), _block(width, 64)
    g = gates if gates is not None else h
    g_strides = gates.stride() if gates is not None else (0, 0)
    grid = (batch, triton.cdiv(tokens, bt), triton.cdiv(k, bk))
    args = (x, w, idx, g, h, tokens, width, k, *_strides(x, w, idx), *g_strides, float(scale))
    _shrink_kernel[grid](
        *args, HAS_GATES=gates is not None, BLOCK_T=bt, BLOCK_K=bk, BLOCK_D=bd, **_dot_options(w.dtype)
    )
    return h


def _expand(h: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale * h[b] @ w[idx[b], :]`` in ``dtype``; ``h`` is fp32 contiguous (batch, tokens, K), ``w`` (N, O)."""
    batch, tokens, k = h.shape
    width = w.shape[1]
    y = torch.empty(batch, tokens, width, dtype=dtype, device=h.device)
    bt, bk, bo = _block(tokens, 64), _block(k, 64), _block(width, 128)
    grid = (batch, triton.cdiv(tokens, bt), triton.cdiv(width, bo))
    args = (h, w, idx, y, tokens, k, width, *_strides(w, idx, y), float(scale))
    _expand_kernel[grid](*args, BLOCK_T=bt, BLOCK_K=bk, BLOCK_O=bo, **_dot_options(w.dtype))
    return y


def _wgrad(p: torch.Tensor, q: torch.Tensor, idx: torch.Tensor, n_ranks: int) -> torch.Tensor:
    """fp32 (N, C) with row ``idx[b, k]`` accumulating ``p[b, :, k] @ q[b]`` over every (b, k)."""
    batch, tokens, k = p.shape
    width = q.shape[2]
    out = torch.zeros(n_ranks, width, dtype=torch.float32, device=p.device)
    bt, bk, bc = _block(tokens, 64), _block(k, 64), _block(width, 128)
    grid = (batch, triton.cdiv(k, bk), triton.cdiv(width, bc))
    args = (p, q, idx, out, tokens, k, width, *_strides(q, idx, out))
    _wgrad_kernel[grid](*args, BLOCK_T=bt, BLOCK_K=bk, BLOCK_C=bc, **_dot_options(q.dtype))
    return out


class _RankPoolGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, A_pool, B_pool, indices, scale, gates):  # noqa: D102
        squeeze = x.dim() == 2
        x3 = x.unsqueeze(1) if squeeze else x
        idx = indices.contiguous()
        h = _shrink(x3, A_pool, idx, gates, 1.0)  # gated, unscaled: dB needs exactly this
        y = _expand(h, B_pool, idx, scale, x.dtype)
        ctx.save_for_backward(x3, A_pool, B_pool, idx, gates, h)
        ctx.scale, ctx.squeeze = scale, squeeze
        return y.squeeze(1) if squeeze else y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x3, A_pool, B_pool, idx, gates, h = ctx.saved_tensors
        dy3 = dy.unsqueeze(1) if ctx.squeeze else dy
        n_ranks = A_pool.shape[1]
        dx = dA = dB = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dh = _shrink(dy3, B_pool.mT, idx, gates, ctx.scale)  # scale * g * (dy @ B_S^T)
            if ctx.needs_input_grad[0]:
                dx = _expand(dh, A_pool.mT, idx, 1.0, x3.dtype)
                dx = dx.squeeze(1) if ctx.squeeze else dx
            if ctx.needs_input_grad[1]:
                dA = _wgrad(dh, x3, idx, n_ranks).mT.to(A_pool.dtype)
        if ctx.needs_input_grad[2]:
            dB = _wgrad(h, dy3, idx, n_ranks).mul_(ctx.scale).to(B_pool.dtype)
        return dx, dA, dB, None, None, None


def triton_rank_pool_gather(
    x: Tensor, A_pool: Tensor, B_pool: Tensor, indices: Tensor, scale: float, gates: Tensor | None = None
) -> Tensor:
    """The fused rank-pool gather; same signature and result as :func:`.rank_pool.rank_pool_gather_indexed`.

    Differentiable in ``x``, ``A_pool`` and ``B_pool``. Gates are treated as constants (PCLR's are hard 0/1 and its
    keys learn through the query loss), so gates that require a gradient are refused, as are empty inputs:
    :func:`.rank_pool.rank_pool_gather` sends both to the torch reference.
    """
    if x.numel() == 0 or indices.shape[1] == 0:
        raise ValueError(
            f"the fused gather needs a non-empty batch and K >= 1, got x {tuple(x.shape)} and indices "
            f"{tuple(indices.shape)}; rank_pool_gather runs such inputs on the torch reference"
        )
    if gates is not None and gates.requires_grad:
        raise ValueError(
            "the fused gather treats gates as constants, got gates that require a gradient; use rank_pool_gather, "
            "which runs them on the torch reference"
        )
    if x.dtype != A_pool.dtype or x.dtype != B_pool.dtype:
        raise TypeError(f"x, A_pool and B_pool must share a dtype, got {x.dtype}, {A_pool.dtype}, {B_pool.dtype}")
    return _RankPoolGather.apply(x, A_pool, B_pool, indices, float(scale), gates)


def supports(x: torch.Tensor) -> bool:
    """Whether :func:`triton_rank_pool_gather` runs on ``x``: CUDA tensors in fp32 / fp16 / bf16.

    Args:
        x: The gather's input.
    """
    return x.is_cuda and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
