"""SplitLoRA's end of task in two phases, so that ``end_task`` is all-or-nothing over the adapted modules.

:func:`plan_task` computes everything a module's end of task needs (the merged running statistics, the split, the
next task's ``A``) and checks everything that can fail (a finite ``B``, finite statistics, some non-zero input)
without changing the module; :func:`commit_task` then applies the plan and cannot fail. ``SplitLoRAModel.end_task``
plans every module before it commits any, so a refusal leaves every module as it was.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...distributed import full_tensor
from .covariance import fd_compress
from .subspace import (
    choose_split,
    closed_form_split,
    covariance_spectrum,
    kaiming_lora_A,
    minor_subspace_A,
    primary_dimension,
    seeded_generator,
    sketch_spectrum,
)

__all__ = ["TaskPlan", "check_finite", "commit_task", "distributed_group", "plan_task"]


def distributed_group(group: Any) -> tuple[bool, Any]:
    """Whether statistics must be all-reduced, and over which group (``None`` = the default group).

    Args:
        group: A ``torch.distributed`` process group, or ``None`` for the default one.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    return dist.get_world_size(group) > 1, group


@dataclass
class TaskPlan:
    """What :func:`commit_task` writes into one module (computed by :func:`plan_task`).

    Args:
        task: The finished task's index.
        k_star: The chosen split.
        primary: Primary directions the next task's ``A`` avoids.
        in_features: The module's input width.
        new_a: The next task's frozen ``A``.
        pending: The task's (reduced) statistics, added to the running ones on commit.
        sketch: The merged sketch (sketch statistics only).
        sketch_error: The merged sketch error (sketch statistics only).
    """

    task: int
    k_star: int
    primary: int
    in_features: int
    new_a: torch.Tensor
    pending: dict[str, torch.Tensor]
    sketch: Optional[torch.Tensor] = None
    sketch_error: Optional[torch.Tensor] = None


def check_finite(tensor: torch.Tensor, what: str, where: str) -> None:
    """Raise ``ValueError`` naming ``what``, ``where`` and the first non-finite value and its index.

    Args:
        tensor: The tensor to check.
        what: What it is (e.g. ``"B of SplitLoRA adapter 'default'"``).
        where: The module (its name).
    """
    bad = ~torch.isfinite(tensor.detach())
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        at = f" at index {list(index)}" if index else ""
        raise ValueError(
            f"{what} on {where!r} has non-finite values ({int(bad.sum())} of {tensor.numel()}, e.g. "
            f"{float(tensor.detach()[index])}{at}); end_task changed nothing (no module was folded or advanced)"
        )


def plan_task(layer: Any, adapter_name: str, pending: dict[str, torch.Tensor], group: Any = None) -> TaskPlan:
    """Check one module and compute its end of task without changing it.

    Args:
        layer: The ``SplitLoRALayer``.
        adapter_name: The adapter.
        pending: The task's statistics, already reduced over processes (``reduced_statistics``).
        group: ``torch.distributed`` process group the new ``A`` is broadcast over (default: the default group).

    Returns:
        The plan for :func:`commit_task`.

    Raises:
        ValueError: If ``B`` or the statistics are non-finite, or the module saw no non-zero input.
    """
    key, config = layer.seed_key, layer.splitlora_config[adapter_name]
    check_finite(full_tensor(layer.splitlora_B[adapter_name]), f"B of SplitLoRA adapter {adapter_name!r}", key)
    tokens, energy = int(layer.splitlora_tokens[adapter_name]), layer.splitlora_energy[adapter_name]
    plan_sketch = plan_error = None
    tokens += int(pending["tokens"])
    energy = energy.to(pending["energy"].dtype) + pending["energy"]
    what = f"the input statistics of SplitLoRA adapter {adapter_name!r} (the task's inputs had inf/nan)"
    check_finite(energy, what, key)
    if tokens == 0 or not float(energy) > 0:
        raise ValueError(
            f"module {key!r} saw no non-zero inputs for adapter {adapter_name!r}: run forward passes over the "
            "task's data inside `collect_statistics()` before `end_task()`"
        )
    # sharded (FSDP2): this process's features of the statistics; the eigensolve gathers what it needs, one module
    # at a time (a dense covariance whole; of a sketch only the primary eigenvectors, below)
    shards = layer.statistics_shards(adapter_name)
    if layer.statistics_kind(adapter_name) == "dense":
        cov = layer.local_statistics(adapter_name)
        cov = cov.to(pending["cov"].dtype) + pending["cov"]  # as commit's in-place sum: the same bits
        if shards is not None:
            cov = shards.gather(cov, 0)
        check_finite(cov, what, key)
        values, vectors, total = covariance_spectrum(cov)
        del cov
        vector_shards = None  # the eigenvectors of the whole covariance are whole
    else:
        plan_sketch = layer.local_statistics(adapter_name)
        plan_error = layer.splitlora_sketch_error[adapter_name]
        stacked = torch.cat([plan_sketch.to(pending["sketch"].dtype), pending["sketch"]])
        plan_sketch, delta = fd_compress(stacked, plan_sketch.shape[0], shards)
        plan_error = plan_error.to(pending["error"].dtype) + (pending["error"] + delta)
        if shards is not None:
            bad = (~torch.isfinite(plan_sketch)).any().to(torch.int64)
            if int(shards.all_reduce_(bad)):
                check_finite(shards.gather(plan_sketch, 1), what, key)  # every process raises the same error
        check_finite(plan_sketch, what, key)
        values, vectors, total = sketch_spectrum(plan_sketch, float(energy), shards=shards)
        vector_shards = shards  # this process's rows of the eigenvectors
    task_index, n = int(layer.splitlora_tasks[adapter_name]), layer.in_features
    k_star = choose_split(values, task_index, config.trade_off, dim=n, total=total)
    primary = primary_dimension(k_star, n)
    if plan_sketch is not None:
        wanted = closed_form_split(values, task_index, config.trade_off, dim=n, total=total) + 1
        if wanted >= values.numel() and values.numel() < n:
            warnings.warn(
                f"SplitLoRA module {key!r}: the split keeps all {values.numel()} directions of the sketch and may "
                f"want more; raise `sketch_rank` (now {values.numel()}) or use statistics='dense'.",
                UserWarning,
                stacklevel=4,
            )
        primary = min(primary, values.numel())
    if primary >= n:
        warnings.warn(
            f"SplitLoRA module {key!r}: the primary subspace fills all {n} input directions, so the next "
            f"task's A there is zero and that module cannot learn; a larger `trade_off` (now {config.trade_off}) "
            "keeps fewer directions.",
            UserWarning,
            stacklevel=4,
        )
    generator = seeded_generator(config.seed, key, task_index + 1)
    a = layer.splitlora_A[adapter_name]
    reference = kaiming_lora_A(layer.r[adapter_name], n, generator, torch.float64)
    target_norm = float(torch.linalg.matrix_norm(reference))
    if config.init_scaling == "inverse_task":
        # the new task has index t = task_index + 1; docs/methods.md (SplitLoRA): / (t + 1)
        target_norm /= task_index + 2
    primary_vectors = vectors[:, :primary]
    if vector_shards is not None:
        primary_vectors = vector_shards.gather(primary_vectors, 0)
    new_a = minor_subspace_A(primary_vectors, layer.r[adapter_name], target_norm, generator, a.dtype)
    new_a = new_a.to(a.device)
    sync, group = distributed_group(group)
    if sync:
        # The statistics are identical on every rank after the all-reduce, so every rank computes the same A;
        # broadcasting rank 0's copy guards against eigensolvers that differ in the last bits across devices.
        dist.broadcast(new_a, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return TaskPlan(task_index, k_star, primary, n, new_a, pending, plan_sketch, plan_error)


@torch.no_grad()
def commit_task(layer: Any, adapter_name: str, plan: TaskPlan) -> dict[str, Any]:
    """Apply a :func:`plan_task` plan: add the statistics, fold ``B A`` into ``dW_old``, set the next ``A``.

    Args:
        layer: The ``SplitLoRALayer`` the plan was made for (unchanged since).
        adapter_name: The adapter.
        plan: The plan.

    Returns:
        ``{"task", "k_star", "primary", "in_features"}``: what was chosen, for logs and tests.
    """
    layer.add_statistics(adapter_name, plan.pending, plan.sketch, plan.sketch_error)
    layer.fold_task(adapter_name)
    layer.splitlora_A[adapter_name] = plan.new_a
    layer.splitlora_tasks[adapter_name] += 1
    layer.splitlora_primary[adapter_name].fill_(plan.primary)
    return {"task": plan.task, "k_star": plan.k_star, "primary": plan.primary, "in_features": plan.in_features}
