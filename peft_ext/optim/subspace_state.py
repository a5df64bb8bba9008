"""SubspaceAdamW's per-parameter state, for every basis: carrying moments between index selections and storing buffers
in 8 bits.

Pure functions on tensors and on one parameter's state dict; :class:`~peft_ext.optim.SubspaceAdamW` (and so its
preset :class:`~peft_ext.optim.DCTAdamW`) and the basis objects of :mod:`.bases` call them.
A buffer (moment, error feedback) lives in the state either as a float tensor ``key`` or, quantized, as
``key_q`` (uint8 codes) + ``key_absmax`` (float32 block scales): :func:`load_buffer` and :func:`store_buffer` hide
which.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "QUANT_BLOCKSIZES",
    "QUANT_MAPS",
    "dequantize_8bit",
    "load_buffer",
    "match_indices",
    "quantize_8bit",
    "rotate_selected",
    "store_buffer",
]

#: Block sizes bitsandbytes' blockwise quantization accepts on every backend (CUDA kernels are compiled for these).
QUANT_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)


# --- moment rotation ------------------------------------------------------------------------------------------------


def match_indices(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Match two ascending index selections: ``(kept, source)`` with ``kept[k]`` true when ``new[k]`` is in ``old``,
    at position ``source[k]`` (meaningless where ``kept`` is false)."""
    if old.numel() == 0:
        return torch.zeros_like(new, dtype=torch.bool), torch.zeros_like(new)
    source = torch.searchsorted(old, new).clamp_max_(old.numel() - 1)
    return old[source] == new, source


def rotate_selected(tensor: torch.Tensor, old: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """Carry ``tensor`` (indexed by the ``old`` selection along ``dim``) over to the ``new`` selection.

    Because the DCT basis is orthonormal, the paper's rotation ``Q[I_old] Q[I_new]^T`` is a 0/1 partial permutation:
    a basis vector kept by both selections keeps its slice, a new one starts at zero. This applies that permutation
    by index matching instead of an ``r x r`` product (same result, no float error, O(r log r)).
    """
    kept, source = match_indices(old, new)
    shape = list(tensor.shape)
    shape[dim] = new.numel()
    out = tensor.new_zeros(shape)
    where = kept.nonzero().squeeze(1)
    out.index_copy_(dim, where, tensor.index_select(dim, source[where]))
    return out


# --- 8-bit blockwise quantization ----------------------------------------------------------------------------------


#: The 8-bit code books: bitsandbytes' signed dynamic (exponent) map for the first moment, its unsigned variant for
#: the non-negative second moment (all 256 codes on [0, 1], as in bitsandbytes' 8-bit Adam), and a uniform signed map
#: for the error-feedback residual. The residual is dense and roughly Gaussian within a block, where the uniform grid
#: has about a third less RMS error than the dynamic one (0.70% vs 1.09% of the norm, blocks of 256); the public code
#: also quantizes its error buffer uniformly.
QUANT_MAPS = ("dynamic", "udynamic", "linear")
_QMAPS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _qmap(kind: str, device: torch.device) -> torch.Tensor:
    key = (kind, device)
    if key not in _QMAPS:
        from bitsandbytes.functional import create_dynamic_map, create_linear_map

        if kind == "linear":
            code = create_linear_map(signed=True)
        elif kind in ("dynamic", "udynamic"):
            code = create_dynamic_map(signed=kind == "dynamic")
        else:
            raise ValueError(f"`kind` must be one of {QUANT_MAPS}, got {kind!r}")
        _QMAPS[key] = code.to(device)
    return _QMAPS[key]


def quantize_8bit(x: torch.Tensor, kind: str = "dynamic", blocksize: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise 8-bit quantization through bitsandbytes: ``(codes uint8, absmax float32)``.

    Each block of ``blocksize`` consecutive values is scaled by its absolute maximum and rounded to the nearest of
    the 256 values of the code book ``kind`` (see :data:`QUANT_MAPS`; Dettmers et al., "8-bit Optimizers via
    Block-wise Quantization"). On CPU bitsandbytes 0.50 runs this in its native C kernel for fp32, bf16 and fp16.
    """
    from bitsandbytes.functional import quantize_blockwise

    if blocksize not in QUANT_BLOCKSIZES:
        raise ValueError(f"`blocksize` must be one of {QUANT_BLOCKSIZES}, got {blocksize!r}")
    source = x.detach().float().contiguous()
    codes, qstate = quantize_blockwise(source, code=_qmap(kind, x.device), blocksize=blocksize)
    return codes, qstate.absmax


def dequantize_8bit(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    kind: str = "dynamic",
    blocksize: int = 256,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_8bit` (same ``kind`` and ``blocksize``); returns a tensor of ``codes``' shape."""
    from bitsandbytes.functional import dequantize_blockwise

    out = dequantize_blockwise(codes, absmax=absmax, code=_qmap(kind, codes.device), blocksize=blocksize)
    return out.to(dtype)


# --- buffers in the state dict --------------------------------------------------------------------------------------


def load_buffer(
    state: dict[str, Any],
    key: str,
    shape: Sequence[int],
    kind: str,
    blocksize: int,
    work: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The buffer ``key`` of ``state`` in dtype ``work``, dequantized if stored 8-bit, zeros (``shape``) if absent.

    Args:
        state: One parameter's optimizer state.
        key: The buffer's name (``"exp_avg"``, ``"exp_avg_sq"``, ``"error"``).
        shape: Its shape, for a buffer not created yet.
        kind: Its code book (:data:`QUANT_MAPS`), used if it is stored 8-bit.
        blocksize: Its quantization block size.
        work: Dtype to compute in.
        device: Device of a new buffer.
    """
    if key in state:
        return state[key].to(work)
    if f"{key}_q" in state:
        return dequantize_8bit(state[f"{key}_q"], state[f"{key}_absmax"], kind, blocksize, work)
    return torch.zeros(shape, dtype=work, device=device)


def store_buffer(
    state: dict[str, Any],
    key: str,
    value: torch.Tensor,
    eight_bit: bool,
    kind: str,
    options: Mapping[str, Any],
    dtype: torch.dtype,
) -> None:
    """Store ``value`` as the buffer ``key``: 8-bit when ``eight_bit`` and it is large enough, else in ``dtype``.

    Args:
        state: One parameter's optimizer state.
        key: The buffer's name.
        value: The new content.
        eight_bit: Whether this buffer is kept 8-bit.
        kind: Its code book (:data:`QUANT_MAPS`).
        options: The parameter group (its ``min_8bit_size`` and ``quant_blocksize``).
        dtype: Dtype of a float buffer (the parameter's).
    """
    if eight_bit and value.numel() >= options["min_8bit_size"]:
        state[f"{key}_q"], state[f"{key}_absmax"] = quantize_8bit(value, kind, options["quant_blocksize"])
        state.pop(key, None)
    else:
        state[key] = value if value.dtype == dtype else value.to(dtype)
        state.pop(f"{key}_q", None)
        state.pop(f"{key}_absmax", None)
