"""Train a model through a task sequence with a method plugin and record the accuracy matrix.

After training task ``i`` the runner evaluates on the test sets of every task ``j <= i`` and stores the accuracy in
``R[i][j]``. Class-incremental evaluation scores against every class seen so far; task-incremental evaluation
restricts the prediction to task ``j``'s classes (the task id is known at test time). The phases are
:class:`~peft_ext.continual.engine.ContinualEngine`'s; this module supplies the plain training loop.

Under ``torch.distributed`` with several processes (``torchrun -m peft_ext run``, docs/distributed.md) every process
runs the same engine on the same data; only training is split: each process trains on its share of every batch and
the gradients are averaged, so each step is the whole batch's step. Everything else (the method's hooks, their data
passes, the evaluation) runs whole on every process, which therefore stays identical; after every task the model is
broadcast from rank 0 as a guard, and rank 0 alone writes the snapshots (:func:`on_rank_zero`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..data.tasks import Example, TaskSequence
from ..distributed import (
    all_reduce_,
    average_gradients,
    on_rank_zero,
    raise_shared,
    rank,
    share_random_state,
    sync_model,
    world_size,
)
from .context import Collate, RunContext, TrainConfig, lr_factor, split_batches
from .engine import ContinualEngine, MethodResult, Phase, RunRecord, TaskTrainer, trainable_parameters, training_loss
from .heads.frozen import FrozenFeatures
from .methods import ContinualMethod
from .progress import TaskProgress
from .sharding import fsdp2_units, is_sharded, shard_model, whole_state_dict

if TYPE_CHECKING:
    from .heads.base import ContinualHead

__all__ = ["LoopTrainer", "run_sequence", "train_examples"]


def _share(examples: list[Example], where: int, world: int) -> list[Example]:
    # contiguous shares whose sizes differ by at most one (torch.tensor_split's rule)
    size, extra = divmod(len(examples), world)
    start = where * size + min(where, extra)
    return examples[start : start + size + (where < extra)]


def _shared_backward(
    model: nn.Module,
    method: ContinualMethod,
    batch: list[Example],
    task_id: int,
    mask: Optional[torch.Tensor],
    ctx: RunContext,
) -> float:
    """Backward of this process's share of ``batch``; returns the loss of the whole batch (the same on every rank).

    Each process's loss is weighted by ``world * share / len(batch)`` before the backward, so the average of the
    processes' gradients (:func:`~peft_ext.distributed.average_gradients`, run by the caller) is the gradient of the
    whole batch's mean loss plus the method's ``extra_loss``, even when the shares differ by one example.
    """
    world = world_size()
    share = _share(batch, rank(), world)
    weight = len(share) / len(batch)
    local, error = 0.0, None
    try:
        if share:
            loss, _ = training_loss(model, method, ctx.to_device(ctx.collate(share)), task_id, mask, ctx)
            (loss * (world * weight)).backward()
            local = loss.item() * weight
    except Exception as err:  # every process must learn of it, or the others wait in the next collective forever
        error = err
    status = torch.tensor([local, float(error is not None)], dtype=torch.float64)
    all_reduce_([status])
    if status[1].item() > 0:
        messages: list[Optional[str]] = [None] * world
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
        raise_shared(error, messages)
    return status[0].item()


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

    Under ``torch.distributed`` with several processes, each one trains on its share of every batch (the batches are
    drawn in the same seeded order everywhere) and the gradients are averaged before clipping and the step.

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
    params = trainable_parameters(method, model, ctx)
    optimizer = method.make_optimizer(model, params, ctx)
    mask = None if allowed_classes is None else ctx.class_mask(allowed_classes)
    rng = random.Random(cfg.seed * 1000 + task_id)
    model.train()
    total, steps = 0.0, 0
    n_batches = math.ceil(len(examples) / cfg.batch_size) * cfg.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, n_batches, cfg.lr_schedule, cfg.warmup_ratio)
    )
    world = world_size()
    bar = tqdm(total=n_batches, desc=desc, disable=not cfg.progress or rank() != 0, leave=False)
    for _ in range(cfg.epochs):
        for chunk in split_batches(examples, cfg.batch_size, rng):
            optimizer.zero_grad(set_to_none=True)
            if world == 1:
                loss, _ = training_loss(model, method, ctx.to_device(ctx.collate(chunk)), task_id, mask, ctx)
                loss.backward()
                value = loss.item()
            else:
                value = _shared_backward(model, method, chunk, task_id, mask, ctx)
                average_gradients(params)
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            total += value
            steps += 1
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}")
    bar.close()
    return total / max(steps, 1)


class LoopTrainer(TaskTrainer):
    """Trains each phase of ``engine``'s run with :func:`train_examples` (the runner's own loop); saves a snapshot
    (the model and :meth:`ContinualEngine.state_dict`) after each phase when given a
    :class:`~peft_ext.continual.progress.TaskProgress` (rank 0 writes it, the other processes wait).

    Under ``torch.distributed`` it also keeps the processes identical: after training (before the method's
    ``after_task``) they take rank 0's random generators, and after every phase rank 0's model."""

    def __init__(self, engine: ContinualEngine, progress: Optional[TaskProgress] = None) -> None:
        self.engine = engine
        self.method = engine.method
        self.ctx = engine.ctx
        self.progress = progress

    def train(self, model: nn.Module, phase: Phase) -> float:
        if self.shards and not is_sharded(model):
            # before the optimizer is built: fully_shard replaces the parameters with DTensor ones
            shard_model(model, self.ctx.device)
        return train_examples(
            model, self.method, phase.task.train, phase.allowed_classes, phase.task_id, self.ctx, desc=phase.desc
        )

    def finish(self, model: nn.Module, phase: Phase) -> None:
        share_random_state()

    @property
    def shards(self) -> bool:
        """Whether the method's model is sharded with FSDP2 for training: ``train.sharding``, several processes, and a
        method that can train on shards (:attr:`~.methods.ContinualMethod.needs_whole_parameters`)."""
        return self.ctx.train.sharding == "fsdp2" and world_size() > 1 and not self.method.needs_whole_parameters

    def phase_done(self, model: nn.Module, phase: Phase, record: RunRecord) -> None:
        sync_model(model)
        if self.progress is not None:
            progress = self.progress
            # a snapshot holds whole tensors, gathered from the shards by every process
            state = whole_state_dict(model) if is_sharded(model) else model
            on_rank_zero(lambda: progress.save(state, self.engine.state_dict(), record))


def run_sequence(
    sequence: TaskSequence,
    method: ContinualMethod,
    base_model: nn.Module,
    collate: Collate,
    train: Optional[TrainConfig] = None,
    progress: Optional[TaskProgress] = None,
    keep: Optional[Callable[[nn.Module, ContinualHead, MethodResult], Any]] = None,
    frozen_features: Optional[FrozenFeatures] = None,
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
        keep: Called with the final model, the run's head and the result once the run ends (the job saves the
            trained model with it: :func:`peft_ext.continual.trained.save_trained`).
        frozen_features: Where a method that trains nothing keeps its frozen backbone's features, so later passes
            over the same examples (each evaluation row, the next such method of a job on the same ``base_model``)
            read them instead of running the backbone (:class:`~peft_ext.continual.heads.frozen.FrozenFeatures`).

    Returns:
        The accuracy matrix, the metrics and the cost of the run.
    """
    engine = ContinualEngine(sequence, method, collate, train or TrainConfig(), frozen_features=frozen_features)
    model = engine.build(base_model)
    record = RunRecord.empty(len(sequence))
    if progress is not None:
        record = progress.record(len(sequence))
        saved = progress.restore(model, record)
        if saved is not None:
            engine.load_state_dict(saved)
        share_random_state()  # the snapshot holds the generators of rank 0's CUDA device
    trainer = LoopTrainer(engine, progress)
    model = engine.run(model, trainer, record)
    result = engine.result(model, record)
    if trainer.shards:
        result.extras["fsdp2_units"] = fsdp2_units(model)
    if keep is not None:
        keep(model, engine.head, result)
    return result
