"""One accumulator of the task in progress's statistics per distinct input: modules fed the very same tensor (a Llama
block's ``q_proj`` / ``k_proj`` / ``v_proj``, its ``gate_proj`` / ``up_proj``) hold one accumulator between them.

Without it every such module kept (and, sharded under FSDP2, exchanged and shrank) its own copy of identical
statistics: three sketches of one hidden state per attention block, each with its own eigensolves and collectives.
Now the statistics hooks (:mod:`.collection`) report each module's input to :class:`SharedInputs`, which groups
consecutive modules fed the same tensor under the same token mask and applies the group's rows once per distinct
accumulator (:func:`.statistics.add_rows`) when the group closes: when a module reads another tensor, a forward pass
begins, or the ``collect_statistics`` block ends.

Sharing never changes a module's statistics (a sketch's bits; a dense sum's to the rounding of one addition).
Modules without statistics yet join the accumulator created for their group, so they start equal and stay equal while
they keep reading the same tensors; a module that holds a shared accumulator but does not read its group's input (a
model whose modules read the same tensor in one pass and different ones in another) gets its own copy of the
accumulator's state before the group's rows are added: copy on divergence. Sharded, the decisions are made from the
model's code path (which modules read which tensor), the same on every process, so every process runs the same
collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional

import torch

from .layer import SplitLoRALayer
from .statistics import add_rows

__all__ = ["SharedInputs", "distinct_accumulators"]

Accumulator = dict[str, torch.Tensor]


def distinct_accumulators(layers: Iterable[SplitLoRALayer], adapter_name: str) -> list[Accumulator]:
    """The accumulators of the task in progress's statistics that ``layers`` hold, each once (modules fed the same
    input hold one between them), in the order of the first layer holding each."""
    found: dict[int, Accumulator] = {}
    for layer in layers:
        pending = layer._splitlora_pending.get(adapter_name)
        if pending is not None:
            found.setdefault(id(pending), pending)
    return list(found.values())


class _Group:
    """Consecutive modules fed one input: the input, its token rows, and the accumulators to add them to."""

    def __init__(self, x: torch.Tensor, mask: Optional[torch.Tensor], rows: torch.Tensor, signature: tuple) -> None:
        # the references keep x and the mask alive, so `is` cannot match a new tensor at a freed one's address
        self.x, self.mask, self.rows, self.signature = x, mask, rows, signature
        self.accumulators: list[Accumulator] = []
        self.readers: dict[int, SplitLoRALayer] = {}  # id -> module, the modules that read x in this group
        self.fresh: Optional[Accumulator] = None  # created by this group for modules without statistics yet

    def matches(self, module: SplitLoRALayer, x: torch.Tensor, mask: Optional[torch.Tensor], signature: tuple) -> bool:
        # a module that reads x twice in a row counts it twice: a new group
        return x is self.x and mask is self.mask and signature == self.signature and id(module) not in self.readers


class SharedInputs:
    """The accumulators of one ``collect_statistics`` block's modules, shared between modules fed the same input.

    Args:
        layers: The modules whose statistics are collected.
        adapter_name: The adapter.
    """

    def __init__(self, layers: Iterable[SplitLoRALayer], adapter_name: str) -> None:
        self.adapter_name = adapter_name
        # accumulator id -> (accumulator, the modules holding it); the reference keeps the id from being reused.
        # Accumulators shared in an earlier block (a task collected over several blocks) are found by identity.
        self._holders: dict[int, tuple[Accumulator, list[SplitLoRALayer]]] = {}
        for layer in layers:
            pending = layer._splitlora_pending.get(adapter_name)
            if pending is not None:
                self._holders.setdefault(id(pending), (pending, []))[1].append(layer)
        self._open: Optional[_Group] = None
        #: Accumulator updates applied (one per distinct input and accumulator), for tests and benchmarks.
        self.updates = 0

    def report(
        self,
        module: SplitLoRALayer,
        x: torch.Tensor,
        mask: Optional[torch.Tensor],
        rows_of: Callable[[], torch.Tensor],
    ) -> None:
        """``module`` reads ``x`` (token mask ``mask``) in the forward pass in progress.

        Args:
            module: The module.
            x: Its input tensor.
            mask: The token mask that applies to ``x`` (``None``: every position).
            rows_of: Computes ``x``'s token rows; called once per group.
        """
        name = self.adapter_name
        signature = module.statistics_signature(name)
        group = self._open
        if group is None or not group.matches(module, x, mask, signature):
            self.flush()
            group = self._open = _Group(x, mask, rows_of(), signature)
        group.readers[id(module)] = module
        pending = module._splitlora_pending.get(name)
        if pending is None:
            if group.fresh is None:
                group.fresh = module.pending_statistics(name)
                group.accumulators.append(group.fresh)
                self._holders[id(group.fresh)] = (group.fresh, [module])
            else:  # empty like the group's fresh one, which nothing was added to yet: the same from now on
                module._splitlora_pending[name] = group.fresh
                holders = self._holders[id(group.fresh)][1]
                holders.append(module)
                for holder in holders:
                    holder._splitlora_shared.add(name)
        elif not any(pending is other for other in group.accumulators):
            group.accumulators.append(pending)
            self._holders.setdefault(id(pending), (pending, [module]))

    def flush(self) -> None:
        """Close the open group: add its rows to its accumulators, after giving the modules that hold one of them but
        did not read the group's input their own copy. Sharded, a collective (every process flushes alike)."""
        group, self._open = self._open, None
        if group is None:
            return
        name = self.adapter_name
        for pending in group.accumulators:
            _, holders = self._holders[id(pending)]
            # a module whose accumulator was replaced meanwhile (a direct accumulate_statistics call) holds it no more
            holders = [m for m in holders if m._splitlora_pending.get(name) is pending]
            absent = [m for m in holders if id(m) not in group.readers]
            if absent:
                copy = {key: value.clone() for key, value in pending.items()}
                for module in absent:
                    module._splitlora_pending[name] = copy
                self._holders[id(copy)] = (copy, absent)
                holders = [m for m in holders if id(m) in group.readers]
            self._holders[id(pending)] = (pending, holders)
        first = next(iter(group.readers.values()))
        shards = first.statistics_shards(name)
        add_rows(group.accumulators, group.rows, first.in_features, first._adapter_dtype(), shards)
        self.updates += len(group.accumulators)

    def discard(self) -> None:
        """Drop the open group unapplied (a forward pass that raised: its statistics are partial either way)."""
        self._open = None
