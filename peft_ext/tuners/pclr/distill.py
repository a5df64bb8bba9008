"""PCLR's integration: distill the uncompressed pool (the teacher) into the compressed pool plus the shared LoRA.

docs/methods.md (PCLR). Two routings of the distillation data (``PCLRCycleConfig.integrate_routing``): ``"input"``
(:func:`integrate`) routes each sample by its own query; ``"tasks"`` (:func:`integrate_over_tasks`, the public code's
scheme) routes each batch as one stored task (its prototype as every sample's query), the task drawn with
probability proportional to ``sqrt(last distillation loss on it)``, so the student learns to reproduce every task's
routing of the pool, and tasks it reproduces worst are revisited most. ``benchmarks/continual_wordnet.py`` compares
them.

The distillation does not run through a DDP wrapper: it steps its own AdamW and averages the gradients over the
processes itself (as DDP would), so every process keeps the same pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed import all_reduce_, average_gradients, broadcast_
from .keys import query_loss, routed_as, task_route
from .pool import PoolSnapshot, group_layers, stored_prototypes

__all__ = [
    "IntegrateOptions",
    "IntegrateResult",
    "KeptOutputs",
    "default_forward",
    "distill_loss",
    "evaluating",
    "integrate",
    "integrate_over_tasks",
    "model_output",
    "teacher_outputs",
]

Batch = dict[str, Any]


def model_output(out: Any) -> torch.Tensor:
    """A model's logits: ``out.logits`` when it has them, else ``out`` itself."""
    return getattr(out, "logits", out)


def distill_loss(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, top_logits: Optional[int] = None
) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` over the teacher's top logits (docs/methods.md
    (PCLR)).

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


@dataclass(frozen=True)
class IntegrateOptions:
    """How :func:`integrate` and :func:`integrate_over_tasks` distill (both take these fields as keywords too).

    Args:
        epochs: Passes over the batches (with task routing, one task draw per batch).
        lr: AdamW learning rate.
        temperature: Distillation temperature.
        top_logits: Distill only the teacher's top logits (docs/methods.md (PCLR)); ``None``: all.
        forward: ``forward(model, batch) -> output``; default ``model(**batch without labels)``.
        mask: Optional (C,) bool mask of logits that take part (e.g. the task's classes, or the classes seen so far).
        measure: Measure the mean distillation loss before and after (two evaluation passes); off: ``None``.
    """

    epochs: int = 1
    lr: float = 1e-3
    temperature: float = 2.0
    top_logits: Optional[int] = None
    forward: Optional[Callable[[nn.Module, Batch], Any]] = None
    mask: Optional[torch.Tensor] = None
    measure: bool = True


@dataclass
class IntegrateResult:
    """What one integration did.

    Args:
        kl_before: Mean teacher-student distillation loss right after compression (``None``: not measured).
        kl_after: The same after distillation (``None``: not measured).
        steps: Optimizer steps taken.
        task_draws: With task routing, how many steps each stored task was drawn for (task order).
        task_weights: With task routing, the final sampling weights ``sqrt(last loss + 1e-4)`` per task.
    """

    kl_before: Optional[float]
    kl_after: Optional[float]
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
def _student(model: nn.Module, adapter: str, opts: IntegrateOptions) -> Iterator[Optional[torch.optim.Optimizer]]:
    """Make the student (surviving new ranks, shared LoRA, keys) trainable for the block and yield its optimizer;
    ``None`` (and nothing changed) if it is empty or there are no epochs to train."""
    if opts.epochs <= 0:
        yield None
        return
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
        yield torch.optim.AdamW(trainable, lr=opts.lr, weight_decay=0.0)
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


def _masked_distill(model: nn.Module, batch: Batch, target: torch.Tensor, opts: IntegrateOptions) -> torch.Tensor:
    """The distillation loss of the model's output on ``batch`` against ``target`` (the teacher's), over the mask."""
    student = model_output(opts.forward(model, batch))
    if opts.mask is not None:
        student, target = student[..., opts.mask], target[..., opts.mask]
    return distill_loss(student, target, opts.temperature, opts.top_logits)


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block, the previous mode restored after it."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def _mean_distill_loss(
    model: nn.Module, items: Sequence[tuple[Batch, torch.Tensor, Optional[torch.Tensor]]], opts: IntegrateOptions
) -> Optional[float]:
    """Mean distillation loss in eval mode over ``(batch, teacher output, prototype to route as or None)``; ``None``
    unless ``opts.measure``."""
    if not opts.measure:
        return None
    total = 0.0
    with evaluating(model):
        for batch, target, proto in items:
            with routed_as(model, proto):
                total += float(_masked_distill(model, batch, target, opts))
    return total / max(len(items), 1)


def _options(options: Optional[IntegrateOptions], overrides: Mapping[str, Any]) -> IntegrateOptions:
    """``options`` (default :class:`IntegrateOptions`) with single fields replaced by ``overrides`` (an unknown name
    raises ``TypeError``) and the default forward filled in."""
    opts = replace(options or IntegrateOptions(), **overrides)
    return opts if opts.forward is not None else replace(opts, forward=default_forward)


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
    forward = forward or default_forward
    with evaluating(model):
        return [model_output(forward(model, batch)).detach() for batch in batches]


def default_forward(model: nn.Module, batch: Batch) -> Any:
    """``model(**batch)`` without the ``labels`` entry: the forward the cycle uses when none is given.

    An encoder-decoder (T5, BART, ...) gets its decoder inputs from the labels instead, as its own forward builds them
    for the loss (``prepare_decoder_input_ids_from_labels``: the labels shifted right after the decoder start token,
    ``-100`` replaced by the pad token), unless the batch has ``decoder_input_ids`` / ``decoder_inputs_embeds``.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    labels = batch.get("labels")
    if labels is not None and "decoder_input_ids" not in inputs and "decoder_inputs_embeds" not in inputs:
        prepare = _decoder_inputs_from_labels(model)
        if prepare is not None:
            inputs["decoder_input_ids"] = prepare(labels=labels)
    return model(**inputs)


def _decoder_inputs_from_labels(model: nn.Module) -> Optional[Callable[..., torch.Tensor]]:
    # the wrapped transformers encoder-decoder's prepare_decoder_input_ids_from_labels, if the model is one
    for module in model.modules():
        if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
            prepare = getattr(module, "prepare_decoder_input_ids_from_labels", None)
            return prepare if callable(prepare) else None
    return None


def integrate(
    model: nn.Module,
    batches: Sequence[Batch],
    teacher: Sequence[torch.Tensor],
    adapter: str = "default",
    *,
    options: Optional[IntegrateOptions] = None,
    **overrides: Any,
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
        options: The distillation's settings; default :class:`IntegrateOptions`.
        **overrides: Single :class:`IntegrateOptions` fields (``epochs=15``, ``lr=1e-2``, ...), applied over
            ``options``.

    Returns:
        The distillation loss before and after, and the number of steps.
    """
    if len(batches) != len(teacher):
        raise ValueError(f"got {len(batches)} batches but {len(teacher)} teacher outputs")
    opts = _options(options, overrides)
    items = [(batch, target, None) for batch, target in zip(batches, teacher)]
    before = _mean_distill_loss(model, items, opts)
    steps = 0
    with _student(model, adapter, opts) as optimizer:
        if optimizer is not None:
            for _ in range(opts.epochs):
                for batch, target in zip(batches, teacher):
                    _step(model, optimizer, _masked_distill(model, batch, target, opts))
                    steps += 1
    return IntegrateResult(before, _mean_distill_loss(model, items, opts), steps)


def integrate_over_tasks(
    model: nn.Module,
    batches: Sequence[Batch],
    teacher: PoolSnapshot,
    adapter: str = "default",
    *,
    options: Optional[IntegrateOptions] = None,
    generator: Optional[torch.Generator] = None,
    route_current_by_input: bool = True,
    known_outputs: Optional[Mapping[tuple[int, int], torch.Tensor]] = None,
    **overrides: Any,
) -> IntegrateResult:
    """Distill the uncompressed pool into the compressed one with every batch routed as one stored task.

    The public code's integration: for each step a stored task ``t`` is drawn with probability proportional to
    ``w_t``, teacher (the snapshot of the uncompressed pool) and student both route the whole batch as ``t``
    (:func:`routed_as`), and after the step ``w_t = sqrt(max(loss, 0) + 1e-4)`` (all ``w`` start at 1). So the
    student learns to reproduce every task's routing of the pool from the current task's inputs alone, and the
    tasks it reproduces worst are drawn most. Routed as an old task, the student can only change the shared LoRA
    (old static ranks stay frozen; the new ranks are excluded by prototype routing): it learns to make up for what
    compression removed from the old tasks. The current task (the last stored prototype; the batches are its data)
    is routed as at inference, each sample by its own query (``route_current_by_input``).

    Args:
        model: The compressed model, the current task's prototype already stored.
        batches: The current task's input batches.
        teacher: A :class:`PoolSnapshot` taken before compression.
        adapter: The adapter.
        options: The distillation's settings (``epochs``: one task draw per batch; with ``measure`` the teacher's
            outputs for the before/after passes are kept for the steps that draw the same pair); default
            :class:`IntegrateOptions`.
        generator: Random generator for the task draws (reproducible runs).
        route_current_by_input: When the draw is the current task (the last stored prototype, whose data the
            batches are), route teacher and student by the samples' own queries, as the task is routed at inference;
            off (the public code): by the prototype, which can select none of the task's own ranks (see
            :func:`~.scoring.contribution_scores`), so the teacher itself would not show what the task learnt.
        known_outputs: Teacher outputs already at hand, by ``(batch index, task)``: the snapshot's outputs on that
            batch routed as that task (``end_task`` keeps them from :func:`~.scoring.contribution_scores`' pass over
            the uncompressed pool); the snapshot runs only for the pairs not among them.
        **overrides: Single :class:`IntegrateOptions` fields (``epochs=2``, ``lr=1e-2``, ...), applied over
            ``options``.

    Returns:
        Distillation loss before and after over the batches (batch ``i`` routed as task ``i mod T``), the steps, how
        often each task was drawn and the final sampling weights.
    """
    opts = _options(options, overrides)
    protos = stored_prototypes(model, adapter)
    n_tasks = protos.shape[0]
    if n_tasks == 0:
        raise ValueError("no task prototype is stored; end_task stores the current one before integrating")

    # The teacher (a fixed snapshot, eval mode) gives the same output for the same (batch, task) pair: the outputs
    # known beforehand and those kept for the before/after figures serve the steps that draw the same pair. Nothing
    # else is kept (a causal LM's outputs over the vocabulary for every pair need not fit).
    kept: dict[tuple[int, int], torch.Tensor] = dict(known_outputs or {})

    def routing(task: int) -> Any:
        return routed_as(model, task_route(protos, task, route_current_by_input))

    @torch.no_grad()
    def teacher_on(index: int, task: int) -> torch.Tensor:
        if (index, task) in kept:
            return kept[(index, task)]
        with evaluating(model), teacher.active(), routing(task):
            return model_output(opts.forward(model, batches[index])).detach()

    # fixed (batch, task) pairs for the before/after figures: every batch once, tasks in turn
    items = []
    if opts.measure:
        for i, batch in enumerate(batches):
            task = i % n_tasks
            kept[(i, task)] = teacher_on(i, task)
            items.append((batch, kept[(i, task)], task_route(protos, task, route_current_by_input)))
    before = _mean_distill_loss(model, items, opts)
    weights = torch.ones(n_tasks, dtype=torch.float64)
    draws = [0] * n_tasks
    steps = 0
    with _student(model, adapter, opts) as optimizer:
        if optimizer is not None:
            for _ in range(opts.epochs):
                for index, batch in enumerate(batches):
                    draw = torch.multinomial(weights / weights.sum(), 1, generator=generator)
                    broadcast_([draw])  # one draw for all processes (their generators may differ)
                    task = int(draw)
                    target = teacher_on(index, task)
                    with routing(task):
                        loss = _masked_distill(model, batch, target, opts)
                        _step(model, optimizer, loss)
                    last = loss.detach().double().reshape(1)
                    all_reduce_([last], mean=True)
                    weights[task] = math.sqrt(max(float(last), 0.0) + 1e-4)
                    draws[task] += 1
                    steps += 1
    return IntegrateResult(before, _mean_distill_loss(model, items, opts), steps, draws, weights.tolist())


class KeptOutputs:
    """Model outputs by ``(batch index, task)``, kept while their total size stays within ``max_bytes`` (a
    classifier's logits always fit; a causal LM's answer logits over its vocabulary for every pair may not).

    Args:
        max_bytes: The budget.
    """

    def __init__(self, max_bytes: int = 256 * 2**20) -> None:
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.room = max_bytes

    def offer(self, index: int, task: int, output: torch.Tensor) -> None:
        size = output.numel() * output.element_size()
        if size <= self.room:
            self.outputs[(index, task)] = output
            self.room -= size

    def batches(self, task: int, count: int) -> Optional[list[torch.Tensor]]:
        """The outputs of batches ``0..count-1`` routed as ``task``, or ``None`` unless all of them are kept."""
        found = [self.outputs.get((index, task)) for index in range(count)]
        return None if any(out is None for out in found) else found
