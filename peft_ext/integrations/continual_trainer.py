"""A continual-learning driver on ``transformers.Trainer``: a task sequence, a method plugin, resumable anywhere.

:func:`run_continual_with_trainer` is :func:`peft_ext.continual.run_sequence` with each task trained by a Trainer
(both drive :class:`~peft_ext.continual.ContinualEngine`; this driver plugs in a Trainer-based training step):
the same :class:`~peft_ext.continual.ContinualMethod` plugins (``build``, ``before_task``, ``trainable_parameters``,
``make_optimizer``, ``extra_loss``, ``after_task``, ``report``), the same class-incremental logit masks and the same
accuracy matrix, logged through ``trainer.log`` (``continual/acc_{i}_{j}`` after task ``i``, and the four metrics at
the end). Batch size, epochs, gradient clipping, schedule, checkpointing and logging come from ``TrainingArguments``.

Layout of ``args.output_dir``::

    continual_state.json      tasks finished, accuracy matrix and losses so far (written atomically)
    task-{i}/checkpoint-{k}/  Trainer checkpoints of task i (pytorch_model.bin: the whole model state dict; optimizer,
                              scheduler, RNG)
    task-{i}/end-of-task.pt   model state and method state after task i was trained, folded and evaluated

Resume (``resume=True``, the default, with the same arguments): the model is rebuilt with ``method.build``, the
state after the last finished task is loaded, the unfinished task restarts with ``before_task`` and its Trainer
resumes from the task's last checkpoint (or from step 0 without one). Every step before that point is deterministic
given the saved state, so the accuracy matrix equals an uninterrupted run's.

Why checkpoints hold the whole ``model.state_dict()`` rather than Trainer's usual adapter save: the method's task
state lives in buffers (SplitLoRA's statistics and folded factors, PCLR's pool) and in the head, and methods such as
SplitLoRA refuse ``save_pretrained`` in some phases; one ``torch.save`` of the state dict, read back with
``weights_only=True``, covers every method whose model structure is fixed after ``build``. It is written under
Trainer's ``WEIGHTS_NAME`` (``pytorch_model.bin``), the file ``Trainer.train(resume_from_checkpoint=...)`` reads into
a model that is not a ``PreTrainedModel``, so the driver needs only Trainer's public ``save_model`` and ``train``.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, set_seed
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import WEIGHTS_NAME

from ..continual.context import Collate, RunContext, TrainConfig, class_mask
from ..continual.engine import (
    ContinualEngine,
    MethodResult,
    Phase,
    RunRecord,
    TaskTrainer,
    trainable_parameters,
    training_loss,
)
from ..continual.methods import ContinualMethod
from ..continual.progress import load_model_state, save_atomic, write_json_atomic
from ..data.tasks import TaskSequence

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = ["ContinualTrainer", "last_complete_checkpoint", "load_model_state", "run_continual_with_trainer"]

STATE_FILE = "continual_state.json"
END_OF_TASK_FILE = "end-of-task.pt"


class ContinualTrainer(Trainer):
    """The Trainer of one task: the method's masked loss plus its regularizer; checkpoints hold the whole model.

    Args:
        method: The method plugin (its :meth:`~ContinualMethod.extra_loss` is added to the loss).
        task_id: Index of the task being trained.
        allowed_classes: Classes whose logits the loss sees (``None``: all).
        num_classes: Size of the label space.
        ctx: The run context (the method's hooks get it).
        *args, **kwargs: As for ``transformers.Trainer``.
    """

    def __init__(
        self,
        *args: Any,
        method: ContinualMethod,
        task_id: int,
        allowed_classes: Optional[Sequence[int]],
        num_classes: int,
        ctx: RunContext,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.method = method
        self.ctx = ctx
        self.task_id = task_id
        self.allowed_classes = None if allowed_classes is None else list(allowed_classes)
        self.num_classes = num_classes

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        mask = None
        if self.allowed_classes is not None:
            mask = class_mask(self.num_classes, self.allowed_classes, inputs["labels"].device)
        loss, logits = training_loss(model, self.method, inputs, self.task_id, mask, self.ctx)
        return (loss, logits) if return_outputs else loss

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Write the whole ``model.state_dict()`` to ``output_dir/pytorch_model.bin`` (atomically).

        Trainer saves each checkpoint through this method, before the optimizer, RNG and ``trainer_state.json``;
        ``train(resume_from_checkpoint=...)`` reads the file back with ``torch.load(weights_only=True)``. Called by
        user code, it also pushes to the Hub when ``args.push_to_hub`` is set, as ``Trainer.save_model`` does.
        """
        if self.args.should_save:
            path = Path(output_dir if output_dir is not None else self.args.output_dir)
            path.mkdir(parents=True, exist_ok=True)
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            save_atomic(state, path / WEIGHTS_NAME)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def last_complete_checkpoint(task_dir: Path) -> Optional[str]:
    """The newest ``checkpoint-{k}`` of ``task_dir`` that was written to the end, or ``None``.

    Trainer writes ``trainer_state.json`` last; a process killed while saving leaves a folder without it, which
    ``get_last_checkpoint`` would still pick.
    """
    if not task_dir.is_dir():
        return None
    steps = []
    for path in task_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        suffix = path.name[len(PREFIX_CHECKPOINT_DIR) + 1 :]
        if suffix.isdigit() and (path / TRAINER_STATE_NAME).is_file() and (path / WEIGHTS_NAME).is_file():
            steps.append((int(suffix), path))
    return str(max(steps)[1]) if steps else None


def _train_config(args: TrainingArguments, train_logit_mask: str) -> TrainConfig:
    """What the method plugins read of the run (``ctx.train``), from the Trainer's arguments."""
    config = TrainConfig(
        epochs=max(1, math.ceil(args.num_train_epochs)),
        batch_size=args.per_device_train_batch_size,
        eval_batch_size=args.per_device_eval_batch_size,
        max_grad_norm=args.max_grad_norm,
        train_logit_mask=train_logit_mask,  # type: ignore[arg-type]
        seed=args.seed,
        device="cpu" if args.device.type == "cpu" else str(args.device),
        progress=not args.disable_tqdm,
    )
    config.validate()
    return config


class _TrainerPhases(TaskTrainer):
    """Trains each phase with a :class:`ContinualTrainer` in ``output_dir/task-{i}``; logs and snapshots each one."""

    def __init__(
        self,
        engine: ContinualEngine,
        args: TrainingArguments,
        callbacks: Optional[list[TrainerCallback]],
        identity: dict[str, Any],
    ) -> None:
        self.engine = engine
        self.args = args
        self.callbacks = callbacks
        self.identity = identity
        self.out = Path(args.output_dir)
        self.trainer: Optional[ContinualTrainer] = None

    def prepare(self, phase: Phase) -> None:
        set_seed(self.args.seed + phase.task_id)  # before_task may draw random numbers; a resume must draw the same

    def train(self, model: nn.Module, phase: Phase) -> float:
        method, ctx = self.engine.method, self.engine.ctx
        params = trainable_parameters(method, model, ctx)
        task_args = copy.deepcopy(self.args)
        task_args.output_dir = str(self.out / f"task-{phase.task_id}")
        task_args.seed = self.args.seed + phase.task_id
        self.trainer = ContinualTrainer(
            model=model,
            args=task_args,
            train_dataset=phase.task.train,
            data_collator=ctx.collate,
            optimizers=(method.make_optimizer(model, params, ctx), None),
            callbacks=self.callbacks,
            method=method,
            task_id=phase.task_id,
            allowed_classes=phase.allowed_classes,
            num_classes=ctx.sequence.num_classes,
            ctx=ctx,
        )
        checkpoint = last_complete_checkpoint(Path(task_args.output_dir))
        if checkpoint is not None:
            # Trainer's resume loads the checkpoint with strict=False; loading it here first resizes the buffers that
            # grew during the sequence and refuses a state that does not fit, so a task never resumes half restored.
            # Trainer's own load then writes the same values again.
            load_model_state(model, torch.load(Path(checkpoint) / WEIGHTS_NAME, weights_only=True))
        output = self.trainer.train(resume_from_checkpoint=checkpoint)
        return output.training_loss

    def finish(self, model: nn.Module, phase: Phase) -> None:
        # A resumed Trainer with nothing left to train does not restore the RNG; after_task may draw from it (PCLR's
        # integration), so it starts from the task's seed either way, in train mode as after a Trainer's last step.
        set_seed(self.args.seed + phase.task_id)
        model.train()

    def phase_done(self, model: nn.Module, phase: Phase, record: RunRecord) -> None:
        row = record.accuracy_matrix[phase.row][: phase.row + 1]
        accuracies = {f"continual/acc_{phase.row}_{j}": acc for j, acc in enumerate(row)}
        self.trainer.log({"continual/task": float(phase.task_id), **accuracies})
        snapshot = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
        snapshot["method_state"] = self.engine.state_dict()
        save_atomic(snapshot, self.out / f"task-{phase.task_id}" / END_OF_TASK_FILE)
        # after the snapshot: the state file never points at a missing one
        write_json_atomic({**self.identity, **asdict(record)}, self.out / STATE_FILE)


def run_continual_with_trainer(
    sequence: TaskSequence,
    method: ContinualMethod,
    base_model: nn.Module,
    collate: Collate,
    args: TrainingArguments,
    *,
    train_logit_mask: Literal["task", "seen", "all"] = "task",
    callbacks: Optional[list[TrainerCallback]] = None,
    resume: bool = True,
) -> tuple[MethodResult, nn.Module]:
    """Train ``method`` through ``sequence`` with one ``Trainer`` per task; resumable from ``args.output_dir``.

    Each task's Trainer gets a copy of ``args`` with ``output_dir = args.output_dir/task-{i}`` and ``seed =
    args.seed + i``; its optimizer is ``method.make_optimizer`` (its learning rate and weight decay are the
    method's; the Trainer adds its scheduler from ``lr_scheduler_type`` and warmup), its loss the cross-entropy on
    ``train_logit_mask``'s logits plus ``method.extra_loss``.

    Args:
        sequence: The tasks, in order.
        method: The method plugin (its ``build`` must fix the model's structure for resuming; see the module doc).
        base_model: The model, as for :func:`~peft_ext.continual.run_sequence`; it is copied, never modified.
        collate: Turns a list of :class:`~peft_ext.continual.Example` into a batch dict with ``labels``.
        args: The Trainer's arguments (``save_strategy``/``save_steps`` set how far an interruption sets it back).
        train_logit_mask: As :attr:`TrainConfig.train_logit_mask`.
        callbacks: Extra ``TrainerCallback`` objects, given to every task's Trainer.
        resume: Continue the run found in ``args.output_dir`` (if any). With ``False`` an existing run there is an
            error.

    Returns:
        ``(result, model)``: the accuracy matrix, metrics and cost (as ``run_sequence``), and the trained model.

    Raises:
        ValueError: If ``args.output_dir`` holds a run of another method or sequence, or one while ``resume`` is off.
    """
    if args.save_only_model:
        raise ValueError("`save_only_model=True` drops the optimizer and RNG state that an exact resume needs")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    engine = ContinualEngine(sequence, method, collate, _train_config(args, train_logit_mask), device=args.device)
    T = len(sequence)
    identity = {"method": method.name, "label": method.label, "sequence": sequence.name, "num_tasks": T}
    record = RunRecord.empty(T)
    state_path = out / STATE_FILE
    if state_path.is_file():
        if not resume:
            raise ValueError(f"{out} already holds a continual run ({STATE_FILE}); pass resume=True or another dir")
        saved = json.loads(state_path.read_text())
        differs = {k: (saved.get(k), v) for k, v in identity.items() if saved.get(k) != v}
        if differs:
            raise ValueError(f"{state_path} belongs to another run; (saved, now) differ in {differs}")
        record = RunRecord.from_dict(saved)

    model = engine.build(base_model)
    if record.completed:
        snapshot = torch.load(out / f"task-{record.completed - 1}" / END_OF_TASK_FILE, weights_only=True)
        load_model_state(model, snapshot["model"])
        engine.load_state_dict(snapshot["method_state"])

    phases = _TrainerPhases(engine, args, callbacks, identity)
    model = engine.run(model, phases, record)
    result = engine.result(model, record)
    if phases.trainer is not None:
        phases.trainer.log({f"continual/{k}": v for k, v in result.metrics.items() if v is not None})
    return result, model
