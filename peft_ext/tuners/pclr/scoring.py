"""PCLR's compression: score the active ranks of each layer group and drop the weakest (docs/methods.md (PCLR)).

Rules (``PCLRConfig.compress_rule``): ``"index"`` is the public code's rule (drop every s-th rank); ``"importance"``
drops the ranks with the smallest ``||a_i|| ||b_i||`` summed over the linears of the layer group (they share one key
and one selection, so a rank is dropped from the whole group); ``"contribution"`` drops the ranks that contribute
least to the outputs, measured on the task's data routed as each stored task (:func:`contribution_scores`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import nn

from ...distributed import all_reduce_
from .config import COMPRESS_RULES, MEASURED_RULES, PCLRConfig
from .distill import default_forward, evaluating, model_output
from .keys import routed_as_tasks, stack_batch, task_route
from .layer import PCLRLayer
from .pool import adapter_config, group_layers, pclr_tuner, stored_prototypes
from .selection import copy_blocks

__all__ = ["compress", "contribution_scores", "drop_count", "importance_scores"]

Batch = dict[str, Any]


def importance_scores(layers: Sequence[PCLRLayer], adapter: str) -> torch.Tensor:
    """``sum over the group's linears of ||a_i|| ||b_i||`` for each active rank (static first), the importance rule.

    Args:
        layers: The linears of one layer group.
        adapter: The adapter.
    """
    total = None
    for layer in layers:
        # per store, then concatenated: the same numbers as on the concatenated pool, without copying the ranks
        stores = (layer.static_ranks(adapter), layer.new_ranks(adapter))
        score = torch.cat([A.detach().float().norm(dim=1) * B.detach().float().norm(dim=1) for A, B in stores])
        total = score if total is None else total + score
    return total


@torch.no_grad()
def contribution_scores(
    model: nn.Module,
    batches: Sequence[Batch],
    adapter: str = "default",
    forward: Optional[Callable[[nn.Module, Batch], Any]] = None,
    route_current_by_input: bool = True,
    aggregate: str = "sum",
    on_output: Optional[Callable[[int, int, torch.Tensor], Any]] = None,
) -> dict[str, torch.Tensor]:
    """Measured contribution of every active rank, per layer group: the ``"contribution"`` compression rule.

    ``batches`` are the current task's data and the last stored prototype is the current task's (``end_task``
    stores it first). For the current task the batches are routed as they really are, each sample by its own query
    (``route_current_by_input``); for every older task ``t`` they are routed as ``t`` (:func:`routed_as`, its
    prototype as every sample's query: the old tasks' data is gone). Routing the current task by its prototype
    instead (``route_current_by_input=False``) can select none of the task's own ranks: the mean query sits closer
    to static keys pulled toward the mean of the prototypes than to the new keys trained on the individual queries,
    so the new ranks score 0 and are the first dropped (docs/pclr.md). Rank ``i`` scores
    ``sum over samples of gate_i * mean over tokens |a_i . x| * ||b_i||`` summed over the group's linears: the size
    of what it adds to the outputs when it is used. Each task's scores are normalized to sum to one before they are
    added, so every task has the same say whatever its magnitudes (``||a_i|| ||b_i||`` alone is not comparable across
    tasks trained at different times) and a rank that no task's routing selects scores zero. Padding tokens count in
    the token mean (the layers do not see the attention mask).

    All tasks are measured in one pass over ``batches``: each batch runs once, stacked once per stored task, copy
    ``t`` routed as task ``t`` (:func:`~.keys.routed_as_tasks`). The passes do not grow with the number of tasks;
    the rows of each pass (and its peak activation memory) do.

    Args:
        model: The PCLR model (its prototypes stored).
        batches: Input batches (the current task's data).
        adapter: The adapter.
        forward: ``forward(model, batch) -> output``; default ``model(**batch without labels)``.
        route_current_by_input: Route the batches by their own queries for the last stored (the current) task.
        aggregate: ``"sum"``: a rank's score is the sum of its normalized shares over the tasks (the
            ``"contribution"`` rule); ``"max"``: its largest share of any one task (``"contribution_max"``).
        on_output: Called as ``on_output(batch index, task, output)`` with each copy's share of every pass's output
            (its logits split along the first axis, which lists the stacked samples): what the model outputs on that
            batch routed as that task, the teacher :func:`~.distill.integrate_over_tasks` and
            :func:`~.distill.integrate` distill from (``end_task`` keeps them instead of running the model again).
            Not called for an output whose first axis does not split into the copies.

    Returns:
        ``{group: (active ranks,) scores}``, static ranks first.
    """
    if not batches:
        raise ValueError("`batches` is empty; the contribution rule measures the ranks on data")
    if aggregate not in ("sum", "max"):
        raise ValueError(f"`aggregate` must be 'sum' or 'max', got {aggregate!r}")
    forward = forward or default_forward
    state = pclr_tuner(model).routing_state
    protos = stored_prototypes(model, adapter)
    n_tasks = protos.shape[0]
    if n_tasks == 0:
        raise ValueError("no task prototype is stored yet; store the task's prototype before measuring contributions")
    routes = [task_route(protos, task, route_current_by_input) for task in range(n_tasks)]
    groups = group_layers(model, adapter)
    # (tasks, active ranks) per group: row t sums what the ranks add to copy t of the stacked batches
    measured = {group: torch.zeros(n_tasks, sum(layers[0].counts(adapter)[:2])) for group, layers in groups.items()}

    def record(layer: PCLRLayer, name: str, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, indices, gates) -> None:
        if name != adapter:
            return
        x3 = x if x.dim() == 3 else x.unsqueeze(1)
        A, norms = A.detach().float(), B.detach().float().norm(dim=1)
        sums = measured[layer.pclr_group]
        copies = state.routed_copies or [None] * n_tasks  # None: every copy routed by its own queries
        for task, (part, index, gate, shared) in enumerate(copy_blocks(x3, indices, gates, copies)):
            # a copy routed as a task selects one index set for all its rows: one matmul, no per-row copies of A
            if shared is None:
                proj = torch.einsum("btn,bkn->btk", part.float(), A[index])
            else:
                proj = part.float() @ A[index[0]].mT
            size = proj.abs().mean(1) * norms[index] * gate.float()
            sums[task].index_add_(0, index.flatten().cpu(), size.flatten().cpu())

    state.recorder = record
    try:
        with evaluating(model), routed_as_tasks(model, routes):
            for index, batch in enumerate(batches):
                out = model_output(forward(model, stack_batch(batch, n_tasks)))
                if on_output is not None and out.dim() > 0 and out.shape[0] % n_tasks == 0:
                    for task, share in enumerate(out.detach().chunk(n_tasks)):
                        on_output(index, task, share)
    finally:
        state.recorder = None
    # under torch.distributed: the contributions on every process's data
    all_reduce_(list(measured.values()))
    combine = torch.add if aggregate == "sum" else torch.maximum
    totals = {}
    for group, sums in measured.items():
        total = torch.zeros(sums.shape[1])
        for share in sums / sums.sum(1, keepdim=True).clamp_min(1e-30):  # task by task, oldest first
            total = combine(total, share)
        totals[group] = total
    return totals


def drop_count(config: PCLRConfig, task_id: int, n_active: int) -> int:
    """Ranks ``end_task(task_id)`` drops per group: the scheduled fraction, more if the next task would not fit.

    Compression makes room for the next task's ranks (static + new never exceed ``pool_size``) but never drops
    every rank: integration and routing need at least one. ``PCLRConfig`` refuses schedules that would need it.

    Args:
        config: The adapter's config.
        task_id: The task that just finished.
        n_active: Active (static + new) ranks of the fullest group.

    Returns:
        The number of ranks to drop, in ``[0, n_active - 1]`` (0 when the pool is empty).

    Raises:
        ValueError: If the next task's ranks cannot fit without dropping every rank (a config changed after its
            checks), before anything is changed.
    """
    scheduled = min(round(config.compress_ratio_after(task_id) * n_active), max(n_active - 1, 0))
    needed = n_active + config.ranks_for_task(task_id + 1) - config.pool_size
    if n_active > 0 and needed >= n_active:
        raise ValueError(
            f"task {task_id + 1} needs {config.ranks_for_task(task_id + 1)} new ranks but `pool_size`="
            f"{config.pool_size}: making room would drop all {n_active} ranks of the earlier tasks; use "
            "`ranks_schedule` entries < pool_size after the first"
        )
    return max(scheduled, needed, 0)


def _drop_indices(rule: str, n_active: int, n_drop: int, scores: Optional[torch.Tensor]) -> list[int]:
    if rule == "index":
        # Public code: drop every s-th rank (s = 4 drops 25 %); s is chosen so that at least n_drop are candidates.
        s = max(1, n_active // n_drop)
        return list(range(s - 1, n_active, s))[:n_drop]
    # stable: among equal scores (e.g. ranks no routing selects) the older rank goes first
    order = torch.sort(scores.float(), stable=True).indices
    return sorted(order[:n_drop].tolist())


@torch.no_grad()
def compress(
    model: nn.Module,
    n_drop: int,
    rule: Optional[str] = None,
    adapter: str = "default",
    only_static: bool = False,
    scores: Optional[dict[str, torch.Tensor]] = None,
) -> dict[str, list[int]]:
    """Drop ``n_drop`` ranks from every layer group (static and new ranks together), compacting the survivors.

    Args:
        model: The PCLR model.
        n_drop: Ranks to drop per group.
        rule: ``"index"``, ``"importance"`` or ``"contribution"`` (default: the config's ``compress_rule``).
        adapter: The adapter.
        only_static: Drop among the static ranks only (making room for a new task).
        scores: Per-group rank scores for the ``"contribution"`` rule (:func:`contribution_scores`); without them
            that rule falls back to ``"importance"`` (e.g. when making room before a task, with no data at hand).

    Returns:
        The dropped pool indices (static first, then new) per group.
    """
    rule = rule or adapter_config(model, adapter).compress_rule
    if rule not in COMPRESS_RULES:
        raise ValueError(f"`rule` must be one of {COMPRESS_RULES}, got {rule!r}")
    if isinstance(n_drop, bool) or not isinstance(n_drop, int) or n_drop < 0:
        raise ValueError(f"`n_drop` must be a non-negative integer, got {n_drop!r}")
    dropped: dict[str, list[int]] = {}
    for group, layers in group_layers(model, adapter).items():
        n_s, n_n = layers[0].counts(adapter)[:2]
        n_active = n_s if only_static else n_s + n_n
        k = min(n_drop, n_active)
        if k == 0:
            dropped[group] = []
            continue
        group_scores = None
        if rule in MEASURED_RULES and scores is not None:
            if group not in scores or scores[group].numel() < n_active:
                raise ValueError(f"`scores` has no score for each of the {n_active} active ranks of group {group!r}")
            group_scores = scores[group][:n_active]
        elif rule != "index":
            group_scores = importance_scores(layers, adapter)[:n_active]
        drop = _drop_indices(rule, n_active, k, group_scores)
        dropped[group] = drop
        for layer in layers:
            layer.drop_ranks(adapter, drop)
    return dropped
