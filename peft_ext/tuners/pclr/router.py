"""PCLR routing: one query per sample and forward pass, hard top-K selection per layer group, the query-key loss.

METHODS.md section 3: the query is the L2-normalized mean of the input token embeddings (attention-mask aware), each
rank has a key, the score is ``cos(q, k_i)``, the top-K ranks get a hard gate of 1, and the keys learn only through
``1 - cos(q, k)`` over the selected keys. The public code selects once per batch; here every sample has its own
selection, so a mixed batch of tasks routes each sample as if it ran alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "QueryFn",
    "RoutingState",
    "allowed_by_prototype",
    "default_query",
    "find_input_embeddings",
    "query_key_loss",
    "select_top_k",
]

#: ``query_fn(model, args, kwargs) -> (batch, query_dim)`` or ``None`` (no query for this call).
QueryFn = Callable[[nn.Module, tuple, dict[str, Any]], Optional[torch.Tensor]]


def find_input_embeddings(model: nn.Module) -> Optional[nn.Embedding]:
    """The model's input token embedding: ``get_input_embeddings()`` of the model or of its first submodule that
    has one (wrappers such as ``SentenceClassifier`` hold a transformers encoder); ``None`` if there is none."""
    for module in model.modules():
        getter = getattr(module, "get_input_embeddings", None)
        if callable(getter):
            try:
                embedding = getter()
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(embedding, nn.Embedding):
                return embedding
    return None


def default_query(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Optional[torch.Tensor]:
    """The public code's query: the L2-normalized masked mean of the input token embeddings, shape (batch, d).

    Uses ``inputs_embeds`` if given, else embeds ``input_ids`` (keyword or first positional argument) with the
    model's input embedding. A model without token inputs (e.g. an MLP on features) gets the normalized mean of its
    first floating-point input over all but the batch dimension's leading axes, i.e. the features themselves. Pass a
    custom ``query_fn`` to :func:`peft_ext.tuners.pclr.set_query_fn` for anything else (e.g. a vision CLS feature).

    Args:
        model: The wrapped (base) model.
        args: Positional arguments of its forward.
        kwargs: Keyword arguments of its forward.
    """
    embeds = kwargs.get("inputs_embeds")
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        ids = args[0]
    if embeds is None and ids is not None:
        embedding = find_input_embeddings(model)
        if embedding is None:
            raise ValueError(
                f"{type(model).__name__} takes input_ids but has no input embedding (get_input_embeddings()); "
                "pass query_fn= to compute PCLR's routing query"
            )
        with torch.no_grad():
            embeds = embedding(ids)
    if embeds is None:
        features = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        if features is None:
            return None
        embeds = features.detach() if features.dim() == 3 else features.detach().reshape(features.shape[0], 1, -1)
    embeds = embeds.detach().float()
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2 and mask.shape == embeds.shape[:2]:
        weights = mask.to(embeds.dtype).unsqueeze(-1)
        mean = (embeds * weights).sum(1) / weights.sum(1).clamp_min(1.0)
    else:
        mean = embeds.mean(1)
    return F.normalize(mean, dim=-1)


def allowed_by_prototype(
    query: torch.Tensor, prototypes: torch.Tensor, rank_task: torch.Tensor
) -> Optional[torch.Tensor]:
    """Which ranks each sample may use when no task id is given: ranks of tasks up to the nearest prototype's task.

    METHODS.md: "nearest stored prototype decides whether the newest ranks are used". Generalized to any number of
    tasks: a sample closest to task ``t*``'s prototype may use the ranks of tasks ``0..t*`` (never later tasks' ranks,
    which were trained after and can only interfere), plus the ranks of a task that has no prototype yet (the task
    being learnt: its ranks must be usable while it trains).

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
    if keys.shape[0] == 0:
        raise ValueError("cannot route over an empty rank pool (0 active ranks)")
    with torch.no_grad():
        scores = F.normalize(query.float(), dim=-1) @ F.normalize(keys.detach().float(), dim=-1).mT
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        top, indices = scores.topk(min(k, keys.shape[0]), dim=-1)
        gates = torch.isfinite(top).to(query.dtype)
    return indices, gates


def query_key_loss(
    query: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor
) -> torch.Tensor:
    """``mean over selected (gated) slots of 1 - cos(q_b, k_i)`` (METHODS.md section 3); gradients reach the keys.

    Args:
        query: (batch, d).
        keys: (N, d), possibly trainable.
        indices: (batch, K) selected ranks.
        gates: (batch, K) 0/1 gates.
    """
    cos = F.cosine_similarity(query.detach().unsqueeze(1).to(keys.dtype), keys[indices], dim=-1)
    return ((1.0 - cos) * gates.to(cos.dtype)).sum() / gates.sum().clamp_min(1.0)


class RoutingState:
    """What one forward pass shares between the PCLR layers of a model: the query, selections, query losses.

    The PCLR tuner resets it in a forward pre-hook on the wrapped model (so the query is computed once per forward
    however many layers there are), and the first layer of a group to run computes the group's selection for the
    batch, which the group's other linears reuse.

    Args:
        query_fn: Computes the query from the model's forward arguments (default :func:`default_query`).
    """

    def __init__(self, query_fn: QueryFn = default_query) -> None:
        self.query_fn = query_fn
        self.query: Optional[torch.Tensor] = None
        self.selections: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.losses: list[torch.Tensor] = []
        self.owners: dict[tuple[str, str], nn.Module] = {}
        # Called by every PCLR layer with (layer, adapter, x, A, B, indices, gates) when set (contribution scores).
        self.recorder: Optional[Callable[..., None]] = None

    def begin(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Start a forward pass: compute the query, forget the previous pass's selections and losses."""
        self.selections = {}
        self.losses = []
        self.query = self.query_fn(model, args, kwargs)

    def require_query(self, batch: Optional[int] = None) -> torch.Tensor:
        """The query of this forward pass; ``batch`` (if given) must equal its number of rows."""
        if self.query is None:
            raise ValueError(
                "PCLR layers need a routing query: call the whole model (its forward computes the query), or set "
                "one with peft_ext.tuners.pclr.set_query_fn"
            )
        if batch is not None and self.query.shape[0] != batch:
            raise ValueError(
                f"the routing query has {self.query.shape[0]} rows but the layer input has batch {batch}; PCLR "
                "needs one query per sample"
            )
        return self.query

    def pop_loss(self) -> Optional[torch.Tensor]:
        """Mean query-key loss of the last forward pass over all groups (``None`` if nothing trainable was routed)."""
        if not self.losses:
            return None
        loss = torch.stack(self.losses).mean()
        self.losses = []
        return loss

    def __deepcopy__(self, memo: dict) -> RoutingState:
        # Per-forward tensors are not state; the owners are copied through the memo, so they are the copied layers.
        new = RoutingState(self.query_fn)
        memo[id(self)] = new
        new.owners = {key: copy.deepcopy(layer, memo) for key, layer in self.owners.items()}
        return new
