"""The forward hooks that drive a PCLR routing state (registered by ``RoutingState.attach`` and
``RoutingState.attach_query_layer``).

Small objects rather than closures so that ``copy.deepcopy`` of the model re-points them at the copied state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from .router import RoutingState

__all__ = ["CacheHook", "EncoderOutputHook", "EncoderQueryHook", "LayerQueryHook", "QueryHook"]


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
