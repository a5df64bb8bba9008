"""Pure tensor kernels with torch reference implementations (and, where registered, fused fast paths).

:mod:`.dispatch` chooses between them (``PEFT_EXT_KERNELS``, the kernel registry); :mod:`.rank_pool` (with
:mod:`.rank_pool_stores`, the gather over a pool held in two stores) and :mod:`.retraction` hold the references and
the entry points; the Triton modules are imported only on first use.
"""

from __future__ import annotations

from .dispatch import (
    KERNEL_ENV_VAR,
    RankPoolKernel,
    kernel_mode,
    load_rank_pool_kernel,
    register_rank_pool_kernel,
    registered_rank_pool_kernel,
)
from .rank_pool import (
    choose_reference,
    rank_pool_gather,
    rank_pool_gather_indexed,
    rank_pool_gather_loop,
    rank_pool_gather_masked,
    rank_pool_gather_shared,
)
from .rank_pool_stores import pool_of_stores, rank_pool_gather_stores
from .retraction import batched_retraction, cholesky_qr2, choose_retraction, retract, stack_by_shape

__all__ = [
    "KERNEL_ENV_VAR",
    "RankPoolKernel",
    "batched_retraction",
    "cholesky_qr2",
    "choose_reference",
    "choose_retraction",
    "kernel_mode",
    "load_rank_pool_kernel",
    "pool_of_stores",
    "rank_pool_gather",
    "rank_pool_gather_indexed",
    "rank_pool_gather_loop",
    "rank_pool_gather_masked",
    "rank_pool_gather_shared",
    "rank_pool_gather_stores",
    "register_rank_pool_kernel",
    "registered_rank_pool_kernel",
    "retract",
    "stack_by_shape",
]
