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
so a rank is dropped from the whole group). ``benchmarks/pclr.py`` compares the two.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn

from .config import COMPRESS_RULES, PCLRConfig
from .layer import N_NEW, N_PROTOS, N_STATIC, TASK, PCLRLayer
from .model import PCLRModel

__all__ = [
    "IntegrateResult",
    "begin_task",
    "compress",
    "distill_loss",
    "end_task",
    "group_layers",
    "importance_scores",
    "integrate",
    "pool_in_use",
    "pull_keys_to_prototypes",
    "query_loss",
    "query_prototype",
    "teacher_outputs",
]

Batch = dict[str, Any]


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


def query_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """The weighted query-key loss ``w * mean(1 - cos(q, k))`` of the last forward pass (``None``: nothing to train).

    Add it to the task loss after each training forward; it is what trains the keys (METHODS.md: not the gate).
    """
    return _tuner(model).query_loss()


@torch.no_grad()
def query_prototype(model: nn.Module, batches: Sequence[Batch]) -> torch.Tensor:
    """The task's prototype: the normalized mean of the per-sample queries over ``batches`` (no forward pass needed).

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
    return count


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


def _drop_indices(rule: str, n_active: int, n_drop: int, scores: Optional[torch.Tensor]) -> list[int]:
    if rule == "index":
        # Public code: drop every s-th rank (s = 4 drops 25 %); s is chosen so that at least n_drop are candidates.
        s = max(1, n_active // n_drop)
        return list(range(s - 1, n_active, s))[:n_drop]
    return sorted(scores.topk(n_drop, largest=False).indices.tolist())


@torch.no_grad()
def compress(
    model: nn.Module,
    n_drop: int,
    rule: Optional[str] = None,
    adapter: str = "default",
    only_static: bool = False,
) -> dict[str, list[int]]:
    """Drop ``n_drop`` ranks from every layer group (static and new ranks together), compacting the survivors.

    Args:
        model: The PCLR model.
        n_drop: Ranks to drop per group.
        rule: ``"index"`` or ``"importance"`` (default: the config's ``compress_rule``).
        adapter: The adapter.
        only_static: Drop among the static ranks only (making room for a new task).

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
        scores = importance_scores(layers, adapter)[:n_active] if rule == "importance" else None
        drop = _drop_indices(rule, n_active, k, scores)
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
    """

    kl_before: float
    kl_after: float
    steps: int


def _student_parameters(model: nn.Module, adapter: str) -> list[nn.Parameter]:
    params = []
    for layers in group_layers(model, adapter).values():
        for layer in layers:
            for store in (layer.pclr_A, layer.pclr_B, layer.pclr_shared_A, layer.pclr_shared_B):
                if adapter in store:
                    params.append(store[adapter])
    return params


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
    was_training = model.training
    model.eval()
    try:
        return [_output(forward(model, batch)).detach() for batch in batches]
    finally:
        model.train(was_training)


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

    The student's trainable parameters are the task's surviving new ranks and the shared LoRA: older static ranks
    stay frozen because the distillation data is the current task's only (public code does the same; tuning old
    ranks on new data would move old tasks' outputs). Keys keep learning through the query loss.

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
    params = _student_parameters(model, adapter)
    keys = [layers[0].pclr_keys[adapter] for layers in group_layers(model, adapter).values()]
    trainable = params + keys
    flags = [p.requires_grad for p in trainable]

    def loss_on(batch: Batch, target: torch.Tensor) -> torch.Tensor:
        student = _output(forward(model, batch))
        if mask is not None:
            student, target = student[..., mask], target[..., mask]
        return distill_loss(student, target, temperature, top_logits)

    def mean_loss() -> float:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            value = sum(float(loss_on(b, t)) for b, t in zip(batches, teacher)) / max(len(batches), 1)
        model.train(was_training)
        return value

    before = mean_loss()
    steps = 0
    if epochs > 0 and params:
        for p in trainable:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
        was_training = model.training
        model.train()
        try:
            for _ in range(epochs):
                for batch, target in zip(batches, teacher):
                    loss = loss_on(batch, target)
                    extra = query_loss(model)
                    if extra is not None:
                        loss = loss + extra
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    steps += 1
        finally:
            model.train(was_training)
            for p, flag in zip(trainable, flags):
                p.requires_grad_(flag)
    return IntegrateResult(before, mean_loss(), steps)


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

    Returns:
        The integration result, or ``None`` when nothing was compressed or integrated.
    """
    config = _config(model, adapter)
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
        teacher = teacher_outputs(model, batches, forward) if integrating else []
        compress(model, n_drop, adapter=adapter)
        if integrating:
            result = integrate(
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
            )
    _fold(model, adapter)
    pull_keys_to_prototypes(model, adapter, key_pull_threshold, key_pull_strength)
    with torch.no_grad():
        for layers in groups.values():
            for layer in layers:
                _set_count(layer, adapter, TASK, task_id + 1)
    return result
