"""What peft_ext's methods need from ``torch.distributed``: data-parallel reductions and a guard against sharding.

Statistics that a method computes from data outside the DDP-wrapped forward/backward (LOI's gradient products,
PCLR's query prototypes, contribution scores and distillation gradients) would otherwise be computed from each
rank's local data only, so the ranks would diverge or silently use a fraction of the data. Every helper here is a
no-op when ``torch.distributed`` is not initialized or has one process. docs/distributed.md says which method uses
which.

The second half serves optimizers on FSDP2 row shards (DTensors): the local part, the whole tensor, writing a whole
value back as shards, reducing per-column partial results over the processes that hold different rows, and the
layout check that refuses everything else.
"""

from __future__ import annotations

import functools
import importlib
import math
import pickle
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ROW_SHARDED",
    "all_reduce_",
    "all_reduce_over_row_shards_",
    "all_shards_agree",
    "average_gradients",
    "broadcast_",
    "check_parameters_unchanged",
    "check_row_sharded",
    "count_collectives",
    "full_tensor",
    "full_tensors",
    "gathered_parameters",
    "is_dtensor",
    "local_part",
    "on_rank_zero",
    "raise_shared",
    "rank",
    "rank_zero_first",
    "registered_parameters",
    "reject_zero3",
    "share_random_state",
    "sharding_of",
    "sync_model",
    "world_size",
    "write_full_",
    "write_full_tensors_",
]


def world_size() -> int:
    """The number of data-parallel processes: 1 when ``torch.distributed`` is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def all_reduce_(tensors: Sequence[torch.Tensor], mean: bool = False) -> None:
    """Sum (or average) ``tensors`` over the processes in place, as one flat all-reduce.

    Args:
        tensors: Tensors of one device; each is replaced by its sum (mean) over the processes.
        mean: Divide by the number of processes (DDP's gradient convention).
    """
    world = world_size()
    if world == 1 or not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64 if t.is_floating_point() else t.dtype) for t in tensors])
    dist.all_reduce(flat)
    if mean:
        flat /= world
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


@torch.no_grad()
def broadcast_(tensors: Iterable[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values (state initialized from each rank's own random numbers).
    A non-contiguous tensor goes through a contiguous copy (collectives need contiguous memory)."""
    if world_size() == 1:
        return
    for t in tensors:
        buffer = t.data if t.is_contiguous() else t.data.contiguous()
        dist.broadcast(buffer, src=src)
        if buffer is not t.data:
            t.data.copy_(buffer)


def average_gradients(params: Iterable[torch.Tensor]) -> None:
    """Average the gradients of ``params`` over the processes, as DDP's reducer would.

    For training steps that do not go through the DDP wrapper (PCLR's distillation). A parameter without a gradient on
    every process keeps ``grad=None``; one with a gradient on some processes only gets zeros for the others. FSDP2
    (DTensor) parameters are skipped: their gradients are already averaged shards.
    """
    # FSDP2 reduce-scatters (averages) the gradients of its DTensor parameters in the backward already
    params = [p for p in params if not is_dtensor(p)]
    if world_size() == 1 or not params:
        return
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    used = [p for p, flag in zip(params, present.tolist()) if flag]
    for p in used:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_([p.grad for p in used], mean=True)


def sharding_of(p: torch.Tensor) -> str | None:
    """``"FSDP2/DTensor"`` or ``"DeepSpeed ZeRO-3"`` when ``p`` holds only a shard of its tensor, else ``None``.

    A DTensor (FSDP2's ``fully_shard``, tensor parallelism) is recognized by type, a ZeRO-3 parameter by the
    ``ds_id``/``ds_numel`` attributes DeepSpeed puts on it (the local tensor is then a flat partition or empty).
    """
    if is_dtensor(p):
        return "FSDP2/DTensor"
    if hasattr(p, "ds_id") or hasattr(p, "ds_numel"):
        return "DeepSpeed ZeRO-3"
    return None


def registered_parameters(param_groups: Sequence[dict]) -> list[list[tuple[int, ...]]]:
    """The shape of every parameter per group, to detect later replacement (:func:`check_parameters_unchanged`)."""
    return [[tuple(p.shape) for p in group["params"]] for group in param_groups]


def check_parameters_unchanged(
    param_groups: Sequence[dict], registered: list[list[tuple[int, ...]]], optimizer: str
) -> None:
    """Raise ``ValueError`` if a wrapper swapped the optimizer's parameters for tensors of other shapes.

    DeepSpeed's ZeRO optimizers (stages 1-3) replace each group's parameters with one flat fp32 partition per
    process after the optimizer is built; an optimizer that reads shapes (matrices, adapter factors) would then
    silently take the wrong path.
    """
    for index, (group, shapes) in enumerate(zip(param_groups, registered)):
        now = [tuple(p.shape) for p in group["params"]]
        if now != shapes:
            raise ValueError(
                f"{optimizer}: the parameters of param group {index} were replaced after the optimizer was built "
                f"(now {len(now)} tensor(s) of shapes {now[:3]}{'...' if len(now) > 3 else ''}, built with "
                f"{len(shapes)}); DeepSpeed ZeRO does this (it flattens parameters into per-process partitions), but "
                "this optimizer needs the whole matrices. Use DistributedDataParallel (accelerate: distributed_type "
                "MULTI_GPU) instead; see docs/distributed.md"
            )


# -- FSDP2 (DTensor) parameters: whole-tensor reads and writes ------------------------------------------------------


@functools.cache
def _optional_type(module: str, name: str) -> type | tuple:
    """The class ``module.name``, or ``()`` (which ``isinstance`` matches nothing with) when torch is built without
    distributed support."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return ()


# Resolved once, at import: is_dtensor runs inside adapter forwards (PCLR reads its stores through full_tensor), where
# torch.compile cannot trace an import (importlib is skipped by dynamo: one graph break per call). Importing torch
# (through peft) has loaded torch.distributed.tensor already where it exists, so this costs nothing.
_DTENSOR = _optional_type("torch.distributed.tensor", "DTensor")


def is_dtensor(t: object) -> bool:
    """Whether ``t`` (a tensor or parameter) is a DTensor, e.g. an FSDP2 shard outside the forward. Always ``False``
    when torch is built without distributed support. Traceable by ``torch.compile`` (no lookup at call time)."""
    return isinstance(t, _DTENSOR) or isinstance(getattr(t, "data", None), _DTENSOR)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of ``t``: gathered from the processes' shards for a DTensor, ``t`` itself otherwise.

    Under FSDP2 an adapter parameter is a DTensor shard between forward passes (every process holds some rows); the
    task cycle's decisions (SplitLoRA's fold, PCLR's rank compaction and scores) need every row. Collective for a
    DTensor: every process must call it, in the same order.
    """
    if not is_dtensor(t):
        return t
    return t.detach().full_tensor()


@torch.no_grad()
def write_full_(t: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``t`` to the whole tensor ``value`` in place: for a DTensor, each process writes its own shard of it.

    Args:
        t: A plain tensor, or a DTensor (every process passes the same ``value``; no communication happens).
        value: The new whole value, of ``t``'s full shape (``t`` itself, as :func:`full_tensor` returns it for a
            plain tensor: nothing to do).
    """
    if value is t:
        return
    if not is_dtensor(t):
        t.copy_(value)
        return
    from torch.distributed.tensor import distribute_tensor

    local = distribute_tensor(value.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None)
    t.copy_(local)


@contextmanager
def gathered_parameters(module: nn.Module) -> Iterator[None]:
    """Run the block with the whole values of the DTensor parameters of ``module`` that no FSDP2 unit unshards.

    A method that calls a submodule of a sharded model directly (PCLR's query embeds the prompt with the input
    embedding; its cycle runs forward passes through the tuner, below the ``PeftModel``) skips the forward hooks of
    the FSDP2 units above that submodule: their parameters (the root's embedding, final norm, head) would stay
    shards. Units inside ``module`` still unshard themselves; only the rest is all-gathered, once, and put back
    unchanged after the block. Collective when there is something to gather. The gathered parameters must be frozen
    (a gradient would reach the temporary copy, not the shard).

    Args:
        module: The module the block calls into.

    Raises:
        ValueError: If a parameter to gather is trainable.
    """
    fsdp = _optional_type("torch.distributed.fsdp", "FSDPModule")
    units = [name for name, m in module.named_modules() if fsdp and isinstance(m, fsdp)]
    todo: list[tuple[str, nn.Module, str, nn.Parameter]] = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        if any(unit == "" or prefix == unit or prefix.startswith(unit + ".") for unit in units):
            continue  # that unit's own forward hooks unshard it
        todo += [(prefix, m, name, p) for name, p in m._parameters.items() if p is not None and is_dtensor(p)]
    for prefix, _, name, p in todo:
        if p.requires_grad:
            raise ValueError(
                f"`{prefix + '.' if prefix else ''}{name}` is a trainable FSDP2 shard outside every fully_shard unit "
                f"inside {type(module).__name__}; its gradient would be lost. Apply fully_shard to the module "
                "holding it (e.g. each decoder layer) or keep it frozen"
            )
    whole: dict[int, nn.Parameter] = {}
    for _, m, name, p in todo:
        if id(p) not in whole:  # tied weights: gathered once, swapped in everywhere
            whole[id(p)] = nn.Parameter(full_tensor(p), requires_grad=False)
        m._parameters[name] = whole[id(p)]
    try:
        yield
    finally:
        for _, m, name, p in todo:
            m._parameters[name] = p


def reject_zero3(named_params: Iterable[tuple[str, torch.Tensor]], method: str) -> None:
    """Raise ``ValueError`` naming the first DeepSpeed ZeRO-3 partition: ``method`` reads and writes whole tensors.

    ZeRO-3 gathers a parameter only inside the forward of the module holding it; between forward passes the
    parameter is an empty or flat partition (its real shape is ``ds_shape``), so a task cycle that folds, compacts or
    re-initializes adapter tensors there would read and write partitions. FSDP2 keeps DTensor shards whose whole value
    can be read and written (:func:`full_tensor`, :func:`write_full_`), which the cycles do.

    Args:
        named_params: ``(name, parameter)`` pairs to check.
        method: What refuses, for the message (e.g. ``"SplitLoRA end_task"``).
    """
    for name, p in named_params:
        if sharding_of(p) == "DeepSpeed ZeRO-3":
            shape = tuple(getattr(p, "ds_shape", p.shape))
            raise ValueError(
                f"{method} got `{name}` (shape {shape}) as a DeepSpeed ZeRO-3 partition, but it reads and writes the "
                "whole adapter tensors between forward passes, which ZeRO-3 does not keep. Train with "
                "DistributedDataParallel (torchrun; accelerate distributed_type MULTI_GPU) or FSDP2 (fully_shard; "
                "accelerate distributed_type FSDP with fsdp_version 2); see docs/distributed.md"
            )


# --- FSDP2 row shards ------------------------------------------------------------------------------------------------
# FSDP2 (``fully_shard``) holds every parameter as a DTensor sharded along dim 0 (``Shard(0)``; HSDP adds
# ``Replicate()`` mesh dimensions); its gradients have the same placements after the reduce-scatter. The optimizers
# that support it work on the local rows (elementwise state, DCT-AdamW's row-local projection) or gather the few
# whole tensors they need (Riemannion's (m + n) x r factors). Every other layout is refused by
# :func:`check_row_sharded` before anything changes.

#: What :func:`check_row_sharded` accepts, for messages and docs.
ROW_SHARDED = "FSDP2 row shards (Shard(0) on every sharded mesh dimension, fully_shard's default) or Replicate()"


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's local shard (a view: in-place updates change the DTensor), else
    ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def check_row_sharded(named_params: Iterable[tuple[str, torch.Tensor]], method: str, needs: str) -> None:
    """Raise ``ValueError`` naming the first parameter whose layout ``method`` cannot use.

    Accepted: whole tensors and :data:`ROW_SHARDED` DTensors. Refused: other DTensor placements (``Shard(1)``,
    tensor parallelism, ``Partial``) and DeepSpeed ZeRO-3 partitions (flat, so neither rows nor columns are whole).

    Args:
        named_params: ``(name, parameter)`` pairs.
        method: The optimizer's name, for the message.
        needs: What the method computes that needs whole rows, for the message.
    """
    for name, p in named_params:
        kind = sharding_of(p)
        if kind is None:
            continue
        if kind == "FSDP2/DTensor":
            placements = tuple(p.placements)
            if all(pl.is_replicate() or pl.is_shard(0) for pl in placements):
                continue
            what = f"a DTensor with placements {placements} on a {p.device_mesh.ndim}-D mesh"
            fix = "shard with fully_shard's default placement (no shard_placement_fn) or replicate the parameter"
        else:
            what = "a DeepSpeed ZeRO-3 shard (a flat partition of the parameter)"
            fix = "use FSDP2 (torch.distributed.fsdp.fully_shard) or DistributedDataParallel instead of ZeRO-3"
        raise ValueError(
            f"{method} got `{name}` (shape {tuple(p.shape)}) as {what}; {needs} works on whole tensors and on "
            f"{ROW_SHARDED} only. To train it, {fix}; see docs/distributed.md"
        )


def all_shards_agree(flag: bool, params: Iterable[torch.Tensor]) -> bool:
    """``flag`` and-ed over the processes when any of ``params`` is a DTensor shard (else ``flag`` itself).

    A check of local rows (e.g. "every gradient entry is finite") must reach the same verdict on every process, or
    some would step and others skip.

    Args:
        flag: This process's verdict.
        params: The parameters it is about; every process must pass the same ones (a collective may run).
    """
    if not any(is_dtensor(p) for p in params):
        return flag
    failed = torch.tensor([0.0 if flag else 1.0], dtype=torch.float64)
    all_reduce_([failed])
    return failed.item() == 0


def all_reduce_over_row_shards_(t: torch.Tensor, op: str = "sum", *, like: torch.Tensor) -> None:
    """Reduce ``t`` in place over the processes that hold different rows of ``like`` (a row-sharded DTensor).

    The sum (or max) over the mesh dimensions where ``like`` is ``Shard(0)``; replicas (``Replicate()`` dimensions)
    hold the same rows and are left out, so nothing is counted twice. A no-op for a plain tensor.

    Args:
        t: A tensor computed from this process's rows (e.g. per-column partial sums), reduced in place.
        op: ``"sum"`` or ``"max"``.
        like: The parameter whose sharding defines the groups.
    """
    if not is_dtensor(like):
        return
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    for dim, placement in enumerate(like.placements):
        if placement.is_shard(0) and like.device_mesh.size(dim) > 1:
            dist.all_reduce(t, op=reduce_op, group=like.device_mesh.get_group(dim))


# --- one job on several processes (`torchrun -m peft_ext run`) ------------------------------------------------

T = TypeVar("T")


def rank() -> int:
    """This process's rank: 0 when ``torch.distributed`` is not initialized."""
    return dist.get_rank() if world_size() > 1 else 0


def raise_shared(error: Optional[BaseException], messages: list[Optional[str]]) -> None:
    """Raise ``error`` here, or, when another process failed, a ``RuntimeError`` naming the first one."""
    if error is not None:
        raise error
    first = next(r for r, m in enumerate(messages) if m is not None)
    raise RuntimeError(f"process {first} of {len(messages)} failed: {messages[first]}")


def on_rank_zero(fn: Callable[[], T]) -> Optional[T]:
    """Run ``fn`` on rank 0 only (a write to disk, or filling a cache the others then read); every process returns
    once it is done (with ``fn``'s result on rank 0, ``None`` elsewhere) and raises when it raised. Without several
    processes: ``fn()``.

    Sharing the outcome is what keeps a failed write from leaving the other processes waiting forever: they raise the
    same exception (a ``RuntimeError`` with its message when it cannot be pickled).
    """
    if world_size() == 1:
        return fn()
    error: Optional[Exception] = None
    shared: Optional[Exception] = None
    result = None
    if rank() == 0:
        try:
            result = fn()
        except Exception as err:
            error = shared = err
            try:
                pickle.dumps(err)
            except Exception:
                shared = RuntimeError(f"{type(err).__name__}: {err}")
    box: list[Any] = [shared]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise error if error is not None else box[0]
    return result


def share_random_state() -> None:
    """Give every process rank 0's random generators (torch's CPU one, the current CUDA device's, Python's).

    Training draws differently on each process (dropout over its own share of the batch); the method's hooks that
    follow (a re-wrapped adapter's initialization, random keys) must draw the same numbers everywhere.
    """
    if world_size() == 1:
        return
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    box: list[Any] = [state]
    dist.broadcast_object_list(box, src=0)
    torch.set_rng_state(box[0]["torch"])
    random.setstate(box[0]["python"])
    if "cuda" in box[0]:
        torch.cuda.set_rng_state(box[0]["cuda"])


def sync_model(model: nn.Module) -> None:
    """Overwrite every parameter and buffer of ``model`` with rank 0's (no-op on one process).

    The processes compute the same model already; this guards against kernels that are not bitwise reproducible
    across processes (GPU atomics) drifting them apart over a sequence. FSDP2 shards (DTensors) are left alone: each
    process holds different rows of them by design.
    """
    broadcast_(v for v in model.state_dict().values() if not is_dtensor(v))


def rank_zero_first(fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0 (:func:`on_rank_zero`), then on the other processes: for work whose first run fills a cache
    (``datasets``' files) that the later runs only read. Every process returns ``fn``'s result."""
    result = on_rank_zero(fn)
    return fn() if rank() != 0 else result


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
