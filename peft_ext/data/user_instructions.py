"""Instruction (generation) task sequences from a user's files in TRL's dataset formats.

Each row is one of TRL's formats:

- **prompt-completion**: ``{"prompt": "...", "completion": "..."}``;
- **conversational prompt-completion**: ``{"prompt": [messages], "completion": [messages]}``;
- **conversational**: ``{"messages": [{"role": ..., "content": ...}, ...]}``: the last message must be the
  assistant's, it is the answer; everything before it is the prompt.

A conversational prompt is rendered by the tokenizer's chat template with the generation prompt appended
(``apply_chat_template(..., add_generation_prompt=True)``), the same text in training and in generation; the answer is
the assistant's content. Tasks come from one source per task, or from one source and a ``task_column``. Test and
validation splits are carved per task by a seeded hash of the prompt (as :mod:`.user_data` carves classification
data), so a prompt never straddles train and test.

The result is a ``TaskSequence(kind="generation")`` of :class:`~peft_ext.data.tasks.Instruction` examples, which
``run_sequence`` and the Trainer driver train and score (docs/continual_instruct.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from .sources import Source, describe_source, read_source
from .tasks import Example, Instruction, Task, TaskSequence
from .user_data import SPLITS, carved_split, split_share

__all__ = ["instruction_sequence_from_files", "instruction_rows"]


def _render(messages: Any, tokenizer: Any, where: str, generation_prompt: bool) -> str:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise ValueError(f"{where}: messages must be a list of {{'role', 'content'}} mappings, got {messages!r:.80}")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{where}: a conversational row needs a tokenizer with a chat template (to render the prompt as the model "
            "was trained to read it); pass `tokenizer=` of a chat model, or write the rows as prompt-completion text"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def instruction_rows(table: Any, where: str, tokenizer: Any = None) -> list[tuple[str, str]]:
    """``(prompt text, answer text)`` of every row of a ``datasets.Dataset`` in one of TRL's formats.

    Raises:
        ValueError: Neither format's columns, an empty prompt or completion, a conversation that does not end with
            the assistant (row named, 1-based).
    """
    columns = table.column_names
    if "messages" in columns:
        kind = "messages"
    elif {"prompt", "completion"} <= set(columns):
        kind = "prompt-completion"
    else:
        raise ValueError(
            f"{where} is in neither of TRL's formats: it needs `prompt` and `completion` columns, or a `messages` "
            f"column; its columns: {columns}"
        )
    data = table.select_columns(["messages"] if kind == "messages" else ["prompt", "completion"]).to_dict()
    rows = []
    for i in range(len(table)):
        row = f"{where}, row {i + 1}"
        if kind == "messages":
            messages = data["messages"][i]
            if not messages or not isinstance(messages, list) or messages[-1].get("role") != "assistant":
                raise ValueError(f"{row}: the conversation must end with the assistant's message (the answer)")
            prompt = _render(messages[:-1], tokenizer, row, True) if messages[:-1] else ""
            answer = messages[-1].get("content") or ""
        else:
            prompt, completion = data["prompt"][i], data["completion"][i]
            if isinstance(prompt, list):
                prompt = _render(prompt, tokenizer, row, True)
            if isinstance(completion, list):
                completion = "".join(m.get("content") or "" for m in completion if isinstance(m, dict))
            answer = completion
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{row}: the prompt is empty")
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError(f"{row}: the completion (the answer) is empty")
        rows.append((prompt, answer))
    if not rows:
        raise ValueError(f"{where} has no rows")
    return rows


def instruction_sequence_from_files(
    tasks: Optional[Sequence[Source]] = None,
    source: Optional[Source] = None,
    *,
    task_column: Optional[str] = None,
    names: Optional[Sequence[str]] = None,
    tokenizer: Any = None,
    test_share: float = 0.2,
    validation_share: float = 0.0,
    train_per_task: Optional[int] = None,
    test_per_task: Optional[int] = None,
    seed: int = 0,
    name: str = "instructions",
) -> TaskSequence:
    """A generation :class:`TaskSequence` from files in TRL's formats (see the module docstring).

    Args:
        tasks: One source per task, in order (a file, a list of files, a ``save_to_disk`` folder, a hub id or a
            ``datasets.Dataset``).
        source: Instead: one source whose ``task_column`` names each row's task (tasks in order of first
            appearance).
        task_column: The task column of ``source``.
        names: Task names (default: the file stems, or the ``task_column`` values).
        tokenizer: Renders conversational rows with its chat template (needed only for them).
        test_share: Share of each task carved off as test, by a seeded hash of the prompt.
        validation_share: Share carved off as validation the same way (0: none).
        train_per_task: Cap on training examples per task (``None``: all).
        test_per_task: Cap on test (and validation) examples per task (``None``: all).
        seed: Carves the splits and picks the capped subsets.
        name: The sequence's name.

    Raises:
        ValueError / FileNotFoundError: A bad file, column or row, named.
    """
    from pathlib import Path

    if (tasks is None) == (source is None):
        raise ValueError("give `tasks` (one source per task) or `source` with a `task_column`, not both")
    if source is not None and task_column is None:
        raise ValueError("`source` needs a `task_column` naming each row's task (or pass one source per task)")
    if not 0 < test_share < 1 or not 0 <= validation_share < 1 or test_share + validation_share >= 1:
        raise ValueError(
            f"`test_share` must be in (0, 1) and leave training data with `validation_share`, got {test_share} and "
            f"{validation_share}"
        )
    grouped: dict[str, list[tuple[str, str]]] = {}
    if tasks is not None:
        if not tasks:
            raise ValueError("`tasks` is empty: give one source per task")
        for i, task_source in enumerate(tasks):
            where = f"task {i} data {describe_source(task_source)!r}"
            label = names[i] if names else Path(describe_source(task_source)).stem
            if label in grouped:
                raise ValueError(f"two tasks are named {label!r}; give `names`")
            grouped[label] = instruction_rows(read_source(task_source), where, tokenizer)
    else:
        where = f"data {describe_source(source)!r}"
        table = read_source(source)
        if task_column not in table.column_names:
            raise ValueError(f"{where} has no column {task_column!r}; its columns: {table.column_names}")
        rows = instruction_rows(table, where, tokenizer)
        for (prompt, answer), task in zip(rows, table[task_column]):
            grouped.setdefault(str(task), []).append((prompt, answer))
        if names:
            if len(names) != len(grouped):
                raise ValueError(f"`names` has {len(names)} entries for {len(grouped)} tasks {list(grouped)}")
            grouped = dict(zip(names, grouped.values()))
    built = []
    for t, (task_name, rows) in enumerate(grouped.items()):
        splits: dict[str, list[tuple[str, str]]] = {split: [] for split in SPLITS}
        for row in rows:
            splits[carved_split(seed, row[0], test_share, validation_share)].append(row)
        for split, cap in (("train", train_per_task), ("test", test_per_task), ("validation", test_per_task)):
            if cap is not None:
                splits[split] = sorted(splits[split], key=lambda r: split_share(seed + 1, r[0]))[:cap]
        for split in ("train", "test"):
            if not splits[split]:
                raise ValueError(
                    f"task {task_name!r} has no {split} examples ({len(rows)} rows, test_share {test_share}): "
                    "give it more rows"
                )
        examples = {s: [Example(Instruction(p, a), t) for p, a in r] for s, r in splits.items()}
        built.append(Task(f"t{t}:{task_name}", [t], examples["train"], examples["test"], examples["validation"]))
    meta = {"seed": seed, "tasks": list(grouped), "test_share": test_share, "validation_share": validation_share}
    return TaskSequence(name, list(grouped), built, meta=meta, kind="generation")
