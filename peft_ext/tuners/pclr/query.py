"""Where PCLR's routing query comes from, by architecture (docs/pclr.md, "Routing query by architecture").

One query per sample, L2-normalized, computed once per forward pass:

- **token models** (an ``nn.Embedding`` input embedding: decoders, encoders, the encoder of an encoder-decoder): the
  attention-mask-aware mean of the input token embeddings (:func:`default_query`); width: the embedding's.
- **image models** (the input embedding is a patch embedding, a module with a convolution in it: ViT's
  ``ViTPatchEmbeddings``, CLIP's vision ``patch_embedding``): the mean patch embedding of ``pixel_values``, before
  the class token and the position embeddings are added (:func:`default_query`); width: the convolution's output
  channels.
- **anything else** (feature models such as PEFT's test MLPs called with ``X=``): the mean over all but the first and
  last axis of the input of the first adapted layer (:func:`pooled_query`, taken by the routing state in a forward
  pre-hook of that layer); width: that layer's ``in_features``.

:func:`query_source` says which applies to a model and its width (``PCLRConfig.query_dim``'s default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .._architecture import find_input_embeddings, find_patch_embeddings

__all__ = ["QuerySource", "default_query", "pooled_query", "query_source"]


@dataclass(frozen=True)
class QuerySource:
    """Where a model's default routing query comes from (see the module docstring).

    Args:
        kind: ``"tokens"`` (input token embeddings) or ``"patches"`` (patch embeddings of ``pixel_values``).
        dim: The query's width.
    """

    kind: str
    dim: int


def query_source(model: nn.Module) -> Optional[QuerySource]:
    """The default query of ``model`` when it has token or patch inputs; ``None`` when it has neither (the routing
    state then takes the pooled input of the first adapted layer, whose ``in_features`` is the width).

    Args:
        model: The wrapped model.
    """
    embedding = find_input_embeddings(model)
    if embedding is not None:
        return QuerySource("tokens", embedding.embedding_dim)
    patches = find_patch_embeddings(model)
    if patches is not None:
        return QuerySource("patches", patches[1])
    return None


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, in float32 or its own dtype where wider (a float64 model's query is float64: its routing and
    keys' gradient carry no float32 rounding)."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


def _masked_mean(embeds: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    embeds = at_least_float32(embeds)
    if mask is not None and mask.dim() == 2 and mask.shape == embeds.shape[:2]:
        weights = mask.to(embeds.dtype).unsqueeze(-1)
        return (embeds * weights).sum(1) / weights.sum(1).clamp_min(1.0)
    return embeds.mean(1)


def _patch_query(model: nn.Module, pixels: torch.Tensor) -> Optional[torch.Tensor]:
    found = find_patch_embeddings(model)
    if found is None:
        return None
    embedding = found[0]
    with torch.no_grad():
        patches = embedding(pixels.to(dtype=next(embedding.parameters()).dtype))
    if patches.dim() == 4:  # a bare convolution (CLIP): (batch, width, h, w)
        patches = patches.flatten(2).mT
    if patches.dim() != 3:
        raise ValueError(
            f"the patch embedding {type(embedding).__name__} returned shape {tuple(patches.shape)}; PCLR's default "
            "query needs (batch, patches, width) or (batch, width, h, w): pass query_fn="
        )
    return F.normalize(at_least_float32(patches).mean(1), dim=-1)


def default_query(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Optional[torch.Tensor]:
    """The default query, shape (batch, d): the public code's for token models, the mean patch embedding for image
    models; ``None`` for anything else (the routing state then takes the first adapted layer's input,
    :func:`pooled_query`).

    Reads the arguments by name (the routing state binds positional arguments to the forward's parameter names, see
    :func:`~.router.forward_arguments`): ``inputs_embeds`` if given, else ``input_ids`` embedded with the model's
    input embedding (an integer tensor passed first positionally counts as ``input_ids`` too), averaged over the
    tokens that ``attention_mask`` marks (left or right padding alike); else ``pixel_values`` (or a 4-D
    floating-point first positional argument) through the model's patch embedding, averaged over the patches. Pass a
    custom ``query_fn`` to :meth:`PCLRModel.set_query_fn` for anything else (e.g. a vision CLS feature).

    Args:
        model: The wrapped (base) model.
        args: Positional arguments of its forward, as passed.
        kwargs: Every argument of its forward by name.
    """
    embeds = kwargs.get("inputs_embeds")
    ids = kwargs.get("input_ids")
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if ids is None and first is not None and not first.is_floating_point():
        ids = first
    if embeds is None and ids is not None:
        embedding = find_input_embeddings(model)
        if embedding is None:
            raise ValueError(
                f"{type(model).__name__} takes input_ids but has no input embedding (get_input_embeddings()); "
                "pass query_fn= to compute PCLR's routing query"
            )
        with torch.no_grad():
            embeds = embedding(ids)
    if embeds is not None:
        return F.normalize(_masked_mean(embeds, kwargs.get("attention_mask")), dim=-1)
    pixels = kwargs.get("pixel_values")
    if pixels is None and first is not None and first.is_floating_point() and first.dim() == 4:
        pixels = first
    if isinstance(pixels, torch.Tensor):
        return _patch_query(model, pixels)
    return None


def pooled_query(x: torch.Tensor) -> torch.Tensor:
    """The query a layer input gives a model without token or patch inputs: ``x`` (batch, ..., width) averaged over
    every axis but the first and the last, L2-normalized, float32 (float64 for a float64 input) and detached (an
    integer input is cast)."""
    x = at_least_float32(x)
    if x.dim() > 2:
        x = x.flatten(1, -2).mean(1)
    elif x.dim() < 2:
        raise ValueError(f"cannot pool a layer input of shape {tuple(x.shape)} into one query per sample")
    return F.normalize(x, dim=-1)
