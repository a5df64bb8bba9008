"""PCLR's routing state: the query of each forward pass (one per sample and prompt), shared by the layers of a model,
with the selections and query-key losses of the pass (selection itself: :mod:`.selection`).

docs/methods.md (PCLR): the query is the L2-normalized mean of the input token embeddings (attention-mask aware;
other architectures: :mod:`.query`). The paper routes an instruction by its prompt. In generation the model runs
once per new token, so the query of a sequence is computed at its prefill and kept for its decoding steps
(:meth:`RoutingState.begin`; docs/pclr.md, "Routing at inference / generation").
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
from torch import nn

from .query import default_query, pooled_query

__all__ = ["QueryFn", "RoutingState", "forward_arguments"]

#: ``query_fn(model, args, kwargs) -> (batch, query_dim)`` or ``None`` (no query for this call).
QueryFn = Callable[[nn.Module, tuple, dict[str, Any]], Optional[torch.Tensor]]

#: The attribute of a KV cache (a transformers ``Cache``) or of an encoder's output (a ``ModelOutput``) holding the
#: query of its prompt, per routing state.
CACHE_QUERIES_ATTR = "_peft_ext_pclr_queries"


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


def _cache_argument(arguments: Mapping[str, Any]) -> Optional[Any]:
    # transformers >= 5 names the KV cache `cache`, earlier versions `past_key_values`; only Cache objects (with
    # get_seq_length) are tracked, legacy tuple caches are not
    for name in ("cache", "past_key_values"):
        value = arguments.get(name)
        if value is not None and callable(getattr(value, "get_seq_length", None)):
            return value
    return None


def _rows(arguments: dict[str, Any]) -> Optional[int]:
    # the sequences of this forward pass: the (encoder) input's, else the decoder input's (an encoder-decoder's
    # decoding steps pass only decoder inputs and the encoder's output)
    for name in ("input_ids", "inputs_embeds", "decoder_input_ids", "decoder_inputs_embeds"):
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
       state saw, or the output of an encoder pass this state saw (``encoder_outputs``): the query of that prefill
       or encoder input (a hand-written decoding loop, or ``generate`` of the base model);
    3. else (training, a new prompt, an empty cache): ``query_fn`` of this forward's arguments; when it gives none,
       the pooled input of :attr:`query_layer` (a model without token or patch inputs, :mod:`.query`).

    An encoder-decoder's ``generate`` runs its encoder alone first: :meth:`begin_encoder` makes that the first
    forward pass of the session. A kept query is only reused for a forward with the same number of sequences, or, for
    a forward that continues encoder outputs, a multiple of it (``generate`` repeats each encoder output per beam or
    returned sequence, sample by sample; the query is repeated the same way); ``ValueError`` otherwise.

    Args:
        query_fn: Computes the query from the model's forward arguments (default :func:`~.query.default_query`).
    """

    def __init__(self, query_fn: QueryFn = default_query) -> None:
        self.query_fn = query_fn
        self.query: Optional[torch.Tensor] = None
        self.selections: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.losses: list[torch.Tensor] = []
        self.owners: dict[tuple[str, str], nn.Module] = {}
        # Called by every PCLR layer with (layer, adapter, x, A, B, indices, gates) when set (contribution scores).
        self.recorder: Optional[Callable[..., None]] = None
        #: The layer whose pooled input is the query when ``query_fn`` gives none, and its name (:mod:`.query`).
        self.query_layer: Optional[nn.Module] = None
        self.query_layer_name = ""
        #: Per stacked copy of the batch, the prototype that replaces its queries (``None``: its own); see
        #: :func:`~.keys.routed_as_tasks`.
        self.routes: Optional[list[Optional[torch.Tensor]]] = None
        #: The routes this forward pass's query was built with (:attr:`routes` when :meth:`routed` replaced its
        #: rows, else ``None``): every row of a copy with a prototype has that query, so one selection.
        self.routed_copies: Optional[list[Optional[torch.Tensor]]] = None
        # whether a forward pass of the wrapped model is running (an encoder called inside it is part of it)
        self.in_pass = False
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

    def _kept_query(self, arguments: Mapping[str, Any]) -> tuple[Optional[torch.Tensor], str]:
        if self._session is not None and self._session.query is not None:
            return self._session.query, "the first forward pass of this call (its prompt)"
        # An empty cache starts a new prompt (generate resets a reused static cache). get_seq_length is what the
        # model's own forward reads to place the new tokens, so asking it here adds no device synchronization.
        cache = _cache_argument(arguments)
        if cache is not None and cache.get_seq_length() > 0:
            query = (getattr(cache, CACHE_QUERIES_ATTR, None) or {}).get(self._cache_key)
            if query is not None:
                return query, "the prefill of this KV cache (its prompt)"
        encoded = arguments.get("encoder_outputs")
        query = (getattr(encoded, CACHE_QUERIES_ATTR, None) or {}).get(self._cache_key)
        if query is not None:
            return query, "the encoder pass these encoder outputs come from (its prompt)"
        return None, ""

    def remember_cache(self, cache: Any, query: Optional[torch.Tensor]) -> None:
        """Keep ``query`` for the forward passes that continue ``cache`` (a transformers ``Cache``, or an encoder's
        output).

        Args:
            cache: The KV cache object a forward pass filled, or the ``ModelOutput`` an encoder pass returned.
            query: The query of the prompt in it.
        """
        # Kept on the cache itself, so the query lives exactly as long as the cache (and travels with a copy of it),
        # and writing it is an attribute write torch.compile traces; a registry keyed by id() or a weak reference
        # of a cache made inside the compiled forward is not traceable (one graph break per training step).
        kept = dict(getattr(cache, CACHE_QUERIES_ATTR, None) or {})
        kept[self._cache_key] = query
        setattr(cache, CACHE_QUERIES_ATTR, kept)

    def _reused(self, query: torch.Tensor, source: str, arguments: Mapping[str, Any]) -> torch.Tensor:
        rows = _rows(arguments)
        if rows is None or rows == query.shape[0]:
            return query
        if arguments.get("encoder_outputs") is not None and rows % query.shape[0] == 0:
            # generate expands each encoder output per beam / returned sequence with repeat_interleave
            return query.repeat_interleave(rows // query.shape[0], dim=0)
        raise ValueError(
            f"PCLR routes this forward pass by the query of {source}, computed for {query.shape[0]} "
            f"sequences, but the forward passes {rows}; start a new generate call (or a new KV cache) for "
            "a new batch of prompts"
        )

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
        self.routed_copies = None
        arguments = forward_arguments(model, args, kwargs)
        query, source = self._kept_query(arguments)
        if query is not None:
            query = self._reused(query, source, arguments)
        else:
            query = self.query_fn(model, args, arguments)
            if query is not None:
                query = self.routed(query)
                self.routed_copies = self.routes
        self.query = query
        self._remember_in_session(query)
        cache = _cache_argument(arguments)
        if cache is not None:
            self.remember_cache(cache, query)

    def begin_encoder(self, model: nn.Module, encoder: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """An encoder-decoder's encoder is called: outside a forward pass of the wrapped model (``generate`` runs it
        alone first) this starts one, its query computed from the encoder's arguments as from the model's.

        Args:
            model: The wrapped model (what ``query_fn`` is given).
            encoder: Its encoder being called.
            args: The encoder's positional arguments.
            kwargs: Its keyword arguments.
        """
        if not self.in_pass:
            self.begin(model, (), forward_arguments(encoder, args, kwargs))

    def end(self, output: Any) -> None:
        """Finish a forward pass: a KV cache it returns keeps this pass's query for its continuation.

        Args:
            output: The wrapped model's output (a ``ModelOutput`` with ``cache`` / ``past_key_values``, or anything).
        """
        self.in_pass = False
        if isinstance(output, Mapping):  # transformers' ModelOutput is one
            cache = _cache_argument(output)
            if cache is not None:
                self.remember_cache(cache, self.query)

    def end_encoder(self, output: Any) -> None:
        """An encoder-decoder's encoder returned ``output``: it keeps this pass's query for the decoding steps that
        continue it (``encoder_outputs=``), as a KV cache does.

        Args:
            output: The encoder's output (a ``ModelOutput``; a tuple keeps nothing).
        """
        if isinstance(output, Mapping) and self.query is not None:
            self.remember_cache(output, self.query)

    def _remember_in_session(self, query: Optional[torch.Tensor]) -> None:
        if self._session is not None and self._session.query is None:
            self._session.query = query

    def routed(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` with the rows of each stacked copy replaced by its route's prototype (:attr:`routes`), if set.

        Args:
            query: (batch, d) the queries a forward pass computed.
        """
        if self.routes is None:
            return query
        protos = self.routes
        if query.shape[0] % len(protos):
            raise ValueError(f"a batch of {query.shape[0]} rows is not {len(protos)} stacked copies (stack_batch)")
        for proto in protos:
            if proto is not None and query.shape[-1] != proto.numel():
                raise ValueError(f"`prototype` has {proto.numel()} entries but the query has width {query.shape[-1]}")
        copies = query.split(query.shape[0] // len(protos))
        return torch.cat([q if p is None else p.to(q).expand_as(q) for q, p in zip(copies, protos)])

    def take_layer_query(self, layer: nn.Module, x: torch.Tensor) -> None:
        """Forward pre-hook of :attr:`query_layer`: its pooled input becomes the query of a forward pass that has
        none (:func:`~.query.pooled_query`).

        Args:
            layer: The layer about to run.
            x: Its input.
        """
        if self.query is None and layer is self.query_layer and isinstance(x, torch.Tensor):
            self.query = self.routed(pooled_query(x))
            self.routed_copies = self.routes
            self._remember_in_session(self.query)

    def require_query(self) -> torch.Tensor:
        """The query of this forward pass."""
        if self.query is None:
            hint = ""
            if self.query_layer is not None:
                hint = (
                    f" (this model has no token or patch inputs: the input of its first adapted layer "
                    f"{self.query_layer_name!r} is the query, but another PCLR layer ran before it)"
                )
            raise ValueError(
                f"PCLR layers need a routing query{hint}: call the whole model (its forward computes the query), or "
                "set one with model.base_model.set_query_fn"
            )
        return self.query

    def attach(self, model: nn.Module, encoder: Optional[nn.Module] = None) -> None:
        """Register the hooks that drive this state on the wrapped model: :meth:`begin` / :meth:`end` around each
        forward pass and, for an encoder-decoder, :meth:`begin_encoder` / :meth:`end_encoder` around its encoder.

        Args:
            model: The wrapped model.
            encoder: Its encoder (``get_encoder()``) when it is an encoder-decoder, else ``None``.
        """
        model.register_forward_pre_hook(QueryHook(self), with_kwargs=True)
        model.register_forward_hook(CacheHook(self), always_call=True)
        if encoder is not None:
            encoder.register_forward_pre_hook(EncoderQueryHook(self, model), with_kwargs=True)
            encoder.register_forward_hook(EncoderOutputHook(self))

    def attach_query_layer(self, layer: nn.Module, name: str) -> None:
        """Make ``layer``'s pooled input the query of a forward pass that has none (:meth:`take_layer_query`).

        Args:
            layer: The first adapted layer of a model without token or patch inputs.
            name: Its name in the model, for errors.
        """
        self.query_layer, self.query_layer_name = layer, name
        layer.register_forward_pre_hook(LayerQueryHook(self), with_kwargs=True)

    def pop_loss(self) -> Optional[torch.Tensor]:
        """Mean query-key loss of the last forward pass over all groups (``None`` if nothing trainable was routed)."""
        if not self.losses:
            return None
        loss = torch.stack(self.losses).mean()
        self.losses = []
        return loss

    def __deepcopy__(self, memo: dict) -> RoutingState:
        # Per-forward tensors are not state; the owners and the query layer are copied through the memo, so they are
        # the copied layers.
        new = RoutingState(self.query_fn)
        memo[id(self)] = new
        new.owners = {key: copy.deepcopy(layer, memo) for key, layer in self.owners.items()}
        new.query_layer = copy.deepcopy(self.query_layer, memo)
        new.query_layer_name = self.query_layer_name
        return new


# --- the forward hooks that drive a routing state (registered by ``RoutingState.attach`` and
# ``RoutingState.attach_query_layer``): small objects rather than closures, so that ``copy.deepcopy`` of the model
# re-points them at the copied state.


class QueryHook:
    """Forward pre-hook on the wrapped model: chooses the routing query once per forward pass."""

    def __init__(self, state: RoutingState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.state.begin(module, args, kwargs)
        self.state.in_pass = True


class CacheHook:
    """Forward hook on the wrapped model (always called, also when the forward raises): the pass is over, and a KV
    cache it returns keeps its query (hand-written decoding)."""

    def __init__(self, state: RoutingState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.state.end(output)


class EncoderQueryHook:
    """Forward pre-hook on an encoder-decoder's encoder: ``generate`` runs it alone before the decoding steps, and
    that call starts the prompt's routing (:meth:`RoutingState.begin_encoder`)."""

    def __init__(self, state: RoutingState, model: nn.Module) -> None:
        self.state = state
        self.model = model

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.state.begin_encoder(self.model, module, args, kwargs)


class EncoderOutputHook:
    """Forward hook on an encoder-decoder's encoder: its output keeps the query for the decoding steps."""

    def __init__(self, state: RoutingState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.state.end_encoder(output)


class LayerQueryHook:
    """Forward pre-hook on the first adapted layer of a model without token or patch inputs: its pooled input is
    the query of a forward pass whose query function gave none (:mod:`.query`)."""

    def __init__(self, state: RoutingState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        x = args[0] if args else kwargs.get("x", kwargs.get("input"))
        self.state.take_layer_query(module, x)
