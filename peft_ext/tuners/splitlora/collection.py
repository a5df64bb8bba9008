"""Collecting a task's input statistics with forward hooks (``SplitLoRAModel.collect_statistics``): each adapted
module's inputs, without the padded positions of its stack's token mask, go to its statistics of the task in progress,
one accumulator per distinct input (:mod:`.sharing`)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from .._architecture import encoder_decoder_stacks
from .layer import SplitLoRALayer
from .sharing import SharedInputs

__all__ = ["statistics_hooks", "token_rows"]


class _MaskHolder:
    """State shared by the statistics hooks of one ``collect_statistics`` block: the token mask of the forward pass in
    progress, and the modules' accumulators (:class:`.sharing.SharedInputs`: modules fed the very same tensor, a
    Llama block's ``q_proj`` / ``k_proj`` / ``v_proj``, its ``gate_proj`` / ``up_proj``, share one).

    On an encoder-decoder the mask follows the stack that runs: the encoder's ``attention_mask`` in the encoder, the
    decoder's own (``decoder_attention_mask``; none: every position counts) in the decoder, and the encoder's mask
    again for the decoder's cross-attention inputs (``memory``: the encoder's output, the very tensor the decoder's
    cross-attention key / value projections read)."""

    def __init__(self, inputs: SharedInputs) -> None:
        self.mask: torch.Tensor | None = None
        self.memory: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.warned = False
        self.inputs = inputs

    def reset(self) -> None:
        """A new forward pass (or stack): nothing from the last one may be shared."""
        self.inputs.flush()
        self.memory = None

    def mask_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The token mask of input ``x``: the encoder's for the encoder's output read by the decoder, else the
        current stack's."""
        if self.memory is not None and x is self.memory[0]:
            return self.memory[1]
        return self.mask


def _tensor_or_none(value: Any) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def _capture_mask(holder: _MaskHolder, key: str | None, module: nn.Module, args: tuple, kwargs: dict) -> None:
    holder.reset()  # a new forward pass: nothing from the last one may be shared
    holder.mask = _tensor_or_none(kwargs.get(key)) if key is not None else None


def _capture_encoder_mask(holder: _MaskHolder, module: nn.Module, args: tuple, kwargs: dict) -> None:
    # an encoder-decoder's encoder: its own mask (the same as the model's when called by the model's forward)
    holder.reset()
    holder.mask = _tensor_or_none(kwargs.get("attention_mask"))


def _capture_decoder_mask(holder: _MaskHolder, module: nn.Module, args: tuple, kwargs: dict) -> None:
    # an encoder-decoder's decoder: its own mask for its tokens, the encoder's for the encoder output it attends to
    holder.inputs.flush()
    holder.mask = _tensor_or_none(kwargs.get("attention_mask"))
    memory = _tensor_or_none(kwargs.get("encoder_hidden_states"))
    holder.memory = None if memory is None else (memory, _tensor_or_none(kwargs.get("encoder_attention_mask")))


def token_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The rows of a layer input ``x`` that ``mask`` (``(batch, seq)``, nonzero = real token) keeps, one token per
    row; ``None`` when the mask does not fit ``x``.

    ``x`` is ``(batch, seq, width)``, or flattened tokens ``(batch x seq, width)`` (OPT's decoder MLP reshapes its
    input to that before ``fc1`` / ``fc2``; flattening keeps the samples in order, so the mask flattens the same way).

    Args:
        x: The layer input.
        mask: The token mask, or ``None`` (every row).
    """
    if mask is None:
        return x.reshape(-1, x.shape[-1])
    keep = mask.to(device=x.device, dtype=torch.bool)
    if tuple(x.shape[:-1]) == tuple(mask.shape):
        return x[keep]
    if x.dim() == 2 and x.shape[0] == mask.numel():
        return x[keep.reshape(-1)]
    return None


def _rows(holder: _MaskHolder, module: SplitLoRALayer, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # Padded positions never reach a masked-mean or last-token head, so they do not belong to the task's input
    # distribution; the public code (ViT, no padding) never meets them.
    rows = token_rows(x, mask)
    if rows is None:
        if not holder.warned:
            holder.warned = True
            warnings.warn(
                f"SplitLoRA statistics: the token mask has shape {tuple(mask.shape)} but the input of "
                f"{module._splitlora_seed_key!r} has leading shape {tuple(x.shape[:-1])}; counting every position "
                "of such inputs.",
                UserWarning,
                stacklevel=3,
            )
        rows = x.reshape(-1, x.shape[-1])
    return rows


def _statistics_hook(holder: _MaskHolder, adapter_name: str, module: SplitLoRALayer, args: tuple, kwargs: dict):
    x = args[0] if args else kwargs.get("input", kwargs.get("x"))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"SplitLoRA statistics hook: cannot find the input tensor of {module._splitlora_seed_key!r}")
    mask = holder.mask_for(x)
    holder.inputs.report(module, x, mask, partial(_rows, holder, module, x, mask))


@contextmanager
def statistics_hooks(
    model: nn.Module, layers: Sequence[SplitLoRALayer], adapter_name: str, mask_key: str | None
) -> Iterator[None]:
    """Inside the block, every forward pass of ``model`` adds the inputs of ``layers`` to ``adapter_name``'s
    statistics of the task in progress, masked by the forward's ``mask_key`` argument (see
    ``SplitLoRAModel.collect_statistics``); the hooks are removed on exit.

    Args:
        model: The wrapped model.
        layers: Its SplitLoRA layers that hold ``adapter_name``.
        adapter_name: The adapter.
        mask_key: Name of the forward keyword argument holding the token mask, or ``None`` (every position).
    """
    holder = _MaskHolder(SharedInputs(layers, adapter_name))
    handles = []
    try:
        handles.append(model.register_forward_pre_hook(partial(_capture_mask, holder, mask_key), with_kwargs=True))
        # the stacks' own masks have the names of a transformers model's: with the default mask_key only
        stacks = encoder_decoder_stacks(model) if mask_key == "attention_mask" else None
        if stacks is not None:
            encoder, decoder = stacks
            hooks = ((encoder, _capture_encoder_mask), (decoder, _capture_decoder_mask))
            handles.extend(m.register_forward_pre_hook(partial(h, holder), with_kwargs=True) for m, h in hooks)
        for layer in layers:
            handles.append(
                layer.register_forward_pre_hook(partial(_statistics_hook, holder, adapter_name), with_kwargs=True)
            )
        yield
        holder.inputs.flush()  # the last group's rows; not after an exception, which left the statistics partial
    finally:
        holder.inputs.discard()
        holder.memory = None
        for handle in handles:
            handle.remove()
