"""The rank-pool stores of a PCLR layer and the only code that writes into them (mixed into ``PCLRLayer``).

Per adapter a layer stores its ranks twice over: ``pclr_A_static`` / ``pclr_B_static`` (``pool_size`` rows, buffers)
and ``pclr_A`` / ``pclr_B`` (``new_capacity`` rows, parameters); the group owner also ``pclr_keys_static`` /
``pclr_keys`` and ``pclr_prototypes``; every layer ``pclr_rank_task`` (the task of each slot) and the counts. The
methods here keep the pool's rules: static plus new ranks never exceed ``pool_size``, new ranks never exceed
``new_capacity``, active ranks are the leading rows of each store (static first in pool order), keys and prototypes
live on the group owner only, and the host-side counts (``pclr_host_counts``, python ints, what every forward reads)
equal the ``pclr_counts`` buffers (what checkpoints save; read back into the host copy on load).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from peft.tuners._buffer_dict import BufferDict
from torch import nn

from ...distributed import full_tensor, write_full_
from ...kernels import pool_of_stores

__all__ = ["N_NEW", "N_PROTOS", "N_STATIC", "TASK", "RankPoolStore"]

# Slots of pclr_counts.
N_STATIC, N_NEW, N_PROTOS, TASK = 0, 1, 2, 3
_COUNT_SLOTS = {"static": N_STATIC, "new": N_NEW, "protos": N_PROTOS, "task": TASK}


@torch.no_grad()
def write_rows_(store: torch.Tensor, rows: torch.Tensor) -> None:
    """``store[:len(rows)] = rows`` (cast to the store's dtype); for an FSDP2 (DTensor) store each process writes the
    part of ``rows`` that falls in its own shard."""
    whole = full_tensor(store)
    whole[: rows.shape[0]] = rows.to(whole.dtype)
    write_full_(store, whole)


def leading_rows(store: torch.Tensor, n: int) -> torch.Tensor:
    """``store[:n]``, or ``store`` itself when it has ``n`` rows: a full store's slice would put a slice node in every
    forward's graph, whose backward writes the gradient into a zero tensor of the store's size."""
    return store if store.shape[0] == n else store[:n]


class RankPoolStore:
    """The pool API of :class:`~.layer.PCLRLayer`: views of the active ranks and every write into the stores.

    A mixin: the stores themselves (and ``group_owner``) are created by ``PCLRLayer``.
    """

    pclr_host_counts: dict[str, list[int]]
    pclr_counts: Any

    def counts(self, adapter_name: str) -> list[int]:
        """``[static ranks, new ranks, stored prototypes, current task]`` of the adapter (host-side, no sync)."""
        return list(self.pclr_host_counts[adapter_name])

    def _set_counts(self, adapter_name: str, **values: int) -> None:
        counts = self.pclr_host_counts[adapter_name]
        for slot, value in values.items():
            counts[_COUNT_SLOTS[slot]] = int(value)
        # the buffer is what checkpoints save; the host copy is what every forward reads
        self.pclr_counts[adapter_name].copy_(torch.tensor(counts, dtype=torch.long))

    def restore_counts(self) -> None:
        """Re-read the host-side counts from the ``pclr_counts`` buffers (after they were loaded or replaced)."""
        for name, buffer in self.pclr_counts.items():
            self.pclr_host_counts[name] = [int(v) for v in buffer.tolist()]

    def _pairs(self, adapter_name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(static store, new store)`` of the ranks, and of the keys on the group owner."""
        pairs = [
            (self.pclr_A_static[adapter_name], self.pclr_A[adapter_name]),
            (self.pclr_B_static[adapter_name], self.pclr_B[adapter_name]),
        ]
        if adapter_name in self.pclr_keys:
            pairs.append((self.pclr_keys_static[adapter_name], self.pclr_keys[adapter_name]))
        return pairs

    def active_rank_task(self, adapter_name: str) -> torch.Tensor:
        """Task of each active rank, in pool order (static, then new)."""
        n_s, n_n = self.counts(adapter_name)[:2]
        tags = self.pclr_rank_task[adapter_name]
        cap = self.pclr_A_static[adapter_name].shape[0]
        return torch.cat([tags[:n_s], tags[cap : cap + n_n]])

    def static_ranks(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(A, B)`` of the active static ranks: (N_s x in) and (N_s x out), no copy."""
        n_s = self.pclr_host_counts[adapter_name][N_STATIC]
        return leading_rows(self.pclr_A_static[adapter_name], n_s), leading_rows(self.pclr_B_static[adapter_name], n_s)

    def new_ranks(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(A, B)`` of the active new (trainable) ranks: (N_n x in) and (N_n x out), no copy (a gathered copy
        for FSDP2 DTensor stores, between forward passes)."""
        n_n = self.pclr_host_counts[adapter_name][N_NEW]
        # outside the forward an FSDP2 store is a DTensor shard: the whole store then (a copy, not a view)
        return leading_rows(full_tensor(self.pclr_A[adapter_name]), n_n), leading_rows(
            full_tensor(self.pclr_B[adapter_name]), n_n
        )

    def pool(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The active ranks ``(A, B)``: (N x in) and (N x out), static rows first; gradients reach the new ones.
        Read-only: a view of one store when the other holds no rank, else the two concatenated (a copy)."""
        return pool_of_stores(self.static_ranks(adapter_name), self.new_ranks(adapter_name))

    def keys(self, adapter_name: str) -> torch.Tensor:
        """The active keys (N x d) of this layer's group, static first."""
        owner = self.group_owner(adapter_name)
        n_s, n_n = owner.counts(adapter_name)[:2]
        return torch.cat(
            [
                leading_rows(owner.pclr_keys_static[adapter_name], n_s),
                leading_rows(full_tensor(owner.pclr_keys[adapter_name]), n_n),
            ]
        )

    def static_keys(self, adapter_name: str) -> torch.Tensor:
        """A view of the group's active static keys (N_s x d), no copy."""
        owner = self.group_owner(adapter_name)
        return owner.pclr_keys_static[adapter_name][: owner.pclr_host_counts[adapter_name][N_STATIC]]

    def prototypes(self, adapter_name: str) -> torch.Tensor:
        """The stored task prototypes (T x d), row ``t`` for task ``t``."""
        owner = self.group_owner(adapter_name)
        return owner.pclr_prototypes[adapter_name][: owner.counts(adapter_name)[N_PROTOS]]

    @torch.no_grad()
    def begin_new_ranks(
        self, adapter_name: str, task_id: int, A: torch.Tensor, keys: Optional[torch.Tensor] = None
    ) -> None:
        """Replace the new ranks by ``len(A)`` ranks of task ``task_id``: ``a_i`` from ``A``, ``b_i = 0``.

        Args:
            adapter_name: The adapter.
            task_id: The task the ranks belong to.
            A: (count x in) their ``a_i``.
            keys: (count x d) their keys; required on the group owner, refused elsewhere.
        """
        count = A.shape[0]
        n_s = self.pclr_host_counts[adapter_name][N_STATIC]
        new_cap, cap = self.pclr_A[adapter_name].shape[0], self.pclr_A_static[adapter_name].shape[0]
        if count > new_cap or n_s + count > cap:
            raise ValueError(
                f"{count} new ranks do not fit: new capacity {new_cap}, {n_s} static of pool_size={cap}; compress "
                "the static pool first"
            )
        owner = adapter_name in self.pclr_keys
        if owner != (keys is not None):
            raise ValueError(
                "the group owner takes the new ranks' keys and no other layer does; "
                f"got keys={'a tensor' if keys is not None else None} on {'the owner' if owner else 'a non-owner'}"
            )
        if owner:
            store = self.pclr_keys[adapter_name]
            store.zero_()
            write_rows_(store, keys)
        store_A, store_B = self.pclr_A[adapter_name], self.pclr_B[adapter_name]
        store_A.zero_()
        store_B.zero_()
        write_rows_(store_A, A)
        tags = self.pclr_rank_task[adapter_name]
        tags[cap:] = -1
        tags[cap : cap + count] = task_id
        self._set_counts(adapter_name, new=count)

    @torch.no_grad()
    def drop_ranks(self, adapter_name: str, drop: Sequence[int]) -> None:
        """Drop the active ranks at pool indices ``drop`` (static first, then new), compacting both stores.

        Args:
            adapter_name: The adapter.
            drop: Pool indices in ``[0, N_s + N_n)``.
        """
        n_s, n_n = self.counts(adapter_name)[:2]
        bad = [i for i in drop if not 0 <= i < n_s + n_n]
        if bad:
            raise ValueError(f"rank indices {bad} are outside the {n_s + n_n} active ranks")
        keep = torch.ones(n_s + n_n, dtype=torch.bool)
        keep[list(drop)] = False
        keep_static = keep[:n_s].nonzero().flatten().tolist()
        keep_new = keep[n_s:].nonzero().flatten().tolist()
        for static, new in self._pairs(adapter_name):
            for store, kept_rows in ((static, keep_static), (new, keep_new)):
                kept = full_tensor(store)[kept_rows].clone()
                store.zero_()
                write_rows_(store, kept)
        cap = self.pclr_A_static[adapter_name].shape[0]
        tags = self.pclr_rank_task[adapter_name]
        static_tags, new_tags = tags[:cap][keep_static].clone(), tags[cap:][keep_new].clone()
        tags.fill_(-1)
        tags[: len(keep_static)] = static_tags
        tags[cap : cap + len(keep_new)] = new_tags
        self._set_counts(adapter_name, static=len(keep_static), new=len(keep_new))

    @torch.no_grad()
    def fold_new_ranks(self, adapter_name: str) -> None:
        """Freeze: move the new ranks (and their keys) behind the static ones; the new stores are emptied."""
        n_s, n_n = self.counts(adapter_name)[:2]
        cap = self.pclr_A_static[adapter_name].shape[0]
        if n_s + n_n > cap:
            raise ValueError(f"folding {n_n} new ranks into {n_s} static ones exceeds pool_size={cap}")
        for static, new in self._pairs(adapter_name):
            static[n_s : n_s + n_n] = full_tensor(new)[:n_n].to(static.dtype)
            new.zero_()
        tags = self.pclr_rank_task[adapter_name]
        tags[n_s : n_s + n_n] = tags[cap : cap + n_n].clone()
        tags[cap:] = -1
        self._set_counts(adapter_name, static=n_s + n_n, new=0)

    @torch.no_grad()
    def store_prototype(self, adapter_name: str, task_id: int, prototype: torch.Tensor) -> None:
        """Store task ``task_id``'s prototype (on the group owner) and count prototypes up to it on every layer.

        Args:
            adapter_name: The adapter.
            task_id: The task; prototypes of tasks ``0..task_id`` count as stored afterwards.
            prototype: (d,) the normalized prototype (only the group owner keeps it).
        """
        if adapter_name in self.pclr_prototypes:
            store = self.pclr_prototypes[adapter_name]
            if not 0 <= task_id < store.shape[0]:
                raise ValueError(f"task {task_id} is outside the {store.shape[0]} prototype rows (max_tasks)")
            store[task_id] = prototype.to(store)
        self._set_counts(adapter_name, protos=task_id + 1)

    @torch.no_grad()
    def set_static_keys(self, adapter_name: str, keys: torch.Tensor) -> None:
        """Replace the group's active static keys (N_s x d); only the group owner holds keys."""
        if adapter_name not in self.pclr_keys_static:
            raise ValueError(f"this layer does not own its group's keys of adapter {adapter_name!r}")
        store = self.pclr_keys_static[adapter_name]
        n_s = self.pclr_host_counts[adapter_name][N_STATIC]
        if keys.shape != (n_s, store.shape[1]):
            raise ValueError(f"`keys` must have shape {(n_s, store.shape[1])}, got {tuple(keys.shape)}")
        store[:n_s] = keys.to(store.dtype)

    def finish_task(self, adapter_name: str, task_id: int) -> None:
        """Count task ``task_id`` as finished: the adapter expects task ``task_id + 1`` next."""
        current = self.pclr_host_counts[adapter_name][TASK]
        if task_id != current:
            raise ValueError(f"end_task({task_id}) but the adapter is learning task {current}")
        self._set_counts(adapter_name, task=task_id + 1)

    def pool_tensors(self, adapter_name: str) -> list[torch.Tensor]:
        """Every per-adapter tensor of the pool (ranks, keys, task tags, counts, prototypes, shared LoRA)."""
        names = self.adapter_layer_names + self.other_param_names
        stores = (getattr(self, name) for name in names)
        return [
            store[adapter_name]
            for store in stores
            if isinstance(store, (nn.ParameterDict, BufferDict)) and adapter_name in store
        ]

    @torch.no_grad()
    def load_pool_tensors(self, adapter_name: str, values: Sequence[torch.Tensor]) -> None:
        """Copy ``values`` (as :meth:`pool_tensors` lists them) into the pool and restore the host counts."""
        tensors = self.pool_tensors(adapter_name)
        if len(values) != len(tensors):
            raise ValueError(f"expected {len(tensors)} pool tensors, got {len(values)}")
        for t, value in zip(tensors, values):
            t.copy_(value)
        self.restore_counts()
