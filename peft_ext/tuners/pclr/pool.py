"""Model-level bookkeeping of PCLR's rank pool: the layer groups, what the pool holds, folding, snapshots.

A PCLR model's linears form layer groups (one per block, ``PCLRConfig.group_pattern``); the first layer of a group to
get an adapter (the group's *owner*) holds the group's keys and prototypes. The functions here walk the groups; every
write into a layer's stores goes through the pool methods of :class:`~.layer.PCLRLayer`, which keep the pool's rules.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from peft import PeftModel
from torch import nn

from .config import PCLRConfig
from .layer import PCLRLayer
from .router import RoutingState

__all__ = [
    "PoolSnapshot",
    "adapter_config",
    "fold_new_ranks",
    "group_layers",
    "pclr_tuner",
    "pool_in_use",
    "stored_adapter_parameters",
    "stored_prototypes",
]


def pclr_tuner(model: nn.Module) -> Any:
    """The PCLR tuner (``PCLRModel``) of ``model``: a ``PeftModel`` with PCLR adapters or the tuner itself.

    Args:
        model: A PeftModel with PCLR adapters, or its PCLRModel.

    Raises:
        TypeError: If ``model`` carries no PCLR routing state.
    """
    tuner = model.base_model if isinstance(model, PeftModel) else model
    # the PCLR tuner is the model whose layers share a RoutingState (checked structurally: this module sits below
    # model.py, which builds on it)
    if not isinstance(getattr(tuner, "routing_state", None), RoutingState):
        raise TypeError(f"expected a PeftModel with a PCLR adapter (or a PCLRModel), got {type(model).__name__}")
    return tuner


def adapter_config(model: nn.Module, adapter: str) -> PCLRConfig:
    """The :class:`~.config.PCLRConfig` of ``adapter`` on ``model``.

    Args:
        model: A PeftModel with PCLR adapters, or its PCLRModel.
        adapter: The adapter.
    """
    tuner = pclr_tuner(model)
    if adapter not in tuner.peft_config:
        raise ValueError(f"unknown PCLR adapter {adapter!r}; the model has {sorted(tuner.peft_config)}")
    return tuner.peft_config[adapter]


def group_layers(model: nn.Module, adapter: str = "default") -> dict[str, list[PCLRLayer]]:
    """The PCLR layers carrying ``adapter``, by layer group, each group's owner (keys, prototypes) first.

    Args:
        model: A PeftModel with PCLR adapters (or its PCLRModel).
        adapter: The adapter.
    """
    groups: dict[str, list[PCLRLayer]] = {}
    for module in pclr_tuner(model).modules():
        if isinstance(module, PCLRLayer) and adapter in module.pclr_A:
            groups.setdefault(module.pclr_group, []).append(module)
    for layers in groups.values():
        layers.sort(key=lambda layer: not layer.owns_keys(adapter))
    return groups


def pool_in_use(model: nn.Module, adapter: str = "default") -> int:
    """The largest number of active ranks (static + new) of any layer: never more than ``pool_size``."""
    return max(sum(layer.counts(adapter)[:2]) for layers in group_layers(model, adapter).values() for layer in layers)


def stored_adapter_parameters(model: nn.Module, adapter: str = "default") -> int:
    """Adapter values in use: active ranks ``(in + out)`` per linear, the shared LoRA, active keys and prototypes.

    Bounded by the pool cap however many tasks come (per-task LoRA grows by ``r (in + out)`` per linear and task).
    The buffers are allocated at capacity; this counts what the pool holds, not the allocation.
    """
    total = 0
    for layers in group_layers(model, adapter).values():
        for i, layer in enumerate(layers):
            n_s, n_n, n_protos, _ = layer.counts(adapter)
            total += (n_s + n_n) * (layer.in_features + layer.out_features)
            if adapter in layer.pclr_shared_A:
                total += layer.pclr_shared_A[adapter].numel() + layer.pclr_shared_B[adapter].numel()
            if i == 0:
                total += (n_s + n_n + n_protos) * layer.pclr_keys[adapter].shape[1]
    return total


def stored_prototypes(model: nn.Module, adapter: str = "default") -> torch.Tensor:
    """The stored task prototypes (T x query_dim) of ``adapter`` (row ``t``: task ``t``)."""
    return next(iter(group_layers(model, adapter).values()))[0].prototypes(adapter).detach().clone()


def fold_new_ranks(model: nn.Module, adapter: str = "default") -> None:
    """Freeze the task's ranks: every layer moves its new ranks (and keys) behind its static ones.

    Args:
        model: The PCLR model.
        adapter: The adapter.
    """
    for layers in group_layers(model, adapter).values():
        for layer in layers:
            layer.fold_new_ranks(adapter)


class PoolSnapshot:
    """A copy of every PCLR tensor of one adapter (ranks, keys, task tags, counts, prototypes, shared LoRA).

    :meth:`active` swaps the copy in for the duration of a ``with`` block and restores the current tensors after it:
    the uncompressed pool can serve as the distillation teacher without a second copy of the model (the pool is a
    few MB, the model may be GBs). The snapshot's tensors have the same shapes as the live ones (capacities are
    fixed), so the swap is an in-place copy.

    Args:
        model: The PCLR model.
        adapter: The adapter.
    """

    def __init__(self, model: nn.Module, adapter: str = "default") -> None:
        self.adapter = adapter
        self.layers = [layer for layers in group_layers(model, adapter).values() for layer in layers]
        self.saved = [[t.detach().clone() for t in layer.pool_tensors(adapter)] for layer in self.layers]

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the ``with`` block on the snapshot's pool (no gradients should flow through it)."""
        with torch.no_grad():
            current = [[t.detach().clone() for t in layer.pool_tensors(self.adapter)] for layer in self.layers]
            for layer, saved in zip(self.layers, self.saved):
                layer.load_pool_tensors(self.adapter, saved)
        try:
            yield
        finally:
            for layer, values in zip(self.layers, current):
                layer.load_pool_tensors(self.adapter, values)
