"""Which implementation runs: the ``PEFT_EXT_KERNELS`` setting and the registry of fast (Triton) kernels.

The torch references (:mod:`.rank_pool`, :mod:`.retraction`) and the Triton kernels (:mod:`.triton_rank_pool`,
:mod:`.triton_retraction`) do not know each other: both sides import only this module, and this module imports the
Triton modules lazily, on the first call that can use them. So importing ``peft_ext`` never imports Triton, and a
machine without Triton keeps the torch references.

``PEFT_EXT_KERNELS`` (environment variable) = ``auto`` (default), ``torch`` or ``triton``:

- ``torch``: always a torch reference.
- ``auto`` / ``triton``: the fast kernel if there is one and it accepts the inputs (e.g. CUDA tensors); otherwise
  the torch reference, silently, so CPU runs never fail because of the setting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from torch import Tensor

__all__ = [
    "KERNEL_ENV_VAR",
    "RankPoolKernel",
    "RetractionKernels",
    "fast_rank_pool_kernel",
    "kernel_mode",
    "load_rank_pool_kernel",
    "load_retraction_kernels",
    "register_rank_pool_kernel",
    "registered_rank_pool_kernel",
]

KERNEL_ENV_VAR = "PEFT_EXT_KERNELS"
_MODES = ("auto", "torch", "triton")


def kernel_mode() -> str:
    """The value of ``PEFT_EXT_KERNELS`` (``auto`` when unset); raises ``ValueError`` for anything else."""
    mode = os.environ.get(KERNEL_ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{KERNEL_ENV_VAR}={mode!r} is not valid; use one of {_MODES}")
    return mode


# --- the rank-pool gather --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankPoolKernel:
    """A fast rank-pool gather implementation.

    :func:`.rank_pool.rank_pool_gather` calls ``fn`` only with validated, non-empty inputs whose gates (if any) do
    not require a gradient; everything else goes to the torch reference.

    Args:
        name: Label, e.g. ``"triton"``.
        fn: Same signature and semantics as :func:`.rank_pool.rank_pool_gather_indexed`.
        supports: Whether ``fn`` can run on these inputs (e.g. ``x.is_cuda``).
    """

    name: str
    fn: Callable[..., Tensor]
    supports: Callable[[Tensor], bool]


_FAST_KERNEL: Optional[RankPoolKernel] = None
_AUTOLOAD_TRIED = False


def register_rank_pool_kernel(kernel: Optional[RankPoolKernel]) -> None:
    """Install (or with ``None`` remove) the fast kernel that :func:`.rank_pool.rank_pool_gather` prefers.

    Args:
        kernel: The kernel; its ``fn`` must match :func:`.rank_pool.rank_pool_gather_indexed` to tolerance (tests
            compare them).
    """
    global _FAST_KERNEL, _AUTOLOAD_TRIED
    _AUTOLOAD_TRIED = True  # an explicit choice (None included) is never overridden by the lazy loader
    if kernel is not None and not isinstance(kernel, RankPoolKernel):
        raise TypeError(f"kernel must be a RankPoolKernel or None, got {type(kernel).__name__}")
    _FAST_KERNEL = kernel


def registered_rank_pool_kernel() -> Optional[RankPoolKernel]:
    """The fast kernel installed with :func:`register_rank_pool_kernel`, or ``None``."""
    return _FAST_KERNEL


def load_rank_pool_kernel() -> Optional[RankPoolKernel]:
    """Register the Triton kernel if Triton imports; return the registered kernel (``None`` without Triton).

    Called by :func:`fast_rank_pool_kernel` on the first CUDA call; call it yourself to register eagerly.
    """
    global _AUTOLOAD_TRIED
    _AUTOLOAD_TRIED = True
    if _FAST_KERNEL is None:
        try:
            from .triton_rank_pool import supports, triton_rank_pool_gather
        except ImportError:  # Triton is only a dependency on Linux x86-64
            return None
        # The Triton module does not know this registry (no import back): the kernel is described here.
        register_rank_pool_kernel(RankPoolKernel("triton", triton_rank_pool_gather, supports))
    return _FAST_KERNEL


def fast_rank_pool_kernel(x: Tensor, indices: Tensor, gates: Optional[Tensor]) -> Optional[RankPoolKernel]:
    """The fast kernel to use for these inputs under ``PEFT_EXT_KERNELS``, or ``None`` for the torch reference.

    Loads the Triton kernel on the first CUDA call when none is registered. Empty inputs and gates that require a
    gradient always go to the reference (the fused kernels treat gates as constants).

    Args:
        x: The gather's input.
        indices: (batch, K) rank indices.
        gates: Optional (batch, K) gates.
    """
    if kernel_mode() == "torch":
        return None
    if _FAST_KERNEL is None and not _AUTOLOAD_TRIED and x.is_cuda:
        load_rank_pool_kernel()
    fast = _FAST_KERNEL
    if fast is None or x.numel() == 0 or indices.shape[1] == 0 or (gates is not None and gates.requires_grad):
        return None
    return fast if fast.supports(x) else None


# --- the retraction's Gram and small-matmul products -----------------------------------------------------------------


@dataclass(frozen=True)
class RetractionKernels:
    """The batched products of the CholeskyQR2 retraction, as fast kernels.

    Args:
        gram: Batched ``x^T y`` (``y`` defaults to ``x``) in fp32.
        matmul: Batched ``x @ m`` for a small square ``m``, fp32 out.
        max_columns: The widest factor they accept.
    """

    gram: Callable[[Tensor, Optional[Tensor]], Tensor]
    matmul: Callable[[Tensor, Tensor], Tensor]
    max_columns: int


def load_retraction_kernels() -> Optional[RetractionKernels]:
    """The Triton retraction kernels, or ``None`` where Triton does not import."""
    try:
        from .triton_retraction import MAX_GRAM_COLUMNS, gram, matmul_small
    except ImportError:  # Triton is only a dependency on Linux x86-64
        return None
    return RetractionKernels(gram, matmul_small, MAX_GRAM_COLUMNS)
