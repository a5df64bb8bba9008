"""Train a model through a task sequence with a method plugin and record the accuracy matrix.

After training task ``i`` the runner evaluates on the test sets of every task ``j <= i`` and stores the accuracy in
``R[i][j]``. Class-incremental evaluation scores against every class seen so far; task-incremental evaluation
restricts the prediction to task ``j``'s classes (the task id is known at test time).
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from .methods import ContinualMethod
from .metrics import summarize
from .tasks import Example, Task, TaskSequence

Collate = Callable[[Sequence[Example]], dict[str, Any]]
TRAIN_MASKS = ("task", "seen", "all")
LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, total: int, schedule: str, warmup_ratio: float) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based) of ``total``: linear warmup, then the schedule."""
    warmup = int(warmup_ratio * total)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(total - warmup, 1)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainConfig:
    """How each task is trained and evaluated.

    Args:
        epochs: Passes over each task's training data (the joint method makes the same number of passes over the
            union).
        batch_size: Training batch size.
        eval_batch_size: Evaluation batch size.
        max_grad_norm: Gradient-norm clipping (0 disables).
        train_logit_mask: Which logits the training loss sees in class-incremental runs: ``"task"`` (the current
            task's classes; the usual choice for a shared head, it keeps old classes' logits from being pushed
            down), ``"seen"`` (all classes so far) or ``"all"``.
        lr_schedule: Per-task learning-rate schedule: ``"constant"``, ``"linear"`` (decay to 0) or ``"cosine"``.
        warmup_ratio: Fraction of each task's steps with linear warmup from 0.
        seed: Seed for the head initialization and the data order; every method of a run uses the same one.
        device: ``"cpu"``, ``"cuda"``, or ``"auto"`` (CUDA when available).
        progress: Show tqdm progress bars.
    """

    epochs: int = 1
    batch_size: int = 32
    eval_batch_size: int = 128
    max_grad_norm: float = 1.0
    train_logit_mask: Literal["task", "seen", "all"] = "task"
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_ratio: float = 0.0
    seed: int = 0
    device: str = "auto"
    progress: bool = True

    def validate(self) -> None:
        for key in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"`{key}` must be a positive integer, got {getattr(self, key)}")
        if self.max_grad_norm < 0:
            raise ValueError(f"`max_grad_norm` must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"`warmup_ratio` must be in [0, 1), got {self.warmup_ratio}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"`lr_schedule` must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.train_logit_mask not in TRAIN_MASKS:
            raise ValueError(f"`train_logit_mask` must be one of {TRAIN_MASKS}, got {self.train_logit_mask!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"`device` must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class RunContext:
    """What a method sees of the run: the sequence, the training settings, and a scratch dict for its own state."""

    sequence: TaskSequence
    train: TrainConfig
    collate: Collate
    device: torch.device
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class MethodResult:
    """One method's run: ``accuracy_matrix[i][j]`` (None where undefined), metrics, cost."""

    method: str
    label: str
    accuracy_matrix: list[list[float | None]]
    metrics: dict[str, float | None]
    trainable_params: int
    total_params: int
    train_seconds: float
    eval_seconds: float
    task_losses: list[float]
    extras: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _class_mask(num_classes: int, allowed: Sequence[int], device: torch.device) -> torch.Tensor:
    mask = torch.zeros(num_classes, dtype=torch.bool, device=device)
    mask[list(allowed)] = True
    return mask


def _batches(examples: Sequence[Example], batch_size: int, rng: random.Random | None) -> list[list[Example]]:
    order = list(range(len(examples)))
    if rng is not None:
        rng.shuffle(order)
    return [[examples[k] for k in order[s : s + batch_size]] for s in range(0, len(order), batch_size)]


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _logits(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def evaluate(
    model: nn.Module,
    examples: Sequence[Example],
    allowed_classes: Sequence[int],
    num_classes: int,
    collate: Collate,
    device: torch.device,
    batch_size: int = 128,
    progress: bool = False,
    desc: str = "eval",
) -> float:
    """Accuracy of ``model`` on ``examples`` when it may only predict ``allowed_classes``."""
    if not examples:
        raise ValueError("cannot evaluate on an empty test set")
    was_training = model.training
    model.eval()
    mask = _class_mask(num_classes, allowed_classes, device)
    correct = 0
    for batch in tqdm(_batches(examples, batch_size, None), desc=desc, disable=not progress, leave=False):
        batch = _to_device(collate(batch), device)
        logits = _logits(model, batch).masked_fill(~mask, float("-inf"))
        correct += (logits.argmax(-1) == batch["labels"]).sum().item()
    model.train(was_training)
    return correct / len(examples)


def train_examples(
    model: nn.Module,
    method: ContinualMethod,
    examples: Sequence[Example],
    allowed_classes: Sequence[int] | None,
    task_id: int,
    ctx: RunContext,
    desc: str = "train",
) -> float:
    """Train ``model`` on ``examples`` with the method's optimizer; return the mean training loss."""
    cfg = ctx.train
    params = method.trainable_parameters(model)
    if not params:
        raise ValueError(f"method {method.name!r} left no trainable parameters")
    optimizer = method.make_optimizer(model, params)
    num_classes = ctx.sequence.num_classes
    mask = None if allowed_classes is None else _class_mask(num_classes, allowed_classes, ctx.device)
    rng = random.Random(cfg.seed * 1000 + task_id)
    model.train()
    total, steps = 0.0, 0
    n_batches = math.ceil(len(examples) / cfg.batch_size) * cfg.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, n_batches, cfg.lr_schedule, cfg.warmup_ratio)
    )
    bar = tqdm(total=n_batches, desc=desc, disable=not cfg.progress, leave=False)
    for _ in range(cfg.epochs):
        for batch in _batches(examples, cfg.batch_size, rng):
            batch = _to_device(ctx.collate(batch), ctx.device)
            logits = _logits(model, batch)
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            loss = nn.functional.cross_entropy(logits, batch["labels"])
            extra = method.extra_loss(model, batch, task_id)
            if extra is not None:
                loss = loss + extra
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite training loss {loss.item()} at task {task_id}, step {steps}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            total += loss.item()
            steps += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    return total / max(steps, 1)


def _allowed_for_training(sequence: TaskSequence, task_id: int, cfg: TrainConfig) -> list[int] | None:
    if sequence.protocol == "task-incremental" or cfg.train_logit_mask == "task":
        return list(sequence.tasks[task_id].classes)
    if cfg.train_logit_mask == "seen":
        return sequence.classes_seen(task_id)
    return None


def _allowed_for_eval(sequence: TaskSequence, trained_upto: int, task_id: int) -> list[int]:
    if sequence.protocol == "task-incremental":
        return list(sequence.tasks[task_id].classes)
    return sequence.classes_seen(trained_upto)


def _count_params(model: nn.Module) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def run_sequence(
    sequence: TaskSequence,
    method: ContinualMethod,
    base_model: nn.Module,
    collate: Collate,
    train: TrainConfig | None = None,
) -> MethodResult:
    """Run ``method`` through ``sequence`` starting from a deep copy of ``base_model``.

    Args:
        sequence: The tasks, in order.
        method: The method plugin.
        base_model: A model whose forward takes ``collate``'s output (minus ``labels``) and returns logits over all
            ``sequence.num_classes`` classes. It is copied, never modified.
        collate: Turns a list of examples into a batch dict with a ``labels`` tensor.
        train: Training settings (defaults: :class:`TrainConfig`).

    Returns:
        The accuracy matrix, the metrics and the cost of the run.
    """
    train = train or TrainConfig()
    train.validate()
    device = train.resolve_device()
    ctx = RunContext(sequence=sequence, train=train, collate=collate, device=device)
    torch.manual_seed(train.seed)
    model = method.build(copy.deepcopy(base_model), ctx).to(device)
    T = len(sequence)
    R: list[list[float | None]] = [[None] * T for _ in range(T)]
    losses: list[float] = []
    train_s = eval_s = 0.0

    def eval_row(i: int) -> None:
        nonlocal eval_s
        start = time.perf_counter()
        for j in range(i + 1):
            allowed = _allowed_for_eval(sequence, i, j)
            R[i][j] = evaluate(
                model,
                sequence.tasks[j].test,
                allowed,
                sequence.num_classes,
                collate,
                device,
                batch_size=train.eval_batch_size,
                progress=train.progress,
                desc=f"{method.label} eval t{j}",
            )
        eval_s += time.perf_counter() - start

    if method.joint:
        union = Task(
            name="joint",
            classes=sequence.classes_seen(T - 1),
            train=[ex for task in sequence.tasks for ex in task.train],
            test=[],
        )
        start = time.perf_counter()
        model = method.before_task(model, 0, union, ctx)
        allowed = None if train.train_logit_mask == "all" else union.classes
        losses.append(train_examples(model, method, union.train, allowed, 0, ctx, desc=f"{method.label} joint"))
        model = method.after_task(model, 0, union, ctx)
        train_s += time.perf_counter() - start
        eval_row(T - 1)
        # Only the last row exists: forgetting and transfer are undefined for a model trained once.
        metrics: dict[str, float | None] = {
            "final_acc": sum(R[T - 1]) / T,
            "avg_incremental_acc": None,
            "bwt": None,
            "forgetting": None,
        }
    else:
        for i, task in enumerate(sequence.tasks):
            start = time.perf_counter()
            model = method.before_task(model, i, task, ctx)
            allowed = _allowed_for_training(sequence, i, train)
            losses.append(
                train_examples(model, method, task.train, allowed, i, ctx, desc=f"{method.label} {task.name}")
            )
            model = method.after_task(model, i, task, ctx)
            train_s += time.perf_counter() - start
            eval_row(i)
        metrics = dict(summarize([[0.0 if x is None else x for x in row] for row in R]))
    trainable, total = _count_params(model)
    return MethodResult(
        method=method.name,
        label=method.label,
        accuracy_matrix=R,
        metrics=metrics,
        trainable_params=trainable,
        total_params=total,
        train_seconds=train_s,
        eval_seconds=eval_s,
        task_losses=losses,
        extras=method.report(ctx),
    )
