"""FSDP2 (DTensor) parameters: whole-tensor reads and writes, the local rows, reductions over row shards, and the
layout checks that refuse what a method cannot work on (other DTensor placements, DeepSpeed ZeRO-3 partitions)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .core import is_dtensor, optional_type
from .processes import all_reduce_


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
    fsdp = optional_type("torch.distributed.fsdp", "FSDPModule")
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
