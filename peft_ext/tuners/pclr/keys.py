"""PCLR's keys and task prototypes at the model level: the query loss, a task's prototype, routing as a stored task,
and pulling static keys toward the prototypes of similar tasks (docs/methods.md (PCLR))."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed import all_reduce_, gathered_parameters
from .layer import N_PROTOS
from .pool import group_layers, pclr_tuner

__all__ = [
    "batch_query",
    "pull_keys_to_prototypes",
    "query_loss",
    "query_prototype",
    "routed_as",
    "routed_as_tasks",
    "stack_batch",
    "task_route",
]

Batch = dict[str, Any]


def query_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """The weighted query-key loss ``w * mean(1 - cos(q, k))`` of the last forward pass (``None``: nothing to train).

    Add it to the task loss after each training forward; it is what trains the keys (docs/methods.md (PCLR): not the
    gate).
    """
    return pclr_tuner(model).query_loss()


@torch.no_grad()
def query_prototype(model: nn.Module, batches: Sequence[Batch]) -> torch.Tensor:
    """The task's prototype: the normalized mean of the per-sample queries over ``batches`` (no forward pass needed,
    but for a model without token or patch inputs: :func:`batch_query`).

    Under ``torch.distributed`` the query sums are all-reduced, so every process gets the prototype of all the
    processes' batches (each process passes its own shard).

    Args:
        model: The PCLR model.
        batches: Input batches (as passed to ``model(**batch)``; a ``labels`` entry is ignored).
    """
    tuner = pclr_tuner(model)
    total: Optional[torch.Tensor] = None
    # no forward pass runs, so no FSDP2 unit unshards what the query reads (the root's input embedding): gather it
    with gathered_parameters(tuner.model):
        for batch in batches:
            q = batch_query(tuner, {k: v for k, v in batch.items() if k != "labels"})
            total = q.sum(0) if total is None else total + q.sum(0)
    if total is None:
        raise ValueError("`batches` is empty; a task prototype needs at least one batch")
    all_reduce_([total])
    return F.normalize(total, dim=0)


def batch_query(tuner: nn.Module, inputs: Batch) -> torch.Tensor:
    """The per-sample queries of one batch: the query function's; for a model without token or patch inputs the
    pooled input of its first adapted layer, read in an evaluation-mode forward pass.

    Args:
        tuner: The PCLR tuner.
        inputs: The batch without labels.
    """
    state = tuner.routing_state
    q = state.query_fn(tuner.model, (), inputs)
    if q is None and state.query_layer is not None:
        was_training = tuner.model.training
        tuner.model.eval()
        try:
            tuner.model(**inputs)
        finally:
            tuner.model.train(was_training)
        q = state.query
    if q is None:
        raise ValueError("the query function returned None for a batch; cannot compute a task prototype")
    return q


def task_route(prototypes: torch.Tensor, task: int, current_by_input: bool = True) -> Optional[torch.Tensor]:
    """How to route the samples of stored task ``task`` when measuring it: the prototype to pass to
    :func:`routed_as`, or ``None`` (each sample by its own query) for the current task.

    The current task is the last stored prototype, the one whose data is at hand. Routed through its prototype it can
    select none of its own new ranks (the mean query of a task sits between its samples' queries, nearer the older,
    trained keys), so with ``current_by_input`` it is routed as at inference. Older tasks' data is not at hand, so
    the current data stands in for them, routed as them. The one rule behind
    :func:`~.scoring.contribution_scores` and :func:`~.distill.integrate_over_tasks`.

    Args:
        prototypes: (tasks, query_dim) the stored prototypes, oldest first.
        task: Row of ``prototypes``.
        current_by_input: Route the current task by the samples' own queries (``False``: by its prototype).
    """
    if not 0 <= task < prototypes.shape[0]:
        raise ValueError(f"task {task} is not among the {prototypes.shape[0]} stored prototype(s)")
    if current_by_input and task == prototypes.shape[0] - 1:
        return None
    return prototypes[task]


@contextmanager
def routed_as(model: nn.Module, prototype: Optional[torch.Tensor]) -> Iterator[None]:
    """Route every sample as the task of ``prototype``: its (normalized) prototype replaces each sample's query.

    The default query still runs (for the batch size and the device), then every row is replaced, so selection and
    prototype routing behave as for an input whose query is exactly that prototype. Useful when the task id is known
    at inference, and the routing :func:`~.distill.integrate_over_tasks` and :func:`~.scoring.contribution_scores`
    use.

    Args:
        model: The PCLR model.
        prototype: (query_dim,) a task prototype (e.g. a row of the stored prototypes), or ``None``: leave the
            routing alone (each sample by its own query; what :func:`task_route` returns for the current task).
    """
    with routed_as_tasks(model, [prototype]):
        yield


@contextmanager
def routed_as_tasks(model: nn.Module, routes: Sequence[Optional[torch.Tensor]]) -> Iterator[None]:
    """Route a batch of ``len(routes)`` stacked copies (:func:`stack_batch`): copy ``t`` as :func:`routed_as`
    ``(routes[t])`` would route it alone, so one forward pass measures every task.

    Args:
        model: The PCLR model.
        routes: Per copy, a (query_dim,) prototype or ``None`` (each sample of that copy by its own query).

    Raises:
        ValueError: In the forward, if the batch's rows are not ``len(routes)`` equal copies' worth.
    """
    if all(route is None for route in routes):
        yield
        return
    state = pclr_tuner(model).routing_state
    previous = state.routes
    state.routes = [None if p is None else F.normalize(p.detach().float().flatten(), dim=0) for p in routes]
    try:
        yield
    finally:
        state.routes = previous


def stack_batch(batch: Batch, copies: int) -> Batch:
    """``copies`` copies of ``batch`` one after another along the sample axis (dim 0 of every tensor entry; other
    entries are kept as they are): the input of one :func:`routed_as_tasks` pass."""
    if copies == 1:
        return batch
    return {k: torch.cat([v] * copies) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


@torch.no_grad()
def pull_keys_to_prototypes(
    model: nn.Module, adapter: str = "default", threshold: float = 0.8, strength: float = 0.5
) -> int:
    """Pull every static key that is close to several task prototypes toward all of them (merging similar tasks).

    ``k <- normalize((1 - strength) k + strength * mean_{p: cos(k, p) >= threshold} p)`` for keys with at least two
    such prototypes (docs/methods.md (PCLR): keys near several similar tasks' prototypes move toward all of them).
    Done in closed form because static keys are frozen buffers; the public code uses a loss term during
    distillation, which for frozen keys amounts to the same move.

    Args:
        model: The PCLR model.
        adapter: The adapter.
        threshold: Cosine above which a prototype counts as close.
        strength: Fraction of the way to move toward the mean of the close prototypes.

    Returns:
        The number of keys moved (over all groups).
    """
    if not 0 <= strength <= 1:
        raise ValueError(f"`strength` must be in [0, 1], got {strength!r}")
    moved = 0
    for layers in group_layers(model, adapter).values():
        owner = layers[0]
        keys = owner.static_keys(adapter)
        if owner.counts(adapter)[N_PROTOS] < 2 or keys.shape[0] == 0:
            continue
        protos = owner.prototypes(adapter).to(keys.dtype)
        close = (F.normalize(keys, dim=-1) @ protos.mT) >= threshold  # (n_s, T)
        several = close.sum(1) >= 2
        if not several.any():
            continue
        target = (close.to(keys.dtype) @ protos) / close.sum(1, keepdim=True).clamp_min(1).to(keys.dtype)
        pulled = F.normalize((1 - strength) * F.normalize(keys, dim=-1) + strength * target, dim=-1)
        updated = keys.clone()
        updated[several] = pulled[several]
        owner.set_static_keys(adapter, updated)
        moved += int(several.sum())
    return moved
