"""Task sequences for continual learning.

A :class:`TaskSequence` is an ordered list of :class:`Task` objects over one global label space. Labels are
global integer ids (``class_names[label]``), so class-incremental evaluation can score a prediction against every
class seen so far, and task-incremental evaluation can restrict it to one task's classes.

A sequence of ``kind="generation"`` holds instruction tasks instead (:mod:`.instruct`): every example's ``inputs`` is
an :class:`Instruction` (prompt and answer text), trained with a next-token loss on the answer and scored by exact
match of the generated answer. Its label is the id of the task's one class, the task's instruction family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

PROTOCOLS = ("class-incremental", "task-incremental")
Protocol = Literal["class-incremental", "task-incremental"]
#: What a task's test examples can be scored by (:attr:`Task.metric`).
TASK_METRICS = ("accuracy", "exact_match", "rouge_l")
Kind = Literal["classification", "generation"]


@dataclass(frozen=True)
class SequenceKind:
    """What the examples of one kind of task sequence are: the data's side of a kind (what a run does with it is
    :mod:`peft_ext.continual.task_kinds`' side).

    Args:
        name: The kind's name (:attr:`TaskSequence.kind`).
        holds_instructions: Its examples carry an :class:`Instruction` (prompt and answer, for a causal LM) instead
            of an input with a class label.
    """

    name: str
    holds_instructions: bool


#: The kinds of task sequence by name.
SEQUENCE_KINDS: dict[str, SequenceKind] = {
    kind.name: kind for kind in (SequenceKind("classification", False), SequenceKind("generation", True))
}
KINDS = tuple(SEQUENCE_KINDS)


@dataclass(frozen=True)
class Example:
    """One labelled example: ``inputs`` is whatever the model's collate function takes (a string for text)."""

    inputs: Any
    label: int


@dataclass(frozen=True)
class Instruction:
    """The ``inputs`` of an example of a generation task: an instruction prompt and the answer it must produce.

    Args:
        prompt: The instruction text the model sees.
        answer: The text the model must generate (non-empty; exact match scores it).
    """

    prompt: str
    answer: str

    def __post_init__(self) -> None:
        for name in ("prompt", "answer"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Instruction `{name}` must be a str, got {type(getattr(self, name)).__name__}")
        if not self.answer:
            raise ValueError(
                f"Instruction for prompt {self.prompt!r} has an empty `answer`; a generation task needs at least one "
                "answer character (the loss and the exact match have nothing to score otherwise)"
            )


@dataclass
class Task:
    """One task of a sequence.

    Args:
        name: Human-readable task name, e.g. ``"t0:noun.animal+verb.motion"``.
        classes: Global label ids this task introduces, in a fixed order.
        train: Training examples (labels are global ids, all in ``classes``).
        test: Test examples (labels are global ids, all in ``classes``).
        validation: Held-out examples for choosing hyperparameters, disjoint from both (may be empty).
        metric: What scores the task's test examples in the accuracy matrix: ``"accuracy"`` (classification), or for
            a generation task ``"exact_match"`` (an answer that is a label or a word) or ``"rouge_l"`` (an answer that
            is a sentence: ROUGE-L F1 of the greedy answer). Default: ``"accuracy"`` for classification examples,
            ``"exact_match"`` for instructions.
    """

    name: str
    classes: list[int]
    train: list[Example]
    test: list[Example]
    validation: list[Example] = field(default_factory=list)
    metric: str | None = None

    def __post_init__(self) -> None:
        if self.metric is None:
            first = next(iter(self.train + self.test + self.validation), None)
            self.metric = "exact_match" if first is not None and isinstance(first.inputs, Instruction) else "accuracy"
        if self.metric not in TASK_METRICS:
            raise ValueError(f"Task {self.name!r}: `metric` must be one of {list(TASK_METRICS)}, got {self.metric!r}")
        allowed = set(self.classes)
        if len(allowed) != len(self.classes):
            raise ValueError(f"Task {self.name!r} lists a class twice: {self.classes}")
        for split, examples in (("train", self.train), ("test", self.test), ("validation", self.validation)):
            bad = {ex.label for ex in examples} - allowed
            if bad:
                raise ValueError(
                    f"Task {self.name!r} has {split} labels {sorted(bad)} outside its classes {self.classes}"
                )


@dataclass
class TaskSequence:
    """An ordered sequence of tasks with disjoint class sets over one global label space.

    Args:
        name: Sequence name (recorded in results).
        class_names: ``class_names[i]`` is the name of global label ``i``.
        tasks: The tasks, in training order.
        protocol: ``"class-incremental"`` (one head, no task id at test time: predictions range over every class
            seen so far) or ``"task-incremental"`` (the task id is known at test time: predictions range over that
            task's classes only).
        meta: Free-form provenance (data set, seed, caps) recorded in results.
        kind: ``"classification"`` (examples carry a class label, scored by accuracy) or ``"generation"`` (examples
            carry an :class:`Instruction`, scored by exact match of the generated answer).
        held_out_text: ``generation``: plain text no task trains on; a run reports the model's per-token perplexity
            on it before and after the sequence (what tuning cost its general ability). Empty: not measured.
    """

    name: str
    class_names: list[str]
    tasks: list[Task]
    protocol: Protocol = "class-incremental"
    meta: dict[str, Any] = field(default_factory=dict)
    kind: Kind = "classification"
    held_out_text: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"`protocol` must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {self.kind!r}")
        if self.holds_instructions:
            for task in self.tasks:
                bad = next(
                    (ex for ex in task.train + task.test + task.validation if not isinstance(ex.inputs, Instruction)),
                    None,
                )
                if bad is not None:
                    raise TypeError(
                        f"task {task.name!r} of generation sequence {self.name!r} has an example whose inputs are a "
                        f"{type(bad.inputs).__name__}; generation examples carry an Instruction(prompt, answer)"
                    )
        if not self.tasks:
            raise ValueError(f"Task sequence {self.name!r} has no tasks")
        seen: set[int] = set()
        for task in self.tasks:
            overlap = seen & set(task.classes)
            if overlap:
                raise ValueError(f"Task {task.name!r} repeats classes {sorted(overlap)} of an earlier task")
            seen |= set(task.classes)
            if max(task.classes) >= len(self.class_names) or min(task.classes) < 0:
                raise ValueError(f"Task {task.name!r} has class ids outside 0..{len(self.class_names) - 1}")

    def __len__(self) -> int:
        return len(self.tasks)

    @property
    def holds_instructions(self) -> bool:
        """Its examples carry an :class:`Instruction` (its kind's :attr:`SequenceKind.holds_instructions`)."""
        return SEQUENCE_KINDS[self.kind].holds_instructions

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def evaluated_on(self, split: Literal["test", "validation"]) -> TaskSequence:
        """This sequence scored on ``split``: a copy whose tasks' ``test`` examples are that split's (the same
        training data). ``evaluated_on("validation")`` is what hyperparameter searches run on, so the test split is
        never looked at while choosing.

        Raises:
            ValueError: ``split`` is unknown, or a task has no examples in it.
        """
        if split == "test":
            return self
        if split != "validation":
            raise ValueError(f"`split` must be 'test' or 'validation', got {split!r}")
        empty = [t.name for t in self.tasks if not t.validation]
        if empty:
            raise ValueError(
                f"tasks {empty} of {self.name!r} have no validation examples; build the sequence with a validation "
                "split (e.g. wordnet_task_sequence(val_per_class=...))"
            )
        tasks = [Task(t.name, list(t.classes), list(t.train), list(t.validation), [], t.metric) for t in self.tasks]
        meta = {**self.meta, "evaluated_on": "validation"}
        name = f"{self.name}-validation"
        return TaskSequence(name, list(self.class_names), tasks, self.protocol, meta, self.kind, self.held_out_text)

    def classes_seen(self, upto: int) -> list[int]:
        """Global ids of the classes of tasks ``0..upto`` (inclusive)."""
        return [c for task in self.tasks[: upto + 1] for c in task.classes]
