"""The PCLR task cycle: learn (new ranks, keys from the prototype), compress, integrate (distill), freeze.

METHODS.md section 3. For task ``t``:

1. :func:`begin_task`: make room (the pool never exceeds ``pool_size``), add ``ranks_for_task(t)`` trainable ranks
   (``a_i`` optionally copied from the static ranks whose keys best match the task's prototype; ``b_i = 0`` so the
   model's function is unchanged when training starts) and set their keys to the task's query prototype.
2. Train (task loss + :func:`query_loss`).
3. :func:`end_task`: store the task's prototype; if the schedule (or the next task's room) asks for it, record the
   uncompressed pool's outputs on the task's data (teacher), :func:`compress` the pool, :func:`integrate` (distill
   teacher -> compressed pool + shared LoRA); fold the new ranks into the static pool; pull keys toward the
   prototypes of similar tasks.

Compression rules: ``"index"`` is the public code's rule (drop every s-th rank); ``"importance"`` drops the ranks with
the smallest ``||a_i|| ||b_i||`` summed over the linears of the layer group (they share one key and one selection,
so a rank is dropped from the whole group); ``"contribution"`` drops the ranks that contribute least to the outputs,
measured on the task's data routed as each stored task (:func:`contribution_scores`).

Integration routing: ``"input"`` routes each distillation sample by its own query; ``"tasks"`` is the public code's
scheme: each batch is routed as one stored task (its prototype as every sample's query), the task drawn with
probability proportional to ``sqrt(last distillation loss on it)``, so the student learns to reproduce every task's
routing of the pool, and tasks it reproduces worst are revisited most (:func:`integrate_over_tasks`).
``benchmarks/continual_wordnet.py`` compares them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from peft import PeftModel
from peft.tuners._buffer_dict import BufferDict
from torch import nn

from ...distributed import all_reduce_, average_gradients, broadcast_
from .config import COMPRESS_RULES, PCLRConfig
from .layer import N_NEW, N_PROTOS, N_STATIC, TASK, PCLRLayer
from .model import PCLRModel

__all__ = [
    "INTEGRATE_ROUTING",
    "IntegrateResult",
    "PoolSnapshot",
    "begin_task",
    "compress",
    "contribution_scores",
    "distill_loss",
    "end_task",
    "group_layers",
    "importance_scores",
    "integrate",
    "integrate_over_tasks",
    "pool_in_use",
    "pull_keys_to_prototypes",
    "query_loss",
    "query_prototype",
    "routed_as",
    "stored_adapter_parameters",
    "stored_prototypes",
    "teacher_outputs",
]

Batch = dict[str, Any]

#: How :func:`end_task` routes the distillation data (see the module docstring).
INTEGRATE_ROUTING = ("input", "tasks")


def _tuner(model: nn.Module) -> PCLRModel:
    tuner = model.base_model if isinstance(model, PeftModel) else model
    if not isinstance(tuner, PCLRModel):
        raise TypeError(f"expected a PeftModel with a PCLR adapter (or a PCLRModel), got {type(model).__name__}")
    return tuner


def _config(model: nn.Module, adapter: str) -> PCLRConfig:
    tuner = _tuner(model)
    if adapter not in tuner.peft_config:
        raise ValueError(f"unknown PCLR adapter {adapter!r}; the model has {sorted(tuner.peft_config)}")
    return tuner.peft_config[adapter]


def group_layers(model: nn.Module, adapter: str = "default") -> dict[str, list[PCLRLayer]]:
    """The PCLR layers carrying ``adapter``, by layer group, each group's owner (keys, prototypes) first.

    Args:
        model: A PeftModel with PCLR adapters (or its PCLRModel).
        adapter: The adapter.
    """
    groups: dict[str, list[PCLRLayer]] = {}
    for module in _tuner(model).modules():
        if isinstance(module, PCLRLayer) and adapter in module.pclr_A:
            groups.setdefault(module.pclr_group, []).append(module)
    for layers in groups.values():
        layers.sort(key=lambda layer: not layer.owns_keys(adapter))
    return groups


def pool_in_use(model: nn.Module, adapter: str = "default") -> int:
    """The largest number of active ranks (static + new) of any layer: never more than ``pool_size``."""
    return max(sum(layer.counts(adapter)[:2]) for layers in group_layers(model, adapter).values() for layer in layers)


def stored_adapter_parameters(model: nn.Module, adapter: str = "default") -> int:
    """Adapter values in use: active ranks ``(in + out)`` per linear, the shared LoRA, active keys and prototypes.

    Bounded by the pool cap however many tasks come (per-task LoRA grows by ``r (in + out)`` per linear and task).
    The buffers are allocated at capacity; this counts what the pool holds, not the allocation.
    """
    total = 0
    for layers in group_layers(model, adapter).values():
        for i, layer in enumerate(layers):
            n_s, n_n, n_protos, _ = layer.counts(adapter)
            total += (n_s + n_n) * (layer.in_features + layer.out_features)
            if adapter in layer.pclr_shared_A:
                total += layer.pclr_shared_A[adapter].numel() + layer.pclr_shared_B[adapter].numel()
            if i == 0:
                total += (n_s + n_n + n_protos) * layer.pclr_keys[adapter].shape[1]
    return total


def query_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """The weighted query-key loss ``w * mean(1 - cos(q, k))`` of the last forward pass (``None``: nothing to train).

    Add it to the task loss after each training forward; it is what trains the keys (METHODS.md: not the gate).
    """
    return _tuner(model).query_loss()


@torch.no_grad()
def query_prototype(model: nn.Module, batches: Sequence[Batch]) -> torch.Tensor:
    """The task's prototype: the normalized mean of the per-sample queries over ``batches`` (no forward pass needed).

    Under ``torch.distributed`` the query sums are all-reduced, so every process gets the prototype of all the
    processes' batches (each process passes its own shard).

    Args:
        model: The PCLR model.
        batches: Input batches (as passed to ``model(**batch)``; a ``labels`` entry is ignored).
    """
    tuner = _tuner(model)
    state = tuner.routing_state
    total: Optional[torch.Tensor] = None
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        q = state.query_fn(tuner.model, (), inputs)
        if q is None:
            raise ValueError("the query function returned None for a batch; cannot compute a task prototype")
        total = q.sum(0) if total is None else total + q.sum(0)
    if total is None:
        raise ValueError("`batches` is empty; a task prototype needs at least one batch")
    all_reduce_([total])
    return F.normalize(total, dim=0)


def _set_count(layer: PCLRLayer, adapter: str, slot: int, value: int) -> None:
    layer.pclr_counts[adapter][slot] = value


@torch.no_grad()
def begin_task(
    model: nn.Module, task_id: int, prototype: torch.Tensor, adapter: str = "default", key_noise: float = 0.05
) -> int:
    """Start learning task ``task_id``: make room, add its trainable ranks, initialize them and their keys.

    A fresh adapter is already learning task 0 (random keys); calling this for task 0 re-initializes those ranks
    from the prototype. For later tasks the previous one must have ended (:func:`end_task`).

    Args:
        model: The PCLR model.
        task_id: The task, counted from 0.
        prototype: (query_dim,) the task's query prototype (:func:`query_prototype`).
        adapter: The adapter.
        key_noise: Relative noise added to the prototype for each new key, so new ranks are not tied.

    Returns:
        The number of new ranks.

    Under ``torch.distributed`` the new ranks and keys (drawn from each process's random generator) are broadcast
    from rank 0, so the processes start the task identical even when their generators differ.
    """
    config = _config(model, adapter)
    groups = group_layers(model, adapter)
    first = next(iter(groups.values()))[0]
    n_static, n_new, _, current = first.counts(adapter)
    if task_id != current:
        raise ValueError(f"begin_task({task_id}) but the adapter expects task {current} next (tasks run in order)")
    if task_id > 0 and n_new > 0:
        raise ValueError(
            f"task {task_id} began while {n_new} ranks of task {task_id - 1} are still new; call end_task"
        )
    count = config.ranks_for_task(task_id)
    overflow = max(layer.counts(adapter)[N_STATIC] for layers in groups.values() for layer in layers) + count
    overflow -= config.pool_size
    if overflow > 0:
        # The schedule did not leave enough room (e.g. a shortened schedule): compress the static pool further
        # without integration rather than ever exceeding the cap.
        compress(model, overflow, adapter=adapter, only_static=True)
    proto = F.normalize(prototype.detach().float().flatten(), dim=0)
    for layers in groups.values():
        owner = layers[0]
        n_s = owner.counts(adapter)[N_STATIC]
        keys_static = owner.pclr_keys_static[adapter][:n_s]
        dim = owner.pclr_keys[adapter].shape[1]
        if proto.numel() != dim:
            raise ValueError(f"`prototype` has {proto.numel()} entries but the keys have width {dim}")
        source: list[int] = []
        if config.init_from_static and n_s > 0:
            scores = F.normalize(keys_static.float(), dim=-1) @ proto.to(keys_static.device)
            source = scores.topk(min(count, n_s)).indices.tolist()
        keys = owner.pclr_keys[adapter]
        keys.zero_()
        noise = torch.randn(count, dim, device=keys.device) * key_noise
        keys[:count] = F.normalize(proto.to(keys.device) + noise, dim=-1).to(keys.dtype)
        for layer in layers:
            A, B = layer.pclr_A[adapter], layer.pclr_B[adapter]
            A.zero_()
            B.zero_()
            A[:count] = torch.randn(count, A.shape[1], device=A.device) / math.sqrt(A.shape[1])
            if source:
                # Copy the directions a_i of the matching old ranks, not b_i: copying both would add their output a
                # second time; with b_i = 0 the model's function is unchanged when the task starts (LoRA's init).
                A[: len(source)] = layer.pclr_A_static[adapter][source]
            cap = layer.pclr_A_static[adapter].shape[0]
            tags = layer.pclr_rank_task[adapter]
            tags[cap:] = -1
            tags[cap : cap + count] = task_id
            _set_count(layer, adapter, N_NEW, count)
    broadcast_([t for layers in groups.values() for t in _new_rank_tensors(layers, adapter)])
    return count


def _new_rank_tensors(layers: Sequence[PCLRLayer], adapter: str) -> list[torch.Tensor]:
    return [layers[0].pclr_keys[adapter]] + [
        t for layer in layers for t in (layer.pclr_A[adapter], layer.pclr_B[adapter])
    ]


def importance_scores(layers: Sequence[PCLRLayer], adapter: str) -> torch.Tensor:
    """``sum over the group's linears of ||a_i|| ||b_i||`` for each active rank (static first), the importance rule.

    Args:
        layers: The linears of one layer group.
        adapter: The adapter.
    """
    total = None
    for layer in layers:
        A, B = layer.pool(adapter)
        score = A.detach().float().norm(dim=1) * B.detach().float().norm(dim=1)
        total = score if total is None else total + score
    return total


@contextmanager
def routed_as(model: nn.Module, prototype: torch.Tensor) -> Iterator[None]:
    """Route every sample as the task of ``prototype``: its (normalized) prototype replaces each sample's query.

    The default query still runs (for the batch size and the device), then every row is replaced, so selection and
    prototype routing behave as for an input whose query is exactly that prototype. Useful when the task id is known
    at inference, and the routing :func:`integrate_over_tasks` and :func:`contribution_scores` use.

    Args:
        model: The PCLR model.
        prototype: (query_dim,) a task prototype (e.g. a row of the stored prototypes).
    """
    state = _tuner(model).routing_state
    original = state.query_fn
    proto = F.normalize(prototype.detach().float().flatten(), dim=0)

    def query_fn(m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Optional[torch.Tensor]:
        query = original(m, args, kwargs)
        if query is None:
            return None
        if query.shape[-1] != proto.numel():
            raise ValueError(f"`prototype` has {proto.numel()} entries but the query has width {query.shape[-1]}")
        return proto.to(query).expand_as(query)

    state.query_fn = query_fn
    try:
        yield
    finally:
        state.query_fn = original


def stored_prototypes(model: nn.Module, adapter: str = "default") -> torch.Tensor:
    """The stored task prototypes (T x query_dim) of ``adapter`` (row ``t``: task ``t``)."""
    return next(iter(group_layers(model, adapter).values()))[0].prototypes(adapter).detach().clone()


class PoolSnapshot:
    """A copy of every PCLR tensor of one adapter (ranks, keys, task tags, counts, prototypes, shared LoRA).

    :meth:`active` swaps the copy in for the duration of a ``with`` block and restores the current tensors after it:
    the uncompressed pool can serve as the distillation teacher without a second copy of the model (the pool is a
    few MB, the model may be GBs). The snapshot's tensors have the same shapes as the live ones (capacities are
    fixed), so the swap is an in-place copy.

    Args:
        model: The PCLR model.
        adapter: The adapter.
    """

    def __init__(self, model: nn.Module, adapter: str = "default") -> None:
        # every per-adapter tensor store the layer declares (parameters and buffers; not its scalar settings)
        names = PCLRLayer.adapter_layer_names + PCLRLayer.other_param_names
        self.tensors = [
            store[adapter]
            for layers in group_layers(model, adapter).values()
            for layer in layers
            for store in (getattr(layer, name) for name in names)
            if isinstance(store, (nn.ParameterDict, BufferDict)) and adapter in store
        ]
        self.saved = [t.detach().clone() for t in self.tensors]

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the ``with`` block on the snapshot's pool (no gradients should flow through it)."""
        with torch.no_grad():
            current = [t.detach().clone() for t in self.tensors]
            for t, saved in zip(self.tensors, self.saved):
                t.copy_(saved)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, value in zip(self.tensors, current):
                    t.copy_(value)


@torch.no_grad()
def contribution_scores(
    model: nn.Module,
    batches: Sequence[Batch],
    adapter: str = "default",
    forward: Optional[Callable[[nn.Module, Batch], Any]] = None,
) -> dict[str, torch.Tensor]:
    """Measured contribution of every active rank, per layer group: the ``"contribution"`` compression rule.

    For each stored task ``t`` the batches are routed as ``t`` (:func:`routed_as`), and rank ``i`` scores
    ``sum over samples of gate_i * mean over tokens |a_i . x| * ||b_i||`` summed over the group's linears: the size
    of what it adds to the outputs when it is used. Each task's scores are normalized to sum to one before they are
    added, so every task has the same say whatever its magnitudes (``||a_i|| ||b_i||`` alone is not comparable across
    tasks trained at different times) and a rank that no task's routing selects scores zero. Padding tokens count in
    the token mean (the layers do not see the attention mask).

    Args:
        model: The PCLR model (its prototypes stored).
        batches: Input batches (the current task's data).
        adapter: The adapter.
        forward: ``forward(model, batch) -> output``; default ``model(**batch without labels)``.

    Returns:
        ``{group: (active ranks,) scores}``, static ranks first.
    """
    if not batches:
        raise ValueError("`batches` is empty; the contribution rule measures the ranks on data")
    forward = forward or _default_forward
    groups = group_layers(model, adapter)
    totals = {group: torch.zeros(sum(layers[0].counts(adapter)[:2])) for group, layers in groups.items()}
    current: dict[str, torch.Tensor] = {}

    def record(layer: PCLRLayer, name: str, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, indices, gates) -> None:
        if name != adapter:
            return
        x3 = x if x.dim() == 3 else x.unsqueeze(1)
        proj = torch.einsum("btn,bkn->btk", x3.float(), A.detach().float()[indices])
        size = proj.abs().mean(1) * B.detach().float().norm(dim=1)[indices] * gates.float()
        current[layer.pclr_group].index_add_(0, indices.flatten().cpu(), size.flatten().cpu())

    state = _tuner(model).routing_state
    protos = stored_prototypes(model, adapter)
    if protos.shape[0] == 0:
        raise ValueError("no task prototype is stored yet; store the task's prototype before measuring contributions")
    state.recorder = record
    try:
        with _evaluating(model):
            for proto in protos:
                for group in totals:
                    current[group] = torch.zeros_like(totals[group])
                with routed_as(model, proto):
                    for batch in batches:
                        forward(model, batch)
                # under torch.distributed: the contributions on every process's data
                all_reduce_(list(current.values()))
                for group, value in current.items():
                    totals[group] += value / value.sum().clamp_min(1e-30)
    finally:
        state.recorder = None
    return totals


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
    rule = rule or _config(model, adapter).compress_rule
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
        if rule == "contribution" and scores is not None:
            if group not in scores or scores[group].numel() < n_active:
                raise ValueError(f"`scores` has no score for each of the {n_active} active ranks of group {group!r}")
            group_scores = scores[group][:n_active]
        elif rule != "index":
            group_scores = importance_scores(layers, adapter)[:n_active]
        drop = _drop_indices(rule, n_active, k, group_scores)
        dropped[group] = drop
        keep = torch.ones(n_s + n_n, dtype=torch.bool)
        keep[drop] = False
        keep_static = keep[:n_s].nonzero().flatten().tolist()
        keep_new = keep[n_s:].nonzero().flatten().tolist()
        for layer in layers:
            _compact(layer, adapter, keep_static, keep_new, is_owner=layer is layers[0])
    return dropped


def _compact(layer: PCLRLayer, adapter: str, keep_static: list[int], keep_new: list[int], is_owner: bool) -> None:
    cap = layer.pclr_A_static[adapter].shape[0]
    tags = layer.pclr_rank_task[adapter]
    pairs = [(layer.pclr_A_static, layer.pclr_A), (layer.pclr_B_static, layer.pclr_B)]
    if is_owner:
        pairs.append((layer.pclr_keys_static, layer.pclr_keys))
    for static, new in pairs:
        for store, keep in ((static[adapter], keep_static), (new[adapter], keep_new)):
            kept = store[keep].clone()
            store.zero_()
            store[: len(keep)] = kept
    static_tags, new_tags = tags[:cap][keep_static].clone(), tags[cap:][keep_new].clone()
    tags.fill_(-1)
    tags[: len(keep_static)] = static_tags
    tags[cap : cap + len(keep_new)] = new_tags
    _set_count(layer, adapter, N_STATIC, len(keep_static))
    _set_count(layer, adapter, N_NEW, len(keep_new))


@torch.no_grad()
def _fold(model: nn.Module, adapter: str) -> None:
    """Freeze: move the new ranks (and their keys) behind the static ones."""
    for layers in group_layers(model, adapter).values():
        for i, layer in enumerate(layers):
            n_s, n_n = layer.counts(adapter)[:2]
            cap = layer.pclr_A_static[adapter].shape[0]
            if n_s + n_n > cap:
                raise ValueError(f"folding {n_n} new ranks into {n_s} static ones exceeds pool_size={cap}")
            pairs = [(layer.pclr_A_static, layer.pclr_A), (layer.pclr_B_static, layer.pclr_B)]
            if i == 0:
                pairs.append((layer.pclr_keys_static, layer.pclr_keys))
            for static, new in pairs:
                static[adapter][n_s : n_s + n_n] = new[adapter][:n_n].to(static[adapter].dtype)
                new[adapter].zero_()
            tags = layer.pclr_rank_task[adapter]
            tags[n_s : n_s + n_n] = tags[cap : cap + n_n].clone()
            tags[cap:] = -1
            _set_count(layer, adapter, N_STATIC, n_s + n_n)
            _set_count(layer, adapter, N_NEW, 0)


def _output(out: Any) -> torch.Tensor:
    return getattr(out, "logits", out)


def distill_loss(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, top_logits: Optional[int] = None
) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` over the teacher's top logits (METHODS.md).

    Args:
        student: (..., C) student logits.
        teacher: (..., C) teacher logits.
        temperature: Softening temperature ``T`` > 0.
        top_logits: Keep only the teacher's ``top_logits`` largest logits (both sides); ``None``: all.
    """
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature!r}")
    student = student.float().reshape(-1, student.shape[-1])
    teacher = teacher.float().reshape(-1, teacher.shape[-1])
    finite = torch.isfinite(teacher).all(-1)
    student, teacher = student[finite], teacher[finite]
    if top_logits is not None and top_logits < teacher.shape[-1]:
        idx = teacher.topk(top_logits, dim=-1).indices
        student, teacher = student.gather(-1, idx), teacher.gather(-1, idx)
    log_p_t = F.log_softmax(teacher / temperature, dim=-1)
    log_p_s = F.log_softmax(student / temperature, dim=-1)
    return temperature**2 * F.kl_div(log_p_s, log_p_t, log_target=True, reduction="batchmean")


@dataclass
class IntegrateResult:
    """What one integration did.

    Args:
        kl_before: Mean teacher-student distillation loss right after compression.
        kl_after: The same after distillation.
        steps: Optimizer steps taken.
        task_draws: With task routing, how many steps each stored task was drawn for (task order).
        task_weights: With task routing, the final sampling weights ``sqrt(last loss + 1e-4)`` per task.
    """

    kl_before: float
    kl_after: float
    steps: int
    task_draws: Optional[list[int]] = None
    task_weights: Optional[list[float]] = None


def _student_parameters(model: nn.Module, adapter: str) -> list[nn.Parameter]:
    params = []
    for layers in group_layers(model, adapter).values():
        for layer in layers:
            for store in (layer.pclr_A, layer.pclr_B, layer.pclr_shared_A, layer.pclr_shared_B):
                if adapter in store:
                    params.append(store[adapter])
    return params


@contextmanager
def _student(model: nn.Module, adapter: str, lr: float) -> Iterator[Optional[torch.optim.Optimizer]]:
    """Make the student (surviving new ranks, shared LoRA, keys) trainable for the block; ``None`` if it is empty."""
    params = _student_parameters(model, adapter)
    keys = [layers[0].pclr_keys[adapter] for layers in group_layers(model, adapter).values()]
    trainable = params + keys
    flags = [p.requires_grad for p in trainable]
    was_training = model.training
    if not params:
        yield None
        return
    for p in trainable:
        p.requires_grad_(True)
    model.train()
    try:
        yield torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    finally:
        model.train(was_training)
        for p, flag in zip(trainable, flags):
            p.requires_grad_(flag)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    extra = query_loss(model)
    if extra is not None:
        loss = loss + extra
    if not torch.isfinite(loss):
        raise FloatingPointError(
            f"non-finite PCLR distillation loss {float(loss)} during integration; the pool is left as compressed "
            "(lower integrate_lr or check the teacher's outputs for inf/nan)"
        )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    # the distillation does not run through the DDP wrapper: average the gradients over the processes as DDP would
    average_gradients(p for group in optimizer.param_groups for p in group["params"])
    optimizer.step()


def _masked_distill(
    student: Any, target: torch.Tensor, mask: Optional[torch.Tensor], temperature: float, top_logits: Optional[int]
) -> torch.Tensor:
    student = _output(student)
    if mask is not None:
        student, target = student[..., mask], target[..., mask]
    return distill_loss(student, target, temperature, top_logits)


@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block, the previous mode restored after it."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def _mean_distill_loss(
    model: nn.Module,
    forward: Callable[[nn.Module, Batch], Any],
    items: Sequence[tuple[Batch, torch.Tensor, Optional[torch.Tensor]]],
    mask: Optional[torch.Tensor],
    temperature: float,
    top_logits: Optional[int],
) -> float:
    """Mean distillation loss in eval mode over ``(batch, teacher output, prototype to route as or None)``."""
    total = 0.0
    with _evaluating(model):
        for batch, target, proto in items:
            with routed_as(model, proto) if proto is not None else nullcontext():
                total += float(_masked_distill(forward(model, batch), target, mask, temperature, top_logits))
    return total / max(len(items), 1)


@torch.no_grad()
def teacher_outputs(
    model: nn.Module, batches: Sequence[Batch], forward: Optional[Callable[[nn.Module, Batch], Any]] = None
) -> list[torch.Tensor]:
    """The model's outputs (logits) on ``batches`` in eval mode: the teacher for :func:`integrate`.

    Args:
        model: The model (before compression).
        batches: Input batches.
        forward: ``forward(model, batch) -> output``; default ``model(**batch without labels)``.
    """
    forward = forward or _default_forward
    with _evaluating(model):
        return [_output(forward(model, batch)).detach() for batch in batches]


def _default_forward(model: nn.Module, batch: Batch) -> Any:
    return model(**{k: v for k, v in batch.items() if k != "labels"})


def integrate(
    model: nn.Module,
    batches: Sequence[Batch],
    teacher: Sequence[torch.Tensor],
    adapter: str = "default",
    epochs: int = 1,
    lr: float = 1e-3,
    temperature: float = 2.0,
    top_logits: Optional[int] = None,
    forward: Optional[Callable[[nn.Module, Batch], Any]] = None,
    mask: Optional[torch.Tensor] = None,
) -> IntegrateResult:
    """Distill the uncompressed pool (``teacher`` outputs) into the compressed pool plus the shared LoRA.

    Each sample is routed by its own query. The student's trainable parameters are the task's surviving new ranks
    and the shared LoRA: older static ranks stay frozen because the distillation data is the current task's only
    (public code does the same; tuning old ranks on new data would move old tasks' outputs). Keys keep learning
    through the query loss. :func:`integrate_over_tasks` is the public code's task-routed variant.

    Args:
        model: The compressed model.
        batches: The current task's input batches.
        teacher: The uncompressed model's outputs on ``batches`` (:func:`teacher_outputs`).
        adapter: The adapter.
        epochs: Passes over ``batches``.
        lr: AdamW learning rate.
        temperature: Distillation temperature.
        top_logits: Distill only the teacher's top logits (METHODS.md); ``None``: all.
        forward: ``forward(model, batch) -> output``; default ``model(**batch without labels)``.
        mask: Optional (C,) bool mask of logits that take part (e.g. the task's classes).

    Returns:
        The distillation loss before and after, and the number of steps.
    """
    if len(batches) != len(teacher):
        raise ValueError(f"got {len(batches)} batches but {len(teacher)} teacher outputs")
    forward = forward or _default_forward
    items = [(batch, target, None) for batch, target in zip(batches, teacher)]

    def mean_loss() -> float:
        return _mean_distill_loss(model, forward, items, mask, temperature, top_logits)

    before = mean_loss()
    steps = 0
    if epochs > 0:
        with _student(model, adapter, lr) as optimizer:
            if optimizer is not None:
                for _ in range(epochs):
                    for batch, target in zip(batches, teacher):
                        loss = _masked_distill(forward(model, batch), target, mask, temperature, top_logits)
                        _step(model, optimizer, loss)
                        steps += 1
    return IntegrateResult(before, mean_loss(), steps)


def integrate_over_tasks(
    model: nn.Module,
    batches: Sequence[Batch],
    teacher: PoolSnapshot,
    adapter: str = "default",
    epochs: int = 1,
    lr: float = 1e-3,
    temperature: float = 2.0,
    top_logits: Optional[int] = None,
    forward: Optional[Callable[[nn.Module, Batch], Any]] = None,
    mask: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> IntegrateResult:
    """Distill the uncompressed pool into the compressed one with every batch routed as one stored task.

    The public code's integration: for each step a stored task ``t`` is drawn with probability proportional to
    ``w_t``, teacher (the snapshot of the uncompressed pool) and student both route the whole batch as ``t``
    (:func:`routed_as`), and after the step ``w_t = sqrt(max(loss, 0) + 1e-4)`` (all ``w`` start at 1). So the
    student learns to reproduce every task's routing of the pool from the current task's inputs alone, and the
    tasks it reproduces worst are drawn most. Routed as an old task, the student can only change the shared LoRA
    (old static ranks stay frozen; the new ranks are excluded by prototype routing): it learns to make up for what
    compression removed from the old tasks.

    Args:
        model: The compressed model, the current task's prototype already stored.
        batches: The current task's input batches.
        teacher: A :class:`PoolSnapshot` taken before compression.
        adapter: The adapter.
        epochs: Passes over ``batches`` (one task draw per batch).
        lr: AdamW learning rate.
        temperature: Distillation temperature.
        top_logits: Distill only the teacher's top logits; ``None``: all.
        forward: ``forward(model, batch) -> output``; default ``model(**batch without labels)``.
        mask: Optional (C,) bool mask of logits that take part (e.g. the classes seen so far).
        generator: Random generator for the task draws (reproducible runs).

    Returns:
        Distillation loss before and after over the batches (batch ``i`` routed as task ``i mod T``), the steps, how
        often each task was drawn and the final sampling weights.
    """
    forward = forward or _default_forward
    protos = stored_prototypes(model, adapter)
    n_tasks = protos.shape[0]
    if n_tasks == 0:
        raise ValueError("no task prototype is stored; end_task stores the current one before integrating")

    @torch.no_grad()
    def teacher_on(batch: Batch, task: int) -> torch.Tensor:
        with _evaluating(model), teacher.active(), routed_as(model, protos[task]):
            return _output(forward(model, batch)).detach()

    # fixed (batch, task) pairs for the before/after figures: every batch once, tasks in turn
    items = [(batch, teacher_on(batch, i % n_tasks), protos[i % n_tasks]) for i, batch in enumerate(batches)]

    def mean_loss() -> float:
        return _mean_distill_loss(model, forward, items, mask, temperature, top_logits)

    before = mean_loss()
    weights = torch.ones(n_tasks, dtype=torch.float64)
    draws = [0] * n_tasks
    steps = 0
    if epochs > 0:
        with _student(model, adapter, lr) as optimizer:
            if optimizer is not None:
                for _ in range(epochs):
                    for batch in batches:
                        draw = torch.multinomial(weights / weights.sum(), 1, generator=generator)
                        broadcast_([draw])  # one draw for all processes (their generators may differ)
                        task = int(draw)
                        target = teacher_on(batch, task)
                        with routed_as(model, protos[task]):
                            loss = _masked_distill(forward(model, batch), target, mask, temperature, top_logits)
                            _step(model, optimizer, loss)
                        last = loss.detach().double().reshape(1)
                        all_reduce_([last], mean=True)
                        weights[task] = math.sqrt(max(float(last), 0.0) + 1e-4)
                        draws[task] += 1
                        steps += 1
    return IntegrateResult(before, mean_loss(), steps, draws, weights.tolist())


@torch.no_grad()
def pull_keys_to_prototypes(
    model: nn.Module, adapter: str = "default", threshold: float = 0.8, strength: float = 0.5
) -> int:
    """Pull every static key that is close to several task prototypes toward all of them (merging similar tasks).

    ``k <- normalize((1 - strength) k + strength * mean_{p: cos(k, p) >= threshold} p)`` for keys with at least two
    such prototypes (METHODS.md: "keys close to several similar tasks' prototypes are pulled toward all of them").
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
        n_s, _, n_protos, _ = owner.counts(adapter)
        if n_protos < 2 or n_s == 0:
            continue
        keys = owner.pclr_keys_static[adapter][:n_s]
        protos = owner.pclr_prototypes[adapter][:n_protos].to(keys.dtype)
        close = (F.normalize(keys, dim=-1) @ protos.mT) >= threshold  # (n_s, T)
        several = close.sum(1) >= 2
        if not several.any():
            continue
        target = (close.to(keys.dtype) @ protos) / close.sum(1, keepdim=True).clamp_min(1).to(keys.dtype)
        pulled = F.normalize((1 - strength) * F.normalize(keys, dim=-1) + strength * target, dim=-1)
        keys[several] = pulled[several]
        moved += int(several.sum())
    return moved


def end_task(
    model: nn.Module,
    task_id: int,
    prototype: torch.Tensor,
    batches: Sequence[Batch] = (),
    adapter: str = "default",
    integrate_epochs: int = 1,
    integrate_lr: float = 1e-3,
    temperature: float = 2.0,
    top_logits: Optional[int] = None,
    forward: Optional[Callable[[nn.Module, Batch], Any]] = None,
    mask: Optional[torch.Tensor] = None,
    key_pull_threshold: float = 0.8,
    key_pull_strength: float = 0.5,
    integrate_routing: str = "input",
    generator: Optional[torch.Generator] = None,
) -> Optional[IntegrateResult]:
    """Finish task ``task_id``: store its prototype, compress + integrate if scheduled, fold the new ranks, pull keys.

    The number of ranks dropped is ``round(compress_ratio_after(task_id) * active ranks)``, raised if needed so the
    next task's new ranks fit within ``pool_size``.

    Args:
        model: The PCLR model.
        task_id: The task that just finished training.
        prototype: (query_dim,) its query prototype.
        batches: The task's data for integration (empty: compress without integrating).
        adapter: The adapter.
        integrate_epochs: Distillation passes over ``batches`` (0: no integration).
        integrate_lr: Distillation learning rate.
        temperature: Distillation temperature.
        top_logits: Distill only the teacher's top logits.
        forward: ``forward(model, batch) -> output``; default ``model(**batch without labels)``.
        mask: Optional bool mask of the logits that take part in distillation.
        key_pull_threshold: Cosine for "close to a prototype" in :func:`pull_keys_to_prototypes`.
        key_pull_strength: How far keys move toward the prototypes.
        integrate_routing: ``"input"`` (:func:`integrate`: each sample routed by its own query) or ``"tasks"``
            (:func:`integrate_over_tasks`: each batch routed as a stored task drawn by ``sqrt`` of its last loss).
        generator: Random generator for the task draws of ``"tasks"`` routing.

    Returns:
        The integration result, or ``None`` when nothing was compressed or integrated.
    """
    if integrate_routing not in INTEGRATE_ROUTING:
        raise ValueError(f"`integrate_routing` must be one of {INTEGRATE_ROUTING}, got {integrate_routing!r}")
    config = _config(model, adapter)
    if config.compress_rule == "contribution" and not batches:
        raise ValueError("compress_rule='contribution' measures the ranks on the task's data: pass `batches`")
    groups = group_layers(model, adapter)
    first = next(iter(groups.values()))[0]
    current = first.counts(adapter)[TASK]
    if task_id != current:
        raise ValueError(f"end_task({task_id}) but the adapter is learning task {current}")
    if task_id >= config.max_tasks:
        raise ValueError(f"task {task_id} exceeds max_tasks={config.max_tasks} stored prototypes; raise max_tasks")
    proto = F.normalize(prototype.detach().float().flatten(), dim=0)
    with torch.no_grad():
        for layers in groups.values():
            owner = layers[0]
            owner.pclr_prototypes[adapter][task_id] = proto.to(owner.pclr_prototypes[adapter])
            for layer in layers:
                _set_count(layer, adapter, N_PROTOS, task_id + 1)
    n_active = max(sum(layer.counts(adapter)[:2]) for layers in groups.values() for layer in layers)
    n_drop = round(config.compress_ratio_after(task_id) * n_active)
    n_drop = max(n_drop, n_active + config.ranks_for_task(task_id + 1) - config.pool_size)
    result = None
    if n_drop > 0:
        integrating = bool(batches) and integrate_epochs > 0
        teacher: Any = None
        if integrating:
            teacher = (
                PoolSnapshot(model, adapter)
                if integrate_routing == "tasks"
                else teacher_outputs(model, batches, forward)
            )
        scores = (
            contribution_scores(model, batches, adapter, forward) if config.compress_rule == "contribution" else None
        )
        compress(model, n_drop, adapter=adapter, scores=scores)
        if integrating:
            distill = integrate_over_tasks if integrate_routing == "tasks" else integrate
            extra = {"generator": generator} if integrate_routing == "tasks" else {}
            result = distill(
                model,
                batches,
                teacher,
                adapter,
                integrate_epochs,
                integrate_lr,
                temperature,
                top_logits,
                forward,
                mask,
                **extra,
            )
    _fold(model, adapter)
    pull_keys_to_prototypes(model, adapter, key_pull_threshold, key_pull_strength)
    with torch.no_grad():
        for layers in groups.values():
            for layer in layers:
                _set_count(layer, adapter, TASK, task_id + 1)
    return result
