"""What a continual-learning run shares with its methods and drivers: the training settings and the run context.

:class:`RunContext` is the public surface a method plugin uses to touch data and the task loss: the batches of a
task (collated, on the run's device), the logit masks of training and evaluation, the masked cross-entropy. The
free functions below are the same operations for callers without a context (evaluation, the drivers).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import nn

from ..data.tasks import Example, TaskSequence
from ..fingerprint import added_later, not_a_setting

__all__ = [
    "LR_SCHEDULES",
    "TRAIN_MASKS",
    "Collate",
    "RunContext",
    "TrainConfig",
    "class_mask",
    "count_params",
    "eval_classes",
    "lr_factor",
    "masked_cross_entropy",
    "model_logits",
    "split_batches",
    "to_device",
    "training_classes",
]

Collate = Callable[[Sequence[Example]], dict[str, Any]]
TRAIN_MASKS = ("task", "seen", "all")
LR_SCHEDULES = ("constant", "linear", "cosine")
SHARDINGS = ("none", "fsdp2")


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
        sharding: With several processes (torchrun / accelerate launch): ``"none"`` (each process holds the whole
            model, gradients are averaged: DDP) or ``"fsdp2"`` (parameters, gradients and optimizer state sharded
            with FSDP2 while a method trains, :mod:`peft_ext.continual.sharding`). Ignored on one process.
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
    progress: bool = not_a_setting(True)
    sharding: Literal["none", "fsdp2"] = added_later("none")

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
        if self.sharding not in SHARDINGS:
            raise ValueError(f"`sharding` must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"`device` must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def split_batches(
    examples: Sequence[Example], batch_size: int, rng: Optional[random.Random] = None
) -> list[list[Example]]:
    """``examples`` cut into batches of ``batch_size`` (the last may be smaller), shuffled first by ``rng`` if given.

    Args:
        examples: The data.
        batch_size: Examples per batch.
        rng: Shuffles the order (one ``rng.shuffle`` call per split, so a seeded run draws the same orders).
    """
    order = list(range(len(examples)))
    if rng is not None:
        rng.shuffle(order)
    return [[examples[k] for k in order[s : s + batch_size]] for s in range(0, len(order), batch_size)]


def _length(inputs: Any) -> int:
    if isinstance(inputs, str):
        return len(inputs)
    if isinstance(inputs, (tuple, list)) and all(isinstance(x, str) for x in inputs):
        return sum(map(len, inputs))
    ids = getattr(inputs, "input_ids", None)
    return len(ids) if ids is not None else 0


def length_order(examples: Sequence[Example]) -> list[int]:
    """The positions of ``examples`` in :func:`by_length`'s order."""
    return sorted(range(len(examples)), key=lambda i: _length(examples[i].inputs))


def by_length(examples: Sequence[Example]) -> list[Example]:
    """``examples`` shortest first (characters of a text or texts, tokens of a tokenized example; other inputs keep
    their order): for passes that score each example on its own (evaluation, a head's statistics), batches of similar
    lengths pad less, which cuts a forward pass over text of varied lengths by about 40 % (MiniLM on WordNet
    glosses). The sort is stable, so equal lengths keep their order."""
    return [examples[i] for i in length_order(examples)]


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``batch`` with every tensor moved to ``device`` (other values as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def model_logits(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The logits of ``model`` on ``batch`` (every key but ``labels`` goes to the forward; ``.logits`` if present)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out


def class_mask(num_classes: int, allowed: Sequence[int], device: torch.device) -> torch.Tensor:
    """Boolean ``(num_classes,)`` mask, True at ``allowed``."""
    mask = torch.zeros(num_classes, dtype=torch.bool, device=device)
    mask[list(allowed)] = True
    return mask


def masked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy over the logits that ``mask`` allows (the others set to ``-inf``); returns ``(loss, logits)``.

    Args:
        logits: ``(batch, num_classes)``.
        labels: ``(batch,)`` class indices.
        mask: Boolean ``(num_classes,)`` mask, or ``None`` for every class.
    """
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return nn.functional.cross_entropy(logits, labels), logits


def count_params(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts of ``model``."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def training_classes(sequence: TaskSequence, task_id: int, train_logit_mask: str) -> Optional[list[int]]:
    """Classes whose logits the training loss of task ``task_id`` sees (``None``: all), per ``train_logit_mask``.

    Task-incremental runs always train on the task's own classes.
    """
    if sequence.protocol == "task-incremental" or train_logit_mask == "task":
        return list(sequence.tasks[task_id].classes)
    if train_logit_mask == "seen":
        return sequence.classes_seen(task_id)
    return None


def eval_classes(sequence: TaskSequence, trained_upto: int, task_id: int) -> list[int]:
    """Classes the model may predict on task ``task_id``'s test set after training tasks ``0..trained_upto``.

    Class-incremental: every class seen so far; task-incremental: task ``task_id``'s classes (its id is known).
    """
    if sequence.protocol == "task-incremental":
        return list(sequence.tasks[task_id].classes)
    return sequence.classes_seen(trained_upto)


@dataclass
class RunContext:
    """What a method's hooks see of the run: the sequence, the training settings, the collate and the device (what
    the method keeps across tasks is its own :attr:`~peft_ext.continual.ContinualMethod.state`).

    Args:
        sequence: The task sequence.
        train: The training settings.
        collate: Turns a list of examples into a batch dict with ``labels``.
        device: The device the model runs on.
        frozen_features: Where the features of a frozen backbone are kept for later passes over the same examples
            (:class:`~peft_ext.continual.heads.frozen.FrozenFeatures`; set for methods that train nothing), or
            ``None``.
    """

    sequence: TaskSequence
    train: TrainConfig
    collate: Collate
    device: torch.device
    frozen_features: Optional[Any] = None  # a FrozenFeatures (heads/frozen.py imports this module)

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` on the run's device."""
        return to_device(batch, self.device)

    def iter_batches(
        self,
        examples: Sequence[Example],
        batch_size: Optional[int] = None,
        rng: Optional[random.Random] = None,
        limit: Optional[int] = None,
    ) -> Iterator[dict[str, Any]]:
        """Collated batches of ``examples`` on the run's device, one at a time.

        Args:
            examples: The data (e.g. ``task.train``).
            batch_size: Examples per batch (default: ``train.batch_size``).
            rng: Shuffles the order first (default: the given order).
            limit: Stop after this many batches (the order is still drawn over all of them).
        """
        chunks = split_batches(examples, batch_size or self.train.batch_size, rng)
        for chunk in chunks if limit is None else chunks[:limit]:
            yield self.to_device(self.collate(chunk))

    def class_mask(self, allowed: Sequence[int]) -> torch.Tensor:
        """Boolean mask over the sequence's classes, True at ``allowed``, on the run's device."""
        return class_mask(self.sequence.num_classes, allowed, self.device)

    def training_classes(self, task_id: int) -> Optional[list[int]]:
        """Classes the training loss of task ``task_id`` sees (``None``: all), per ``train.train_logit_mask``."""
        return training_classes(self.sequence, task_id, self.train.train_logit_mask)

    def eval_classes(self, trained_upto: int, task_id: int) -> list[int]:
        """Classes predicted on task ``task_id``'s test set after training up to task ``trained_upto``."""
        return eval_classes(self.sequence, trained_upto, task_id)

    def task_loss(self, model: nn.Module, batch: dict[str, Any], task_id: int) -> torch.Tensor:
        """The runner's training loss on ``batch`` of task ``task_id``: cross-entropy under the task's logit mask.

        Args:
            model: The model.
            batch: A collated batch with ``labels``, on the run's device.
            task_id: The task.
        """
        allowed = self.training_classes(task_id)
        mask = None if allowed is None else self.class_mask(allowed)
        return masked_cross_entropy(model_logits(model, batch), batch["labels"], mask)[0]
