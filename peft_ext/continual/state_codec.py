"""A method's state as data that ``torch.load(weights_only=True)`` reads back: generators become their state tensor."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["decode_state", "encode_state"]

_GENERATOR_KEY = "__torch_generator_state__"


def encode_state(obj: Any) -> Any:
    """Make a method's state loadable with ``weights_only=True`` (generators become their state tensor)."""
    if isinstance(obj, torch.Generator):
        return {_GENERATOR_KEY: obj.get_state()}
    if isinstance(obj, dict):
        return {k: encode_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(encode_state(v) for v in obj)
    return obj


def decode_state(obj: Any) -> Any:
    """The inverse of :func:`encode_state`."""
    if isinstance(obj, dict):
        if set(obj) == {_GENERATOR_KEY}:
            generator = torch.Generator()
            generator.set_state(obj[_GENERATOR_KEY])
            return generator
        return {k: decode_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(decode_state(v) for v in obj)
    return obj
