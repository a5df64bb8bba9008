"""PCLR's per-sample rank selection (docs/methods.md (PCLR)), as pure functions on tensors: the score is
``cos(q, k_i)``, the top-K ranks get a hard gate of 1, and the keys learn only through ``1 - cos(q, k)`` over the
selected keys. The public code selects once per batch; here every sample has its own selection, so a mixed batch of
tasks routes each sample as if it ran alone. Also how a layer's input rows line up with the selection's samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["allowed_by_prototype", "copy_blocks", "per_sample", "query_key_loss", "route", "select_top_k"]


def allowed_by_prototype(
    query: torch.Tensor, prototypes: torch.Tensor, rank_task: torch.Tensor
) -> Optional[torch.Tensor]:
    """Which ranks each sample may use when no task id is given: ranks of tasks up to the nearest prototype's task.

    docs/methods.md (PCLR): the nearest stored prototype decides whether the newest ranks take part. Generalized to any
    number of tasks: a sample closest to task ``t*``'s prototype may use the ranks of tasks ``0..t*`` (never later
    tasks' ranks, which were trained after and can only interfere), plus the ranks of a task that has no prototype yet
    (the task being learnt: its ranks must be usable while it trains).

    Args:
        query: (batch, d) normalized queries.
        prototypes: (T, d) normalized prototypes of tasks ``0..T-1`` (row = task id).
        rank_task: (N,) task of each active rank.

    Returns:
        (batch, N) bool mask, or ``None`` when there are no prototypes (everything allowed).
    """
    if prototypes.shape[0] == 0:
        return None
    nearest = (query @ prototypes.to(query.dtype).mT).argmax(-1)  # (batch,)
    tags = rank_task.unsqueeze(0)
    return (tags <= nearest.unsqueeze(1)) | (tags >= prototypes.shape[0])


def _top_k(
    scores: torch.Tensor, k: int, allowed: Optional[torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # (indices, gates) of the top-k scores per row among the allowed ones; a slot no allowed rank fills gets gate 0
    with torch.no_grad():
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        top, indices = scores.topk(min(k, scores.shape[-1]), dim=-1)
        return indices, torch.isfinite(top).to(dtype)


def _cosine_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    # (batch, N) cos(q_b, k_i) in float32, or the keys' dtype where it is wider (float64: the keys' gradient exact);
    # gradients reach the keys unless they are detached, never the query
    if keys.shape[0] == 0:
        raise ValueError("cannot route over an empty rank pool (0 active ranks)")
    dtype = torch.promote_types(torch.promote_types(keys.dtype, query.dtype), torch.float32)
    return F.normalize(query.detach().to(dtype), dim=-1) @ F.normalize(keys.to(dtype), dim=-1).mT


def select_top_k(
    query: torch.Tensor, keys: torch.Tensor, k: int, allowed: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard top-``k`` selection per sample by cosine score.

    Args:
        query: (batch, d) queries.
        keys: (N, d) keys of the active ranks.
        k: Ranks per sample; ``min(k, N)`` are returned.
        allowed: Optional (batch, N) bool mask of usable ranks.

    Returns:
        ``(indices, gates)``, both (batch, min(k, N)): rank indices and 0/1 gates (0 where a sample has fewer than
        ``k`` allowed ranks; those slots point at an arbitrary rank that contributes nothing).
    """
    with torch.no_grad():
        return _top_k(_cosine_scores(query, keys.detach()), k, allowed, query.dtype)


def query_key_loss(
    query: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor
) -> torch.Tensor:
    """``mean over selected (gated) slots of 1 - cos(q_b, k_i)`` (docs/methods.md (PCLR)); gradients reach the keys.

    The reference of the loss :func:`route` computes from its selection's scores.

    Args:
        query: (batch, d).
        keys: (N, d), possibly trainable.
        indices: (batch, K) selected ranks.
        gates: (batch, K) 0/1 gates.
    """
    cos = F.cosine_similarity(query.detach().unsqueeze(1).to(keys.dtype), keys[indices], dim=-1)
    return ((1.0 - cos) * gates.to(cos.dtype)).sum() / gates.sum().clamp_min(1.0)


def route(
    query: torch.Tensor, keys: torch.Tensor, k: int, allowed: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """:func:`select_top_k` and, when gradients are on and the keys train, the :func:`query_key_loss` of that
    selection, both from one score matrix.

    A layer group routes once per forward pass; computing the loss from the selection's own cosines (gathered at
    the selected indices, gradients reaching the keys through the normalization) spares the second normalization,
    the (batch, K, d) copy of the selected keys and its backward that :func:`query_key_loss` pays. Same selection;
    the loss equal to :func:`query_key_loss`'s to float rounding (in float32, cast to the keys' dtype).

    Args:
        query: (batch, d) queries.
        keys: (N, d) keys of the active ranks, possibly trainable.
        k: Ranks per sample; ``min(k, N)`` are returned.
        allowed: Optional (batch, N) bool mask of usable ranks.

    Returns:
        ``(indices, gates, loss)``: as :func:`select_top_k`, and the loss (``None`` without gradients or trainable
        keys).
    """
    if not (torch.is_grad_enabled() and keys.requires_grad):
        return (*select_top_k(query, keys, k, allowed), None)
    cos = _cosine_scores(query, keys)
    indices, gates = _top_k(cos.detach(), k, allowed, query.dtype)
    weights = gates.to(cos.dtype)
    loss = ((1.0 - cos.gather(1, indices)) * weights).sum() / weights.sum().clamp_min(1.0)
    return indices, gates, loss.to(keys.dtype)


def per_sample(x: torch.Tensor, samples: int, layer: str) -> torch.Tensor:
    """A layer input as (samples, ..., width): as it is when its first axis is the batch, viewed as (samples, tokens,
    width) when it holds flattened tokens (batch x seq, width).

    Some models flatten the tokens before a linear layer: OPT's decoder MLP reshapes the hidden states to (batch x
    seq, d) before ``fc1`` / ``fc2``. Of the architectures tests/architectures.py covers, OPT is the only one (found
    by recording every linear's input shape, tests/test_pclr_architectures.py); GPT-2, Llama, Falcon, T5, BART and
    ViT keep (batch, seq, d) everywhere, and classifier heads and BERT's pooler see (batch, d). Flattening keeps the
    samples in order, so row ``i`` is a token of sample ``i // seq``.

    Args:
        x: The layer input, (batch, ..., width) or (batch x seq, width).
        samples: The number of samples the routing query has.
        layer: The layer's name, for the error.
    """
    if x.shape[0] == samples:
        return x
    if x.dim() == 2 and samples > 0 and x.shape[0] % samples == 0:
        return x.reshape(samples, x.shape[0] // samples, x.shape[1])
    raise ValueError(
        f"PCLR layer {layer!r} got an input of shape {tuple(x.shape)} but the routing query has {samples} samples: "
        f"its first axis must be the batch ({samples}), or a multiple of it for flattened tokens (batch x seq, "
        "width); a model that mixes its samples before a linear layer needs a query_fn with one query per row"
    )


def copy_blocks(
    samples: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, copies: list[Optional[torch.Tensor]]
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """The rows of a forward pass over stacked copies (:func:`~.keys.routed_as_tasks`), copy by copy:
    ``(samples, indices, gates, route)`` of each. The rows of a copy whose route is a prototype all have that query,
    so all select the same ranks (its first row's ``indices`` and ``gates`` are every row's).

    Args:
        samples: (rows, ..., width) the layer input (:func:`per_sample`).
        indices: (rows, K) this pass's selection.
        gates: (rows, K) its gates.
        copies: :attr:`RoutingState.routed_copies`.
    """
    size = samples.shape[0] // len(copies)
    for i, route in enumerate(copies):
        rows = slice(i * size, (i + 1) * size)
        yield samples[rows], indices[rows], gates[rows], route
