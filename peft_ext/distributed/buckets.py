"""Many FSDP2 row shards in one collective (the whole values, and the write-back of each process's rows), and a
counter of the collectives a block runs."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist

from .core import is_dtensor
from .shards import ROW_SHARDED, full_tensor, write_full_

# --- many FSDP2 row shards in one collective -------------------------------------------------------------------------

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; torch >= 2.4 has the old name.
# getattr: a torch built without distributed support has neither
_ALL_GATHER_INTO_ONE = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


def full_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The whole values of ``tensors`` (:func:`full_tensor` of each), gathered in one collective per process group.

    An optimizer that needs many small whole tensors every step (Riemannion: ``A``, ``B`` and two gradients per
    adapter) would otherwise pay one all-gather, and DTensor's redistribution bookkeeping, per tensor. Here every
    local row shard is copied, as bytes, into one buffer with a slot per tensor, one all-gather into one tensor runs
    per process group and device, and each tensor is cut back out. Slots have the padded size of FSDP2's shards
    (``ceil(rows / world)`` rows, as ``torch.chunk`` splits), so a shorter or empty last shard is unpadded by taking
    the first ``rows`` rows of the concatenated slots. The values are bit for bit :func:`full_tensor`'s; dtypes may
    be mixed. :func:`write_full_tensors_` writes whole values back.

    Plain tensors come back as they are. DTensors with ``Shard(0)`` on more than one mesh dimension (nested row
    shards) are rare and each go through :func:`full_tensor`. Collective when any tensor is a DTensor: every process
    must call it with the same tensors, in the same order.

    Args:
        tensors: Plain tensors and :data:`ROW_SHARDED` DTensors (parameters or gradients), in any mix.

    Returns:
        One whole tensor per input (the input itself when it is not a DTensor; contiguous when it is).

    Raises:
        ValueError: If a DTensor's placements are not :data:`ROW_SHARDED`.
    """
    result: list[Optional[torch.Tensor]] = [None] * len(tensors)
    buckets: dict[tuple[Any, torch.device], list[tuple[int, torch.Tensor, int, int]]] = {}
    meshes: dict[tuple[int, tuple], Optional[tuple[Any, int, int]]] = {}
    for i, t in enumerate(tensors):
        if not is_dtensor(t):
            result[i] = t
            continue
        shard = _row_shard(t, meshes)
        # not t.detach(): DTensor's dispatch of it costs more than gathering a small tensor
        local = t.to_local().detach()
        if shard is None:
            result[i] = local
        elif shard == "nested":
            result[i] = full_tensor(t)
        else:
            group, world, me = shard
            buckets.setdefault((group, local.device), []).append((i, local, world, me))
    for (group, device), items in buckets.items():
        world = items[0][2]
        slots = []  # (index, local, rows of a padded shard, byte offset, bytes of a padded shard)
        offset = 0
        for i, local, _, me in items:
            shape = tuple(tensors[i].shape)
            per = _chunk_rows(shape[0], world, me, local)
            size = per * math.prod(shape[1:]) * local.element_size()
            slots.append((i, local, per, offset, size))
            offset += -(-size // 16) * 16  # 16-byte aligned slots, so every dtype can be viewed back in place
        send = torch.empty(offset, dtype=torch.uint8, device=device)
        for _, local, _, start, _ in slots:
            if local.numel():
                send[start : start + local.numel() * local.element_size()].copy_(
                    local.contiguous().view(-1).view(torch.uint8)
                )
        received = torch.empty(world * offset, dtype=torch.uint8, device=device)
        _ALL_GATHER_INTO_ONE(received, send, group=group)
        received = received.view(world, offset)
        for i, local, per, start, size in slots:
            whole = tensors[i].shape
            parts = received[:, start : start + size].contiguous().view(local.dtype)
            result[i] = parts.view(world * per, *whole[1:])[: whole[0]]
    return result  # type: ignore[return-value]


@torch.no_grad()
def write_full_tensors_(tensors: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """:func:`write_full_` of each pair: for a row-sharded DTensor, this process's rows of the whole value are copied
    into its local shard directly (the rows :func:`full_tensors` takes them from), without DTensor's
    ``distribute_tensor`` and dispatch, which cost more than the copy for small tensors. No communication.

    Args:
        tensors: Plain tensors and :data:`ROW_SHARDED` DTensors.
        values: The new whole values, one per tensor, of its full shape (every process passes the same); cast to the
            tensor's dtype as :func:`write_full_` does.
    """
    if len(tensors) != len(values):
        raise ValueError(f"write_full_tensors_ got {len(tensors)} tensors but {len(values)} values")
    meshes: dict[tuple[int, tuple], Optional[tuple[Any, int, int]]] = {}
    for t, value in zip(tensors, values):
        if value is t:
            continue
        if not is_dtensor(t):
            t.copy_(value)
            continue
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(f"write_full_tensors_: a value of shape {tuple(value.shape)} for {tuple(t.shape)}")
        shard = _row_shard(t, meshes)
        local = t.to_local()
        if shard is None:
            local.copy_(value)
        elif shard == "nested":
            write_full_(t, value)
        else:
            _, world, me = shard
            per = _chunk_rows(t.shape[0], world, me, local)
            local.copy_(value[me * per : me * per + local.shape[0]])


def _row_shard(t: Any, meshes: dict) -> Any:
    """``(group, world, rank in it)`` of the one mesh dimension that splits ``t``'s rows, ``None`` when no dimension
    does (replicated), ``"nested"`` when several do. ``meshes`` caches the lookups per mesh and placements (the mesh's
    own ones are slow next to a small copy)."""
    placements = tuple(t.placements)
    key = (id(t.device_mesh), placements)
    if key not in meshes:
        if not all(pl.is_replicate() or pl.is_shard(0) for pl in placements):
            raise ValueError(f"expected {ROW_SHARDED}; got a DTensor with placements {placements}")
        mesh = t.device_mesh
        dims = [d for d, pl in enumerate(placements) if pl.is_shard(0) and mesh.size(d) > 1]
        if not dims:
            meshes[key] = None
        elif len(dims) > 1:
            meshes[key] = "nested"
        else:
            meshes[key] = (mesh.get_group(dims[0]), mesh.size(dims[0]), mesh.get_local_rank(dims[0]))
    return meshes[key]


def _chunk_rows(rows: int, world: int, me: int, local: torch.Tensor) -> int:
    """The rows of a padded shard (``torch.chunk``'s chunk size, which FSDP2 and DTensor's ``Shard(0)`` use), after
    checking that ``local`` holds the rows that layout gives process ``me``."""
    per = -(-rows // world)
    expected = min(per, max(rows - me * per, 0))
    if local.shape[0] != expected:
        raise RuntimeError(
            f"a row shard of a {rows}-row DTensor has {local.shape[0]} rows on mesh rank {me} of {world}; "
            f"torch.chunk's layout gives {expected}"
        )
    return per


class CollectiveCount:
    """What :func:`count_collectives` counted: ``calls`` (collective ops run) and their ``names``."""

    def __init__(self) -> None:
        self.names: list[str] = []

    @property
    def calls(self) -> int:
        return len(self.names)


@contextmanager
def count_collectives() -> Iterator[CollectiveCount]:
    """Count the collectives this process runs inside the block, whatever issued them.

    Every collective, from ``torch.distributed`` or DTensor's functional collectives, runs as a ``c10d::`` operator
    (``c10d::allreduce_``, ``c10d::allgather_into_tensor_coalesced_``, ...); the profiler sees each call. For tests
    and benchmarks (the profiler slows the block down): how many collectives a step makes, not how long they take.
    Not inside another ``torch.profiler.profile``.
    """
    counted = CollectiveCount()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield counted
    counted.names.extend(e.name for e in prof.events() if e.name.startswith("c10d::"))


def row_split(t: torch.Tensor) -> Optional[tuple[Any, int, int]]:
    """``(group, world, rank in it)`` of the one mesh dimension that splits the rows of the DTensor ``t`` over more
    than one process; ``None`` for a plain tensor, a replicated DTensor or rows split over several dimensions."""
    if not is_dtensor(t):
        return None
    shard = _row_shard(t, {})
    return None if shard is None or shard == "nested" else shard


def owned_by(slots: Sequence[int], split: Optional[tuple[Any, int, int]]) -> tuple[list[int], list[int]]:
    """Which process owns each item (its ``slot``, a place that does not change between calls, modulo the number of
    processes; process 0 all of them without ``split``), and the positions of this process's items."""
    owners = [slot % split[1] for slot in slots] if split else [0] * len(slots)
    me = split[2] if split else 0
    return owners, [i for i, owner in enumerate(owners) if owner == me]


def owners_by_group(keys: Sequence[Any], costs: Sequence[float], call_cost: float, world: int) -> list[int]:
    """The owning process of each item when items of one key are worked on in one batched call: whole groups go to
    the least-loaded process, so each process makes about ``1 / world`` of the calls, not every call on a smaller
    batch; a group costing more than a process's fair share is dealt out item by item instead.

    Deterministic from its arguments (every process computes the same owners). Groups are placed largest first (ties
    in order of first appearance), each on the process with the least load so far (the lowest rank on ties).

    Args:
        keys: Each item's group (items of one key share a batched call).
        costs: Each item's own cost.
        call_cost: The fixed cost of one batched call, in the units of ``costs``.
        world: Number of processes.
    """
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    cost = {key: call_cost + sum(costs[i] for i in items) for key, items in groups.items()}
    share = sum(cost.values()) / world
    load, owners = [0.0] * world, [0] * len(keys)
    for key in sorted(groups, key=lambda k: -cost[k]):  # sorted is stable: first appearance breaks ties
        items = groups[key]
        if cost[key] <= share or len(items) < world:
            rank = min(range(world), key=lambda r: load[r])
            for i in items:
                owners[i] = rank
            load[rank] += cost[key]
            continue
        order = sorted(range(world), key=lambda r: load[r])  # dealt round-robin from the least-loaded process
        for n, i in enumerate(items):
            owners[i] = order[n % world]
        for n in range(min(world, len(items))):
            load[order[n]] += call_cost + sum(costs[i] for i in items[n::world])
    return owners


def all_gather_owned(
    owned: dict[int, Sequence[torch.Tensor]],
    owners: Sequence[int],
    like: Sequence[Sequence[torch.Tensor]],
    split: Optional[tuple[Any, int, int]],
) -> list[list[torch.Tensor]]:
    """Every item's tensors on every process, when each process computed only the items it owns: one all-gather.

    Item ``i`` is owned by process ``owners[i]`` (:func:`owned_by`; every process passes the same ``owners``), which
    passes its tensors in ``owned[i]``, shaped as ``like[i]``. Each process sends its items' tensors flattened into
    one buffer (float64 when any of ``like`` is, else float32, which holds float32, bfloat16 and float16 values
    exactly; padded to the longest process's), and every process cuts the same values back out, so all hold identical
    tensors (the owner's own too come from the buffer). Collective over ``split``'s group; without ``split`` the
    items are returned as they are.

    Args:
        owned: ``{item: its tensors}`` for the items this process owns.
        owners: The owning process of every item.
        like: Per item, tensors of its tensors' shapes (e.g. the parameters they are new values of).
        split: ``(group, world, rank)`` (:func:`row_split`), or ``None``.

    Returns:
        Per item, its tensors (views of one received buffer under ``split``).
    """
    if split is None:
        return [list(owned[i]) for i in range(len(like))]
    group, world, me = split
    dtype = torch.float64 if any(t.dtype == torch.float64 for item in like for t in item) else torch.float32
    shapes = [[tuple(t.shape) for t in item] for item in like]
    sizes = [sum(math.prod(s) for s in item) for item in shapes]
    width = max([sum(size for size, o in zip(sizes, owners) if o == p) for p in range(world)] + [1])
    device = next((t.device for item in like for t in item), torch.device("cpu"))
    send = torch.zeros(width, dtype=dtype, device=device)
    offset = 0
    for i, owner in enumerate(owners):
        if owner == me:
            for t in owned[i]:
                send[offset : offset + t.numel()] = t.reshape(-1)
                offset += t.numel()
    received = torch.empty(world * width, dtype=dtype, device=device)
    _ALL_GATHER_INTO_ONE(received, send, group=group)
    received = received.view(world, width)
    offsets, result = [0] * world, []
    for owner, item in zip(owners, shapes):
        parts = []
        for shape in item:
            size = math.prod(shape)
            parts.append(received[owner, offsets[owner] : offsets[owner] + size].view(shape))
            offsets[owner] += size
        result.append(parts)
    return result
