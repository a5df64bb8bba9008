"""Data-parallel reductions over the processes, and keeping one job's processes identical
(``torchrun -m peft_ext run``). Every helper is a no-op when ``torch.distributed`` is not initialized or has one
process.

accelerate's counterparts (``accelerate.utils.reduce``, ``broadcast``, ``broadcast_object_list``,
``synchronize_rng_states``, ``PartialState.main_process_first``) are not used: they act through ``PartialState``,
which takes the world from the launcher's environment, so on a process group the caller initialized itself (a file
or TCP store, as the tests and users of the library API do) it reports one process and every collective is skipped;
constructing it can also initialize a process group or select a device. These helpers read the process group in use.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .core import is_dtensor, rank, world_size


def all_reduce_(tensors: Sequence[torch.Tensor], mean: bool = False) -> None:
    """Sum (or average) ``tensors`` over the processes in place, as one flat all-reduce.

    Args:
        tensors: Tensors of one device; each is replaced by its sum (mean) over the processes.
        mean: Divide by the number of processes (DDP's gradient convention).
    """
    # accelerate.utils.reduce reduces tensor by tensor in their own dtype; this is one collective, summed in float64
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
    # accelerate.utils.broadcast hands the tensors to dist.broadcast as they are: a non-contiguous one fails there
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
    # accelerate has no counterpart: it leaves gradient averaging to the DDP / FSDP wrapper this step bypasses.
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


# --- one job on several processes (`torchrun -m peft_ext run`) ------------------------------------------------

T = TypeVar("T")


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
    # not PartialState.on_main_process / main_process_first: the others would skip fn, or wait forever if it raised
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
    # accelerate.utils.synchronize_rng_states has no Python `random` state, and one collective per generator
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
