"""The task loop of a continual-learning run, shared by every driver.

:class:`ContinualEngine` owns the phases of a task sequence: the method's ``before_task``, training the task, the
method's ``after_task``, the evaluation row ``R[i][j]`` (accuracy on task ``j``'s test set after training task
``i``), the joint branch (one phase over the union of all tasks, evaluated as the last row), the metrics and the
:class:`MethodResult`. A ``kind="generation"`` sequence (instruction tasks) trains on the next-token loss of the
answers and fills ``R[i][j]`` with exact match of greedy generation (:mod:`.generation`). How a task is trained is
pluggable: a driver passes a :class:`TaskTrainer` (:func:`~peft_ext.continual.run_sequence` trains with its own
loop, the Trainer driver of :mod:`peft_ext.integrations.continual_trainer` with ``transformers.Trainer`` and
checkpoints).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

import torch
from torch import nn

from ..data.tasks import Task, TaskSequence
from .context import (
    Collate,
    RunContext,
    TrainConfig,
    count_params,
    model_logits,
)
from .generation import require_causal_collate, text_perplexity
from .heads import ContinualHead, build_head
from .heads.base import learn_heads
from .heads.frozen import FrozenFeatures
from .methods import CONTINUAL_METHODS, ContinualMethod
from .metrics import summarize
from .task_kinds import check_heads, task_kind

__all__ = [
    "ContinualEngine",
    "MethodResult",
    "Phase",
    "RunRecord",
    "TaskTrainer",
    "trainable_parameters",
    "training_loss",
]


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
    task_losses: list[Optional[float]]
    extras: dict[str, Any] = field(default_factory=dict)
    #: Of ``train_seconds``, the time the heads spent reading features and solving.
    head_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunRecord:
    """The progress of a run: phases finished, the accuracy matrix and losses so far, time spent (JSON-friendly).

    Args:
        accuracy_matrix: ``R[i][j]``, ``None`` where not (yet) evaluated.
        completed: Phases finished (trained, folded and evaluated).
        task_losses: Mean training loss of each finished phase (``None`` for a phase the method did not train).
        train_seconds: Time in ``before_task``, training, ``after_task`` and the head's pass.
        eval_seconds: Time evaluating.
        scores: Further score matrices by name, like ``accuracy_matrix`` (a generation sequence: ``rouge_l`` and
            ``answer_loss``, the answers' per-token loss; ``head:<name>`` for each of ``compare_heads``).
        head_seconds: Of ``train_seconds``, the time the heads spent reading features and solving.
    """

    accuracy_matrix: list[list[Optional[float]]]
    completed: int = 0
    task_losses: list[Optional[float]] = field(default_factory=list)
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    scores: dict[str, list[list[Optional[float]]]] = field(default_factory=dict)
    head_seconds: float = 0.0

    @classmethod
    def empty(cls, num_tasks: int) -> RunRecord:
        return cls(accuracy_matrix=[[None] * num_tasks for _ in range(num_tasks)])

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> RunRecord:
        """The record of a saved ``asdict`` (fields added since it was written keep their defaults)."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})


@dataclass
class Phase:
    """One trained phase: a task of the sequence, or the union of all of them for a joint method.

    Args:
        task_id: Index given to the method's hooks and the training step.
        task: The data trained on.
        allowed_classes: Classes whose logits the training loss sees (``None``: all).
        row: Row of the accuracy matrix evaluated after the phase.
        desc: Progress-bar label.
    """

    task_id: int
    task: Task
    allowed_classes: Optional[list[int]]
    row: int
    desc: str


class TaskTrainer:
    """How the engine trains one phase; drivers subclass it (only :meth:`train` is required)."""

    def prepare(self, phase: Phase) -> None:
        """Called before the method's ``before_task`` (e.g. to seed the RNGs a resumed run must replay)."""

    def train(self, model: nn.Module, phase: Phase) -> float:
        """Train ``model`` on ``phase.task``; return the mean training loss."""
        raise NotImplementedError

    def finish(self, model: nn.Module, phase: Phase) -> None:
        """Called after training and before the method's ``after_task``."""

    def phase_done(self, model: nn.Module, phase: Phase, record: RunRecord) -> None:
        """Called once the phase is evaluated and recorded (log it, save a snapshot)."""


def trainable_parameters(method: ContinualMethod, model: nn.Module, ctx: RunContext) -> list[nn.Parameter]:
    """``method.trainable_parameters(model, ctx)``, refusing an empty list (nothing would train)."""
    params = method.trainable_parameters(model, ctx)
    if not params:
        raise ValueError(f"method {method.name!r} left no trainable parameters")
    return params


def training_loss(
    model: nn.Module,
    method: ContinualMethod,
    batch: dict[str, Any],
    task_id: int,
    mask: Optional[torch.Tensor],
    ctx: RunContext,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss every driver trains on: masked cross-entropy plus the method's ``extra_loss``.

    The sequence's task kind computes the loss (:meth:`.task_kinds.TaskKind.loss`): a generation sequence's is
    :func:`~.generation.next_token_loss` (cross-entropy on the answer tokens, labels -100 elsewhere) and ``mask``
    must be ``None``.

    Args:
        model: The model.
        method: The method plugin.
        batch: A collated batch with ``labels``, on the model's device.
        task_id: The task being trained.
        mask: Boolean mask of the logits the loss sees (``None``: all).
        ctx: The run context (passed to ``extra_loss``).

    Returns:
        ``(loss, masked logits)``.

    Raises:
        FloatingPointError: If the loss is not finite.
    """
    # the sequence's kind says what the loss is (classification: masked cross-entropy; generation: the answers')
    loss, logits = task_kind(ctx.sequence).loss(model_logits(model, batch), batch["labels"], mask)
    extra = method.extra_loss(model, batch, task_id, ctx)
    if extra is not None:
        loss = loss + extra
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite training loss {loss.item()} at task {task_id}")
    return loss, logits


#: The base model's held-out perplexity, by (model, texts, collate): every method of a job starts from the same base.
_BASE_PERPLEXITY: dict[tuple[int, int, int], tuple[nn.Module, float]] = {}


def base_perplexity(base_model: nn.Module, texts: list[str], ctx: RunContext) -> float:
    """:func:`~.generation.text_perplexity` of ``base_model`` on ``texts``, computed once per base model, texts and
    collate of a process (the methods of a job share them)."""
    key = (id(base_model), hash(tuple(texts)), id(ctx.collate))
    cached = _BASE_PERPLEXITY.get(key)
    if cached is not None and cached[0] is base_model:
        return cached[1]
    on_device = all(p.device == ctx.device for p in base_model.parameters())
    model = base_model if on_device else copy.deepcopy(base_model).to(ctx.device)  # the job's base stays where it is
    value = text_perplexity(model, texts, require_causal_collate(ctx.collate), ctx.device, ctx.train.eval_batch_size)
    _BASE_PERPLEXITY.clear()  # one base at a time: the entry holds the model alive
    _BASE_PERPLEXITY[key] = (base_model, value)
    return value


class ContinualEngine:
    """The phases of one method's run through a task sequence.

    Args:
        sequence: The tasks, in order.
        method: The method plugin.
        collate: Turns a list of examples into a batch dict with a ``labels`` tensor (for a generation sequence a
            :class:`~peft_ext.data.collate.CausalLMCollator`).
        train: Training settings (validated here).
        device: The device (default: ``train.resolve_device()``).

    Raises:
        ValueError: The method does not support the sequence's ``kind``.
        TypeError: A generation sequence with a collate that is not a ``CausalLMCollator``.
    """

    def __init__(
        self,
        sequence: TaskSequence,
        method: ContinualMethod,
        collate: Collate,
        train: TrainConfig,
        device: Optional[torch.device] = None,
        frozen_features: Optional[FrozenFeatures] = None,
    ) -> None:
        train.validate()
        if sequence.kind not in method.task_kinds:
            supported = sorted(name for name, cls in CONTINUAL_METHODS.items() if sequence.kind in cls.task_kinds)
            raise ValueError(
                f"method {method.name!r} supports {list(method.task_kinds)} task sequences, not {sequence.kind!r} "
                f"({sequence.name!r}); methods that run {sequence.kind} sequences: {supported}"
            )
        #: What differs for this sequence's kind (classification, generation): :mod:`.task_kinds`.
        self.kind = task_kind(sequence)
        self.kind.check_collate(collate)
        self.sequence = sequence
        self.method = method
        method.load_state_dict({})  # a fresh run: nothing kept from an earlier one
        self.ctx = RunContext(sequence=sequence, train=train, collate=collate, device=device or train.resolve_device())
        if frozen_features is not None and not method.trains:  # its backbone stays as built: features can be kept
            self.ctx.frozen_features = frozen_features
        self.head = build_head(method.head, sequence.num_classes, seed=train.seed)
        #: Per task of the final row, whether the method got each test example right ("0"/"1" per example).
        self.final_hits: dict[int, str] = {}
        #: The further heads scored on the same run (``compare_heads``), by name.
        self.compared = {
            head.name: head
            for head in (
                build_head(spec, sequence.num_classes, seed=train.seed) for spec in method.options.compare_heads
            )
        }
        check_heads(sequence, method, [self.head, *self.compared.values()])

    def build(self, base_model: nn.Module) -> nn.Module:
        """The method's model, built from a deep copy of ``base_model`` under the run's seed, on the run's device (the
        head first shapes the copy's classifier, then the method builds on it)."""
        if self.kind.measures_held_out_text and self.sequence.held_out_text:
            self.base_perplexity = base_perplexity(base_model, self.sequence.held_out_text, self.ctx)
        torch.manual_seed(self.ctx.train.seed)
        model = self.head.attach(copy.deepcopy(base_model))
        model = self.method.build(model, self.ctx).to(self.ctx.device)
        if self.ctx.frozen_features is not None:
            self.ctx.frozen_features.check(model)
        return model

    def phases(self) -> list[Phase]:
        """The phases in order: one per task, or one over the union of all tasks for a joint method."""
        sequence, label = self.sequence, self.method.label
        masks = self.kind.masks_classes  # a generation loss ranges over the vocabulary: no class mask
        if self.method.trains_on_union:
            T = len(sequence)
            union = Task("joint", sequence.classes_seen(T - 1), [ex for t in sequence.tasks for ex in t.train], [])
            allowed = union.classes if masks and self.ctx.train.train_logit_mask != "all" else None
            return [Phase(0, union, allowed, T - 1, f"{label} joint")]
        return [
            Phase(i, task, self.ctx.training_classes(i) if masks else None, i, f"{label} {task.name}")
            for i, task in enumerate(sequence.tasks)
        ]

    def score_row(
        self, model: nn.Module, row: int, first: int = 0, split: str = "test"
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Accuracy (a generation sequence: each task's metric) on the test sets of tasks ``first..row`` after
        training up to phase row ``row``, and the further scores of the row by name (a generation sequence: ``rouge_l``
        and ``answer_loss`` of :func:`~.generation.generation_scores`; none for classification)."""
        ctx = self.ctx
        extra: dict[str, list[float]] = {}
        row_scores = []
        for j in range(first, row + 1):
            options: dict[str, Any] = dict(
                batch_size=ctx.train.eval_batch_size,
                progress=ctx.train.progress,
                desc=f"{self.method.label} {'eval' if split == 'test' else split} t{j}",
            )
            score, scores = self.kind.score_task(self, model, row, j, options, split=split)
            for name, value in scores.items():
                extra.setdefault(name, []).append(value)
            row_scores.append(score)
        return row_scores, extra

    def _feature_heads(self) -> dict[str, ContinualHead]:
        """The heads that learn from features (the model's own classifier keeps its state in the model), by key."""
        heads = {"head": self.head, **self.compared}
        return {key: head for key, head in heads.items() if head.reads_features}

    def learn_heads(self, model: nn.Module, phase: Phase) -> None:
        """Every head that learns from features reads the phase's training data."""
        readers = self._feature_heads()
        if readers:
            learn_heads(list(readers.values()), model, phase.task_id, phase.task, self.ctx)

    def state_dict(self) -> dict[str, Any]:
        """What the run keeps beside the model: the method's state and the feature heads' states (loadable with
        ``torch.load(weights_only=True)``)."""
        return {
            "method": self.method.state_dict(),
            "heads": {key: head.state_dict() for key, head in self._feature_heads().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a resumed run's snapshot).

        A snapshot written before the method and the heads were saved apart holds one mapping, the heads under
        ``"heads"`` beside the method's own keys; it is read as such."""
        if "method" not in state:
            state = {"method": {k: v for k, v in state.items() if k != "heads"}, "heads": state.get("heads", {})}
        self.method.load_state_dict(state["method"])
        for key, head in self._feature_heads().items():
            if key in state["heads"]:
                head.load_state_dict(state["heads"][key])

    def run(self, model: nn.Module, trainer: TaskTrainer, record: RunRecord) -> nn.Module:
        """Run the phases not yet in ``record``; return the final model.

        Args:
            model: The built model (:meth:`build`), with the state after ``record.completed`` phases.
            trainer: Trains each phase.
            record: Progress so far (``RunRecord.empty(len(sequence))`` for a new run), updated in place.
        """
        method, ctx = self.method, self.ctx
        phases = self.phases()
        for phase in phases[record.completed :]:
            start = time.perf_counter()
            trainer.prepare(phase)
            trains = method.trains_task(phase.task_id)
            loss = None
            if trains:
                model = method.before_task(model, phase.task_id, phase.task, ctx)
                self.head.before_task(model, phase.task_id, ctx)
                # what the method trains on: the task's data, or more (replay adds remembered examples)
                train = method.training_examples(phase.task_id, phase.task, ctx)
                trained = phase if train is phase.task.train else self._with_examples(phase, train)
                loss = trainer.train(model, trained)
                trainer.finish(model, phase)
                model = method.after_task(model, phase.task_id, phase.task, ctx)
            head_start = time.perf_counter()
            self.learn_heads(model, phase)
            record.head_seconds += time.perf_counter() - head_start
            record.train_seconds += time.perf_counter() - start
            start = time.perf_counter()
            if self._model_unchanged(trains, record, phase.row):
                # nothing trained and no head learns: the earlier tasks' scores are the previous row's
                scores, extra = self._extend_row(model, record, phase.row)
            else:
                scores, extra = self.score_row(model, phase.row)
            record.accuracy_matrix[phase.row][: phase.row + 1] = scores
            for name, values in extra.items():
                T = len(record.accuracy_matrix)
                record.scores.setdefault(name, [[None] * T for _ in range(T)])[phase.row][: phase.row + 1] = values
            record.eval_seconds += time.perf_counter() - start
            record.task_losses.append(loss)
            record.completed += 1
            if record.completed < len(phases) and trains:
                model = method.between_tasks(model, ctx)
            trainer.phase_done(model, phase, record)
        return model

    @staticmethod
    def _with_examples(phase: Phase, train: list) -> Phase:
        """``phase`` training on ``train`` (its task's examples and others'), their classes added to the task's."""
        extra = sorted({ex.label for ex in train} - set(phase.task.classes))
        task = dataclasses.replace(phase.task, classes=[*phase.task.classes, *extra], train=list(train))
        return dataclasses.replace(phase, task=task)

    def _model_unchanged(self, trained: bool, record: RunRecord, row: int) -> bool:
        """Whether the model and every head score as in row ``row - 1`` (nothing trained, no head learns from
        features, the same classes scored: a generation sequence, whose scores do not depend on the row)."""
        return (
            not trained
            and row > 0
            and not self._feature_heads()
            and self.kind.row_independent_scores
            and record.accuracy_matrix[row - 1][row - 1] is not None
        )

    def _extend_row(self, model: nn.Module, record: RunRecord, row: int) -> tuple[list[float], dict[str, list[float]]]:
        """Row ``row`` of a model that did not change: the previous row's scores and task ``row``'s own."""
        own, own_extra = self.score_row(model, row, first=row)
        extra = {name: [*matrix[row - 1][:row], *own_extra[name]] for name, matrix in record.scores.items()}
        return [*record.accuracy_matrix[row - 1][:row], *own], extra

    def metrics(self, record: RunRecord) -> dict[str, Optional[float]]:
        """Final accuracy, accuracy right after learning each task, average incremental accuracy, backward transfer and
        forgetting of ``record``."""
        return self.matrix_metrics(record.accuracy_matrix)

    def matrix_metrics(self, R: list[list[Optional[float]]]) -> dict[str, Optional[float]]:
        """:meth:`metrics` of one accuracy matrix ``R``."""
        if self.method.trains_on_union:
            T = len(R)
            # Only the last row exists: forgetting and transfer are undefined for a model trained once.
            return {
                "final_acc": sum(R[T - 1]) / T,
                "learning_acc": None,
                "avg_incremental_acc": None,
                "bwt": None,
                "forgetting": None,
            }
        return dict(summarize([[0.0 if x is None else x for x in row] for row in R]))

    def final_validation(self, model: nn.Module) -> dict[str, Any]:
        """``{"final_validation": {"acc", "per_task", "heads"}}``: the final model's score on every task's validation
        split (with the run's head, and each compared head's under ``heads``), when every task has one: what a choice
        among methods or settings reads instead of the test split (``peft-ext predict`` picks its method by it)."""
        tasks = self.sequence.tasks
        if not self.kind.scores_final_validation or not tasks or not all(task.validation for task in tasks):
            return {}
        per_task, per_head = self.score_row(model, len(tasks) - 1, split="validation")
        heads = {name[len("head:") :]: sum(v) / len(v) for name, v in per_head.items() if name.startswith("head:")}
        out: dict[str, Any] = {"acc": sum(per_task) / len(per_task), "per_task": per_task}
        return {"final_validation": {**out, "heads": heads} if heads else out}

    def result(self, model: nn.Module, record: RunRecord) -> MethodResult:
        """The :class:`MethodResult` of a finished run."""
        start = time.perf_counter()
        validation = self.final_validation(model)
        record.eval_seconds += time.perf_counter() - start
        trainable, total = count_params(model)
        return MethodResult(
            method=self.method.name,
            label=self.method.label,
            accuracy_matrix=record.accuracy_matrix,
            metrics=self.metrics(record),
            trainable_params=trainable,
            total_params=total,
            train_seconds=record.train_seconds,
            eval_seconds=record.eval_seconds,
            task_losses=record.task_losses,
            head_seconds=record.head_seconds,
            extras={
                **self.method.report(self.ctx),
                **self.head_extras(record),
                **{f"{k}_matrix": v for k, v in record.scores.items() if not k.startswith("head:")},
                **self._final_correct(),
                **self._general_ability(model),
                **validation,
            },
        )

    def _general_ability(self, model: nn.Module) -> dict[str, Any]:
        """``{"held_out_perplexity": {"base", "final", "ratio"}}``: the per-token perplexity of the sequence's held-out
        text under the base model and the final one (a generation sequence that has such text)."""
        if getattr(self, "base_perplexity", None) is None:
            return {}
        base = self.base_perplexity
        texts, ctx = self.sequence.held_out_text, self.ctx
        # a method that trains nothing leaves the base model as it was
        final = (
            base
            if not self.method.trains
            else text_perplexity(model, texts, ctx.collate, ctx.device, ctx.train.eval_batch_size)
        )
        return {"held_out_perplexity": {"base": base, "final": final, "ratio": final / base}}

    def _final_correct(self) -> dict[str, Any]:
        """``{"final_correct": [per task, "0"/"1" per test example]}`` of the final row, when every task's was
        recorded (a run resumed after its last task has none)."""
        if not self.kind.records_hits or len(self.final_hits) != len(self.sequence):
            return {}
        return {"final_correct": [self.final_hits[j] for j in sorted(self.final_hits)]}

    def head_extras(self, record: RunRecord) -> dict[str, Any]:
        """The result's figures of the heads: which one scored the matrix and each compared head's matrix and metrics
        (classification sequences only)."""
        if not self.kind.takes_heads:
            return {}
        extras: dict[str, Any] = {"head": {"name": self.head.name, **self.head.describe()}}
        if self.compared:
            extras["heads"] = {
                name: {
                    "accuracy_matrix": record.scores[f"head:{name}"],
                    "metrics": self.matrix_metrics(record.scores[f"head:{name}"]),
                    **head.describe(),
                }
                for name, head in self.compared.items()
            }
        return extras
