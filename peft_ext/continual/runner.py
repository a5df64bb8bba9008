"""Train a model through a task sequence with a method plugin and record the accuracy matrix.

After training task ``i`` the runner evaluates on the test sets of every task ``j <= i`` and stores the accuracy in
``R[i][j]``. Class-incremental evaluation scores against every class seen so far; task-incremental evaluation
restricts the prediction to task ``j``'s classes (the task id is known at test time). The phases are
:class:`~peft_ext.continual.engine.ContinualEngine`'s; this module supplies the plain training loop.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ..data.tasks import Example, TaskSequence
from .context import Collate, RunContext, TrainConfig, lr_factor
from .engine import ContinualEngine, MethodResult, Phase, RunRecord, TaskTrainer, trainable_parameters, training_loss
from .methods import ContinualMethod
from .progress import TaskProgress

__all__ = ["LoopTrainer", "run_sequence", "train_examples"]


def train_examples(
    model: nn.Module,
    method: ContinualMethod,
    examples: Sequence[Example],
    allowed_classes: Optional[Sequence[int]],
    task_id: int,
    ctx: RunContext,
    desc: str = "train",
) -> float:
    """Train ``model`` on ``examples`` with the method's optimizer; return the mean training loss.

    Args:
        model: The model.
        method: The method plugin (its parameters, optimizer and ``extra_loss``).
        examples: The training data.
        allowed_classes: Classes whose logits the loss sees (``None``: all).
        task_id: The task (seeds the data order: ``train.seed * 1000 + task_id``).
        ctx: The run context.
        desc: Progress-bar label.
    """
    cfg = ctx.train
    params = trainable_parameters(method, model)
    optimizer = method.make_optimizer(model, params)
    mask = None if allowed_classes is None else ctx.class_mask(allowed_classes)
    rng = random.Random(cfg.seed * 1000 + task_id)
    model.train()
    total, steps = 0.0, 0
    n_batches = math.ceil(len(examples) / cfg.batch_size) * cfg.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, n_batches, cfg.lr_schedule, cfg.warmup_ratio)
    )
    bar = tqdm(total=n_batches, desc=desc, disable=not cfg.progress, leave=False)
    for _ in range(cfg.epochs):
        for batch in ctx.iter_batches(examples, cfg.batch_size, rng):
            loss, _ = training_loss(model, method, batch, task_id, mask)
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


class LoopTrainer(TaskTrainer):
    """Trains each phase with :func:`train_examples` (the runner's own loop); saves a snapshot after each phase when
    given a :class:`~peft_ext.continual.progress.TaskProgress`."""

    def __init__(self, method: ContinualMethod, ctx: RunContext, progress: Optional[TaskProgress] = None) -> None:
        self.method = method
        self.ctx = ctx
        self.progress = progress

    def train(self, model: nn.Module, phase: Phase) -> float:
        return train_examples(
            model, self.method, phase.task.train, phase.allowed_classes, phase.task_id, self.ctx, desc=phase.desc
        )

    def phase_done(self, model: nn.Module, phase: Phase, record: RunRecord) -> None:
        if self.progress is not None:
            self.progress.save(model, self.ctx.state, record)


def run_sequence(
    sequence: TaskSequence,
    method: ContinualMethod,
    base_model: nn.Module,
    collate: Collate,
    train: Optional[TrainConfig] = None,
    progress: Optional[TaskProgress] = None,
) -> MethodResult:
    """Run ``method`` through ``sequence`` starting from a deep copy of ``base_model``.

    With ``progress`` the run saves a snapshot after every task and, when ``progress`` already holds some, continues
    after the last finished task: the model, the method's state and the random generators are restored, so the
    result equals an uninterrupted run's (timings aside).

    Args:
        sequence: The tasks, in order.
        method: The method plugin.
        base_model: A model whose forward takes ``collate``'s output (minus ``labels``) and returns logits over all
            ``sequence.num_classes`` classes. It is copied, never modified.
        collate: Turns a list of examples into a batch dict with a ``labels`` tensor.
        train: Training settings (defaults: :class:`TrainConfig`).
        progress: Where end-of-task snapshots go and a resumed run reads them (``None``: none are taken).

    Returns:
        The accuracy matrix, the metrics and the cost of the run.
    """
    engine = ContinualEngine(sequence, method, collate, train or TrainConfig())
    model = engine.build(base_model)
    record = RunRecord.empty(len(sequence))
    if progress is not None:
        record = progress.record(len(sequence))
        progress.restore(model, engine.ctx.state, record)
    model = engine.run(model, LoopTrainer(method, engine.ctx, progress), record)
    return engine.result(model, record)
