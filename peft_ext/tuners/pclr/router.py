"""PCLR routing: one query per sample and prompt, hard top-K selection per layer group, the query-key loss.

METHODS.md section 3: the query is the L2-normalized mean of the input token embeddings (attention-mask aware), each
rank has a key, the score is ``cos(q, k_i)``, the top-K ranks get a hard gate of 1, and the keys learn only through
``1 - cos(q, k)`` over the selected keys. The public code selects once per batch; here every sample has its own
selection, so a mixed batch of tasks routes each sample as if it ran alone.

The paper routes an instruction by its prompt. In generation the model runs once per new token, so the query of a
sequence is computed at its prefill and kept for its decoding steps (:meth:`RoutingState.begin`; docs/pclr.md,
"Routing at inference / generation").
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
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
    "forward_arguments",
    "query_key_loss",
    "select_top_k",
]

#: ``query_fn(model, args, kwargs) -> (batch, query_dim)`` or ``None`` (no query for this call).
QueryFn = Callable[[nn.Module, tuple, dict[str, Any]], Optional[torch.Tensor]]

#: The attribute of a KV cache (a transformers ``Cache``) holding the query of its prefill, per routing state.
CACHE_QUERIES_ATTR = "_peft_ext_pclr_queries"


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


@functools.lru_cache(maxsize=64)
def _function_signature(function: Callable[..., Any]) -> Optional[inspect.Signature]:
    # keyed by the class's forward function (never by a bound method, which would keep its model alive)
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def forward_arguments(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of a call ``model(*args, **kwargs)`` by name: positional arguments are bound to the parameter
    names of ``model.forward`` (``inspect.signature(...).bind_partial``), a ``**kwargs`` parameter is flattened, extra
    positional arguments (``*args``) have no name and are left out.

    Falls back to ``kwargs`` alone when the call does not fit the signature (the forward will raise its own error).

    Args:
        model: The called module.
        args: Positional arguments of the call.
        kwargs: Keyword arguments of the call.
    """
    if not args:
        return dict(kwargs)
    forward = model.forward
    function = getattr(forward, "__func__", None)
    if function is not None and getattr(forward, "__self__", None) is model:
        signature, call_args = _function_signature(function), (model, *args)
    else:  # an instance-level forward (e.g. accelerate's hooks): not cached, it may hold its module
        signature, call_args = _function_signature.__wrapped__(forward), args
    if signature is None:
        return dict(kwargs)
    try:
        bound = signature.bind_partial(*call_args, **kwargs)
    except TypeError:
        return dict(kwargs)
    named: dict[str, Any] = {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL and not (i == 0 and call_args[0] is model):
            named[name] = value
    return named


def default_query(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Optional[torch.Tensor]:
    """The public code's query: the L2-normalized masked mean of the input token embeddings, shape (batch, d).

    Reads the arguments by name (the routing state binds positional arguments to the forward's parameter names, see
    :func:`forward_arguments`): ``inputs_embeds`` if given, else ``input_ids`` embedded with the model's input
    embedding (an integer tensor passed first positionally counts as ``input_ids`` too), averaged over the tokens
    that ``attention_mask`` marks (left or right padding alike). A model without token inputs (e.g. an MLP on
    features) gets the normalized mean of its first floating-point argument (in the forward's parameter order; 3-D
    inputs are averaged over their middle axis, others flattened per sample). Pass a custom ``query_fn`` to
    :meth:`PCLRModel.set_query_fn` for anything else (e.g. a vision CLS feature).

    Args:
        model: The wrapped (base) model.
        args: Positional arguments of its forward, as passed.
        kwargs: Every argument of its forward by name.
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
        candidates = [v for name, v in kwargs.items() if name != "attention_mask"] + list(args)
        features = next((v for v in candidates if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
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


def _cache_argument(arguments: Mapping[str, Any]) -> Optional[Any]:
    # transformers >= 5 names the KV cache `cache`, earlier versions `past_key_values`; only Cache objects (with
    # get_seq_length) are tracked, legacy tuple caches are not
    for name in ("cache", "past_key_values"):
        value = arguments.get(name)
        if value is not None and callable(getattr(value, "get_seq_length", None)):
            return value
    return None


def _rows(arguments: dict[str, Any]) -> Optional[int]:
    for name in ("input_ids", "inputs_embeds"):
        if isinstance(arguments.get(name), torch.Tensor):
            return arguments[name].shape[0]
    return None


_STATE_KEYS = itertools.count()


class _Session:
    """One prompt's routing: the query of the first forward pass inside :meth:`RoutingState.session`."""

    def __init__(self) -> None:
        self.query: Optional[torch.Tensor] = None


class RoutingState:
    """What the PCLR layers of a model share: the query of the current forward, selections, query losses.

    The PCLR tuner calls :meth:`begin` in a forward pre-hook on the wrapped model (so the query is computed once per
    forward however many layers there are), and the first layer of a group to run computes the group's selection for
    the batch, which the group's other linears reuse.

    Which query a forward routes by (docs/pclr.md, "Routing at inference / generation"):

    1. inside a :meth:`session` whose first forward already ran: that forward's query. ``PeftModel.forward`` and
       ``PeftModel.generate`` each run in a session, so every step of one ``generate`` call routes by the prompt
       (its first forward), with or without the KV cache;
    2. else, a forward that continues a non-empty KV cache (``cache`` / ``past_key_values``) whose prefill this
       state saw: the query of that prefill (a hand-written decoding loop, or ``generate`` of the base model);
    3. else (training, a new prompt, an empty cache): ``query_fn`` of this forward's arguments.

    A kept query is only reused for a forward with the same number of sequences (``ValueError`` otherwise).

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
        self._session: Optional[_Session] = None
        # this state's entry in the queries a KV cache carries (see remember_cache); a copied state is a new one
        self._cache_key = next(_STATE_KEYS)

    @contextmanager
    def session(self) -> Iterator[None]:
        """Route every forward pass inside the block by the query of its first one (one prompt's generation).

        ``PeftModel.forward`` and ``PeftModel.generate`` open one per call; open it yourself around a decoding loop
        that calls the base model without a KV cache. A session inside a session joins the outer one.
        """
        if self._session is not None:
            yield
            return
        self._session = _Session()
        try:
            yield
        finally:
            self._session = None

    def _kept_query(self, cache: Optional[Any]) -> tuple[Optional[torch.Tensor], str]:
        if self._session is not None and self._session.query is not None:
            return self._session.query, "the first forward pass of this call (its prompt)"
        # An empty cache starts a new prompt (generate resets a reused static cache). get_seq_length is what the
        # model's own forward reads to place the new tokens, so asking it here adds no device synchronization.
        if cache is not None and cache.get_seq_length() > 0:
            query = (getattr(cache, CACHE_QUERIES_ATTR, None) or {}).get(self._cache_key)
            if query is not None:
                return query, "the prefill of this KV cache (its prompt)"
        return None, ""

    def remember_cache(self, cache: Any, query: Optional[torch.Tensor]) -> None:
        """Keep ``query`` for the forward passes that continue ``cache`` (a transformers ``Cache``).

        Args:
            cache: The KV cache object a forward pass filled.
            query: The query of the prompt in it.
        """
        # Kept on the cache itself, so the query lives exactly as long as the cache (and travels with a copy of it),
        # and writing it is an attribute write torch.compile traces; a registry keyed by id() or a weak reference
        # of a cache made inside the compiled forward is not traceable (one graph break per training step).
        kept = dict(getattr(cache, CACHE_QUERIES_ATTR, None) or {})
        kept[self._cache_key] = query
        setattr(cache, CACHE_QUERIES_ATTR, kept)

    def begin(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Start a forward pass: choose its query (see the class docstring), forget the previous pass's selections
        and losses.

        Args:
            model: The wrapped model being called.
            args: Its positional arguments.
            kwargs: Its keyword arguments.
        """
        self.selections = {}
        self.losses = []
        arguments = forward_arguments(model, args, kwargs)
        cache = _cache_argument(arguments)
        query, source = self._kept_query(cache)
        if query is not None:
            rows = _rows(arguments)
            if rows is not None and rows != query.shape[0]:
                raise ValueError(
                    f"PCLR routes this forward pass by the query of {source}, computed for {query.shape[0]} "
                    f"sequences, but the forward passes {rows}; start a new generate call (or a new KV cache) for "
                    "a new batch of prompts"
                )
        else:
            query = self.query_fn(model, args, arguments)
        if self._session is not None and self._session.query is None:
            self._session.query = query
        if cache is not None:
            self.remember_cache(cache, query)
        self.query = query

    def end(self, output: Any) -> None:
        """Finish a forward pass: a KV cache it returns keeps this pass's query for its continuation.

        Args:
            output: The wrapped model's output (a ``ModelOutput`` with ``cache`` / ``past_key_values``, or anything).
        """
        if isinstance(output, Mapping):  # transformers' ModelOutput is one
            cache = _cache_argument(output)
            if cache is not None:
                self.remember_cache(cache, self.query)

    def require_query(self, batch: Optional[int] = None) -> torch.Tensor:
        """The query of this forward pass; ``batch`` (if given) must equal its number of rows."""
        if self.query is None:
            raise ValueError(
                "PCLR layers need a routing query: call the whole model (its forward computes the query), or set "
                "one with model.base_model.set_query_fn"
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
