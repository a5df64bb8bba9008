"""The task sequence a continual job's ``data`` section describes, and the lines that say what it is."""

from __future__ import annotations

from typing import Any

from ..continual.config import RunConfig, causal_collate, separator_id  # noqa: F401 (re-exported)
from ..continual.task_kinds import task_kind
from ..data import SHIPPED, SHIPPED_INSTRUCTIONS
from ..data.tasks import TaskSequence

__all__ = ["CLASS_SEQUENCE_KEYS", "build_sequence", "causal_collate", "separator_id", "sequence_summary"]


#: The ``data`` keys every class-incremental sequence (a shipped data set or your files) is built from.
CLASS_SEQUENCE_KEYS = (
    "n_tasks",
    "classes_per_task",
    "classes",
    "seed",
    "train_per_class",
    "test_per_class",
    "protocol",
)


def _keys(section: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """``{name: section.name}`` for ``names``."""
    return {name: getattr(section, name) for name in names}


def build_sequence(config: RunConfig, tokenizer: Any = None) -> TaskSequence:
    """The task sequence the config's ``data`` section describes (``tokenizer``: renders conversational instruction
    rows with its chat template)."""
    data = config.data
    if data.dataset == "instructions":
        from ..data.user_instructions import instruction_sequence_from_files

        return instruction_sequence_from_files(
            data.tasks,
            None if data.tasks is not None else data.train,
            task_column=data.task_column,
            tokenizer=tokenizer,
            test_share=data.test_share,
            validation_share=data.validation_share,
            seed=data.seed,
            name=config.name,
        )
    if data.dataset in SHIPPED_INSTRUCTIONS:  # instruct: instruction tasks of the shipped files
        from ..data.instruct_tasks import shipped_instruction_sequence

        sizes = {key: getattr(data, key) for key in data.PER_TASK if getattr(data, key) is not None}
        return shipped_instruction_sequence(data.tasks, seed=data.seed, **sizes)
    if data.dataset in SHIPPED:  # wordnet, fortunes: files that ship with the package
        return SHIPPED[data.dataset].task_sequence(
            **_keys(data, CLASS_SEQUENCE_KEYS), val_per_class=data.val_per_class or 0
        )
    if data.dataset == "files":
        from ..data.user_data import file_task_sequence

        return file_task_sequence(
            data.train,
            data.test,
            data.validation,
            **_keys(data, (*CLASS_SEQUENCE_KEYS, "text_column", "label_column", "task_column", "test_share")),
            validation_share=data.validation_share,
            name=config.name,
        )
    raise ValueError(f"unknown dataset {data.dataset!r}")  # unreachable: the config checks the name


def sequence_summary(name: str, sequence: TaskSequence) -> list[str]:
    """The lines that say what a job's task sequence is: tasks, classes, examples per split, then each task's name
    (``peft-ext run`` prints them when it starts, ``peft-ext check`` when the config is valid)."""
    count = {split: sum(len(getattr(t, split)) for t in sequence.tasks) for split in ("train", "validation", "test")}
    how = task_kind(sequence).describe(sequence)
    head = (
        f"{name}: {sequence.name} ({how}), {len(sequence)} tasks, {sequence.num_classes} classes, "
        f"{count['train']} train / "
        + (f"{count['validation']} validation / " if count["validation"] else "")
        + f"{count['test']} test examples"
    )
    return [head, *(f"  t{i}: {task.name}" for i, task in enumerate(sequence.tasks))]
