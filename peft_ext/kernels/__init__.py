"""Pure tensor kernels with torch reference implementations (and, where registered, fused fast paths)."""

from __future__ import annotations

from .rank_pool import (
    KERNEL_ENV_VAR,
    RankPoolKernel,
    choose_reference,
    kernel_mode,
    load_rank_pool_kernel,
    rank_pool_gather,
    rank_pool_gather_indexed,
    rank_pool_gather_loop,
    rank_pool_gather_masked,
    register_rank_pool_kernel,
    registered_rank_pool_kernel,
)
from .retraction import batched_retraction, cholesky_qr2, choose_retraction, retract

__all__ = [
    "KERNEL_ENV_VAR",
    "RankPoolKernel",
    "batched_retraction",
    "cholesky_qr2",
    "choose_retraction",
    "choose_reference",
    "kernel_mode",
    "load_rank_pool_kernel",
    "rank_pool_gather",
    "rank_pool_gather_indexed",
    "rank_pool_gather_loop",
    "rank_pool_gather_masked",
    "register_rank_pool_kernel",
    "registered_rank_pool_kernel",
    "retract",
]
