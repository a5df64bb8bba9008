"""The process count and rank, and the DTensor type check every other part of :mod:`peft_ext.distributed` uses."""

from __future__ import annotations

import functools
import importlib

import torch.distributed as dist


def world_size() -> int:
    """The number of data-parallel processes: 1 when ``torch.distributed`` is not initialized."""
    # not PartialState().num_processes: that reads the launcher's environment, not the process group in use
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def rank() -> int:
    """This process's rank: 0 when ``torch.distributed`` is not initialized."""
    return dist.get_rank() if world_size() > 1 else 0


@functools.cache
def optional_type(module: str, name: str) -> type | tuple:
    """The class ``module.name``, or ``()`` (which ``isinstance`` matches nothing with) when torch is built without
    distributed support."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return ()


# Resolved once, at import: is_dtensor runs inside adapter forwards (PCLR reads its stores through full_tensor), where
# torch.compile cannot trace an import (importlib is skipped by dynamo: one graph break per call). Importing torch
# (through peft) has loaded torch.distributed.tensor already where it exists, so this costs nothing.
_DTENSOR = optional_type("torch.distributed.tensor", "DTensor")


def is_dtensor(t: object) -> bool:
    """Whether ``t`` (a tensor or parameter) is a DTensor, e.g. an FSDP2 shard outside the forward. Always ``False``
    when torch is built without distributed support. Traceable by ``torch.compile`` (no lookup at call time)."""
    return isinstance(t, _DTENSOR) or isinstance(getattr(t, "data", None), _DTENSOR)
