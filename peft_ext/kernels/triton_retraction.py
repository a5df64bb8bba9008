"""Triton kernels of the CholeskyQR2 retraction: the batched Gram ``X^T Y`` and the small right-multiply ``X M``.

Importing this module imports Triton, so nothing in ``peft_ext`` imports it at import time: :mod:`.retraction` asks
:func:`.dispatch.load_retraction_kernels` for it when the Triton method is chosen. The references are
``x.mT @ y`` and ``x @ m`` (``torch.bmm``); the tests run both under ``TRITON_INTERPRET=1`` on CPU and compile the
kernels for sm_80 / sm_90. The Cholesky factorizations, triangular inverses and the 2r x 2r SVD stay batched torch
calls (tiny).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["MAX_GRAM_COLUMNS", "gram", "matmul_small"]

# More columns than this (rank > 64) would not fit one tile; callers use torch.bmm then.
MAX_GRAM_COLUMNS = 128
# Enough programs to fill an H100/H200 (132 SMs) a few times over when the batch is small.
_TARGET_PROGRAMS = 512


def _column_block(cols: int) -> int:
    # one tile spans every column; tl.dot needs every tile dimension >= 16, narrower factors are masked inside it
    return max(16, triton.next_power_of_2(max(cols, 1)))


@triton.jit
def _gram_kernel(
    x_ptr,
    y_ptr,
    g_ptr,
    M,
    C,
    rows_per_prog,
    stride_xb,
    stride_xm,
    stride_xc,
    stride_yb,
    stride_ym,
    stride_yc,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, M)
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    acc = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask = (offs_m < end)[:, None] & mask_c[None, :]
        x_ptrs = x_ptr + pid_b * stride_xb + offs_m[:, None].to(tl.int64) * stride_xm + offs_c[None, :] * stride_xc
        y_ptrs = y_ptr + pid_b * stride_yb + offs_m[:, None].to(tl.int64) * stride_ym + offs_c[None, :] * stride_yc
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        acc = tl.dot(tl.trans(x), y, acc, input_precision=PRECISION)
    g_ptrs = g_ptr + pid_b * C * C + offs_c[:, None] * C + offs_c[None, :]
    tl.atomic_add(g_ptrs, acc, mask=mask_c[:, None] & mask_c[None, :])


@triton.jit
def _matmul_small_kernel(
    x_ptr,
    m_ptr,
    o_ptr,
    M,
    C,
    stride_xb,
    stride_xm,
    stride_xc,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_C)
    mask_m = offs_m < M
    mask_c = offs_c < C
    x_ptrs = x_ptr + pid_b * stride_xb + offs_m[:, None].to(tl.int64) * stride_xm + offs_c[None, :] * stride_xc
    x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    m_ptrs = m_ptr + pid_b * C * C + offs_c[:, None] * C + offs_c[None, :]
    m = tl.load(m_ptrs, mask=mask_c[:, None] & mask_c[None, :], other=0.0)
    out = tl.dot(x, m, input_precision=PRECISION)
    o_ptrs = o_ptr + pid_b * M * C + offs_m[:, None].to(tl.int64) * C + offs_c[None, :]
    tl.store(o_ptrs, out, mask=mask_m[:, None] & mask_c[None, :])


def gram(x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Batched ``x^T y`` (default ``x^T x``) in fp32 with full-precision dots: (batch, M, C) -> (batch, C, C).

    The row dimension is split over several programs that add their partial Grams atomically, so a batch of a few
    tall matrices still fills the GPU. The reference is ``x.mT @ y``.
    """
    y = x if y is None else y
    batch, rows, cols = x.shape
    if cols > MAX_GRAM_COLUMNS:
        raise ValueError(f"gram supports at most {MAX_GRAM_COLUMNS} columns, got {cols}")
    out = torch.zeros(batch, cols, cols, dtype=torch.float32, device=x.device)
    bm, bc = 64, _column_block(cols)
    splits = max(1, min(triton.cdiv(rows, bm), triton.cdiv(_TARGET_PROGRAMS, max(batch, 1))))
    rows_per_prog = triton.cdiv(triton.cdiv(rows, splits), bm) * bm
    grid = (batch, triton.cdiv(rows, rows_per_prog))
    _gram_kernel[grid](
        x, y, out, rows, cols, rows_per_prog, *x.stride(), *y.stride(), BLOCK_M=bm, BLOCK_C=bc, PRECISION="ieee"
    )
    return out


def matmul_small(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Batched ``x @ m`` for tall ``x`` (batch, M, C) and small square ``m`` (batch, C, C), fp32 out.

    The CholeskyQR step ``Q = X R^{-1}`` (with ``m = R^{-1}``). The reference is ``x @ m``.
    """
    batch, rows, cols = x.shape
    if cols > MAX_GRAM_COLUMNS:
        raise ValueError(f"matmul_small supports at most {MAX_GRAM_COLUMNS} columns, got {cols}")
    m = m.to(torch.float32).contiguous()
    out = torch.empty(batch, rows, cols, dtype=torch.float32, device=x.device)
    bm, bc = 64, _column_block(cols)
    grid = (batch, triton.cdiv(rows, bm))
    _matmul_small_kernel[grid](x, m, out, rows, cols, *x.stride(), BLOCK_M=bm, BLOCK_C=bc, PRECISION="ieee")
    return out
