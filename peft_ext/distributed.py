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

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "ROW_SHARDED",
    "all_reduce_",
    "all_reduce_over_row_shards_",
    "all_shards_agree",
    "average_gradients",
    "broadcast_",
    "check_parameters_unchanged",
    "check_row_sharded",
    "full_tensor",
    "is_row_sharded",
    "local_part",
    "registered_parameters",
    "reject_sharded",
    "sharding_of",
    "world_size",
    "write_full_",
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


def broadcast_(tensors: Iterable[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values (state initialized from each rank's own random numbers)."""
    if world_size() == 1:
        return
    for t in tensors:
        dist.broadcast(t.data, src=src)


def average_gradients(params: Iterable[torch.Tensor]) -> None:
    """Average the gradients of ``params`` over the processes, as DDP's reducer would.

    For training steps that do not go through the DDP wrapper (PCLR's distillation). A parameter without a gradient on
    every process keeps ``grad=None``; one with a gradient on some processes only gets zeros for the others.
    """
    params = list(params)
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
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        DTensor = ()
    if isinstance(p, DTensor) or isinstance(getattr(p, "data", None), DTensor):
        return "FSDP2/DTensor"
    if hasattr(p, "ds_id") or hasattr(p, "ds_numel"):
        return "DeepSpeed ZeRO-3"
    return None


def reject_sharded(named_params: Iterable[tuple[str, torch.Tensor]], optimizer: str, needs: str) -> None:
    """Raise ``ValueError`` naming the first parameter that is a shard: ``optimizer`` needs whole matrices.

    Args:
        named_params: ``(name, parameter)`` pairs.
        optimizer: The optimizer's name, for the message.
        needs: What the optimizer computes from the whole matrix, for the message.
    """
    for name, p in named_params:
        kind = sharding_of(p)
        if kind is not None:
            raise ValueError(
                f"{optimizer} got `{name}` (shape {tuple(p.shape)}) as a {kind} shard, but {needs} needs the whole "
                "matrix on every process. Train with DistributedDataParallel (torchrun, or accelerate with "
                "distributed_type MULTI_GPU), which keeps parameters whole; see "
                "docs/distributed.md"
            )


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


# --- FSDP2 row shards ------------------------------------------------------------------------------------------------
# FSDP2 (``fully_shard``) holds every parameter as a DTensor sharded along dim 0 (``Shard(0)``; HSDP adds
# ``Replicate()`` mesh dimensions); its gradients have the same placements after the reduce-scatter. The optimizers
# that support it work on the local rows (elementwise state, DCT-AdamW's row-local projection) or gather the few
# whole tensors they need (Riemannion's (m + n) x r factors). Every other layout is refused by
# :func:`check_row_sharded` before anything changes.

#: What :func:`check_row_sharded` accepts, for messages and docs.
ROW_SHARDED = "FSDP2 row shards (Shard(0) on every sharded mesh dimension, fully_shard's default) or Replicate()"


def _dtensor_type() -> type | tuple:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return ()
    return DTensor


def is_row_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 parameter or its gradient); :func:`check_row_sharded` vets its layout."""
    return isinstance(t, _dtensor_type())


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's local shard (a view: in-place updates change the DTensor), else
    ``t`` itself."""
    return t.to_local() if is_row_sharded(t) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every process (a DTensor is all-gathered: a collective every process must call), else
    ``t``."""
    return t.full_tensor() if is_row_sharded(t) else t


@torch.no_grad()
def write_full_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the whole tensor ``value`` into ``param``: for a DTensor, only this process's shard of it (sliced
    locally, as ``fully_shard`` slices: no communication), so every process must hold the same ``value``.

    Args:
        param: The parameter (a plain tensor or a DTensor), changed in place.
        value: Its new value, of ``param``'s (global) shape.
    """
    if not is_row_sharded(param):
        param.copy_(value)
        return
    from torch.distributed.tensor import distribute_tensor

    shard = distribute_tensor(value.detach(), param.device_mesh, param.placements, src_data_rank=None)
    param.to_local().copy_(shard.to_local())


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
    if not any(is_row_sharded(p) for p in params):
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
    if not is_row_sharded(like):
        return
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    for dim, placement in enumerate(like.placements):
        if placement.is_shard(0) and like.device_mesh.size(dim) > 1:
            dist.all_reduce(t, op=reduce_op, group=like.device_mesh.get_group(dim))
