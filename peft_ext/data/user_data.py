"""Classification task sequences from a user's own data, read through Hugging Face ``datasets``.

Anything ``datasets`` reads offline is a source: a CSV / TSV, JSON / JSONL or Parquet file (or a list of them), a
folder written by ``Dataset.save_to_disk``, an in-memory ``datasets.Dataset``, and a hub id when online. One column
holds the text (or several, joined by ``text_separator``), one the label (strings or integers; a ``ClassLabel``
feature gives its names). What becomes a task:

- **class-incremental / task-incremental** (``task_column=None``): the classes are dealt to ``n_tasks`` tasks
  ``classes_per_task`` at a time, picked and ordered by ``seed`` (``random.Random(seed).sample`` over the sorted
  class names that have enough examples), or in the order ``classes`` gives.
- **one task per value of ``task_column``** (or one file per task: pass a list of sources as ``tasks``): each task
  has its own classes, named ``"<task>/<label>"``, so two tasks' labels never collide (the engine's tasks have
  disjoint classes). A label space shared across domains (domain-incremental with one head) is not supported.

Splits: ``test`` (and ``validation``) from their own sources, or carved from the training source by a seeded hash of
each example's text (``test_share``, ``validation_share``), as WordNet's split is a hash of the synset id: the same
text always lands in the same split, so duplicates never straddle train and test.

Every refusal names the file, the column or the row and what would be valid.
"""

from __future__ import annotations

import hashlib
import math
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from .sources import Source, describe_source, quiet_progress, read_source, require_datasets
from .tasks import PROTOCOLS, Example, Task, TaskSequence

__all__ = ["SPLITS", "Tokenized", "carved_split", "file_task_sequence", "split_share", "tokenize_sequence"]

#: The splits a sequence's tasks hold, training first.
SPLITS = ("train", "test", "validation")


@dataclass(frozen=True)
class Tokenized:
    """An example's text with its token ids, tokenized once (and cached) by ``datasets`` for every method.

    Args:
        text: The text.
        input_ids: Its token ids, special tokens included, truncated to the sequence's ``max_length``.
    """

    text: str
    input_ids: tuple[int, ...]


def _columns(table: Any, where: str, text_columns: Sequence[str], label_column: str, task_column: Optional[str]):
    wanted = [*text_columns, label_column, *([task_column] if task_column else [])]
    missing = [c for c in wanted if c not in table.column_names]
    if missing:
        raise ValueError(f"{where} has no column {missing[0]!r}; its columns: {table.column_names}")


def _label_names(table: Any, label_column: str) -> Optional[list[str]]:
    feature = table.features[label_column]
    return list(feature.names) if hasattr(feature, "names") else None


def _rows(
    table: Any, where: str, text_columns: Sequence[str], label_column: str, task_column: Optional[str], sep: str
) -> list[tuple[str, str, Optional[str]]]:
    """``(text, label, task)`` per row, refusing an empty text or an empty / NaN label (row named, 1-based, plus
    the header line for CSV)."""
    names = _label_names(table, label_column)
    rows = []
    # whole columns as Python lists at once: indexing a `datasets` column row by row costs ~0.5 ms a row
    wanted = list(dict.fromkeys([*text_columns, label_column, *([task_column] if task_column else [])]))
    columns = table.select_columns(wanted).to_dict()
    texts = [columns[c] for c in text_columns]
    labels = columns[label_column]
    tasks = columns[task_column] if task_column else [None] * len(labels)
    for i, label in enumerate(labels):
        row = f"{where}, row {i + 1}"
        if (
            label is None
            or (isinstance(label, float) and math.isnan(label))
            or (isinstance(label, str) and not label.strip())
        ):
            raise ValueError(f"{row}: the label (column {label_column!r}) is empty or NaN")
        if names is not None and isinstance(label, int):
            label = names[label]
        if isinstance(label, float) and label.is_integer():
            label = int(label)
        parts = [col[i] for col in texts]
        if any(p is None or (isinstance(p, float) and math.isnan(p)) for p in parts):
            raise ValueError(f"{row}: the text (columns {list(text_columns)}) is empty")
        text = sep.join(str(p) for p in parts)
        if not text.strip():
            raise ValueError(f"{row}: the text (columns {list(text_columns)}) is empty")
        task = tasks[i]
        if task_column and (task is None or not str(task).strip()):
            raise ValueError(f"{row}: the task (column {task_column!r}) is empty")
        rows.append((text, str(label), None if task is None else str(task)))
    if not rows:
        raise ValueError(f"{where} has no rows")
    return rows


def split_share(seed: int, text: str) -> float:
    """A fixed number in [0, 1) per (seed, text): SHA-1, not Python's salted ``hash()``."""
    return int.from_bytes(hashlib.sha1(f"{seed}:{text}".encode()).digest()[:8], "big") / 2**64


def carved_split(seed: int, text: str, test_share: float, validation_share: float) -> str:
    """The split a carved example falls in: ``"test"`` for the first ``test_share`` of :func:`split_share`'s range,
    ``"validation"`` for the next ``validation_share``, else ``"train"`` (a share of 0 carves nothing)."""
    u = split_share(seed, text)
    return "test" if u < test_share else "validation" if u < test_share + validation_share else "train"


def _deal(names: Sequence[str], per_task: int, n_tasks: int) -> list[tuple[str, list[str]]]:
    """``names`` dealt to ``n_tasks`` tasks ``per_task`` at a time, each named by its classes."""
    groups = [list(names[i * per_task : (i + 1) * per_task]) for i in range(n_tasks)]
    return [("+".join(g), g) for g in groups]


def file_task_sequence(
    train: Source,
    test: Optional[Source] = None,
    validation: Optional[Source] = None,
    *,
    text_column: Union[str, Sequence[str]] = "text",
    label_column: str = "label",
    task_column: Optional[str] = None,
    n_tasks: Optional[int] = None,
    classes_per_task: Optional[int] = None,
    classes: Optional[Sequence[Union[str, Sequence[str]]]] = None,
    seed: int = 0,
    train_per_class: Optional[int] = None,
    test_per_class: Optional[int] = None,
    test_share: float = 0.2,
    validation_share: float = 0.0,
    protocol: str = "class-incremental",
    text_separator: str = " ",
    name: Optional[str] = None,
    tokenizer: Any = None,
    max_length: Optional[int] = None,
) -> TaskSequence:
    """A classification :class:`TaskSequence` from a user's data (see the module docstring for the layouts).

    Args:
        train: The training data: a file, a list of files, a ``save_to_disk`` folder, a hub id, or a ``Dataset`` /
            ``DatasetDict``.
        test: The test data (same kinds); ``None``: carved from ``train`` by a seeded hash (``test_share``).
        validation: Held-out data for choosing hyperparameters; ``None``: carved from ``train`` when
            ``validation_share`` > 0, else no validation split.
        text_column: The text column, or several (joined by ``text_separator``).
        label_column: The label column (strings or integers).
        task_column: A column naming each row's task (one task per value, in order of first appearance); ``None``:
            tasks are groups of classes.
        n_tasks: Number of tasks (class grouping; default: all classes in tasks of ``classes_per_task``).
        classes_per_task: Classes each task introduces (class grouping).
        classes: Explicit grouping: ``n_tasks * classes_per_task`` class names in task order, or one list of names
            per task. Overrides the seeded pick.
        seed: Picks and orders the classes, carves the splits, caps and shuffles the examples.
        train_per_class: Cap on training examples per class (``None``: all).
        test_per_class: Cap on test examples per class (``None``: all).
        test_share: Share of ``train`` carved off as test when ``test`` is not given.
        validation_share: Share of ``train`` carved off as validation when ``validation`` is not given.
        protocol: ``"class-incremental"`` or ``"task-incremental"``.
        text_separator: Joins several text columns.
        name: Sequence name (default: the training source's name).
        tokenizer: When given, every example is tokenized once through ``datasets.map`` (cached by ``datasets``) and
            carries :class:`Tokenized` inputs, so no method re-tokenizes; needs ``max_length``.
        max_length: Truncation length for ``tokenizer``; how many examples were truncated is in ``meta``.

    Raises:
        ValueError / FileNotFoundError: Named file, column or row, and what would be valid.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"`protocol` must be one of {PROTOCOLS}, got {protocol!r}")
    for key, value in (("test_share", test_share), ("validation_share", validation_share)):
        if not 0 <= value < 1:
            raise ValueError(f"`{key}` must be in [0, 1), got {value}")
    if test is None and test_share == 0:
        raise ValueError("no test data: give `test` or a `test_share` > 0 to carve it from the training data")
    if test is None and test_share + validation_share >= 1:
        raise ValueError(
            f"`test_share` + `validation_share` = {test_share + validation_share} leaves no training data"
        )
    if tokenizer is not None and max_length is None:
        raise ValueError("`max_length` is needed with `tokenizer` (the truncation length)")
    text_columns = [text_column] if isinstance(text_column, str) else list(text_column)

    def load(source: Source, split: str) -> list[tuple[str, str, Optional[str]]]:
        where = f"{split} data {describe_source(source)!r}"
        table = read_source(source, split)
        _columns(table, where, text_columns, label_column, task_column)
        return _rows(table, where, text_columns, label_column, task_column, text_separator)

    rows = {"train": load(train, "train")}
    for split, source in (("test", test), ("validation", validation)):
        if source is not None:
            rows[split] = load(source, split)
    carved = [s for s, share in (("test", test_share), ("validation", validation_share)) if s not in rows and share]
    if carved:
        pieces: dict[str, list] = {"train": [], **{s: [] for s in carved}}
        carve_test = test_share if "test" in carved else 0.0
        carve_validation = validation_share if "validation" in carved else 0.0
        for row in rows["train"]:
            pieces[carved_split(seed, row[0], carve_test, carve_validation)].append(row)
        rows.update(pieces)

    def key(row: tuple[str, str, Optional[str]]) -> str:
        return row[1] if task_column is None else f"{row[2]}/{row[1]}"

    train_names = sorted({key(r) for r in rows["train"]})
    for split in ("test", "validation"):
        unseen = sorted({key(r) for r in rows.get(split, [])} - set(train_names))
        if unseen:
            raise ValueError(
                f"{split} labels {unseen[:5]} never occur in the training data ({len(unseen)} such); a model cannot "
                "learn them: drop those rows or add training examples"
            )
    train_texts = {r[0] for r in rows["train"]}
    shared = sum(r[0] in train_texts for r in rows.get("test", []))
    if shared:
        warnings.warn(
            f"{shared} test examples have the same text as a training example; the test accuracy overstates how "
            "well the model generalizes (carving the test split from the training file avoids this)",
            UserWarning,
            stacklevel=2,
        )

    groups = _groups(rows["train"], key, task_column, classes, n_tasks, classes_per_task, seed, train_per_class)
    class_names = [c for _, group_classes in groups for c in group_classes]
    index = {c: i for i, c in enumerate(class_names)}
    rng = random.Random(seed)
    tasks = []
    for t, (task_name, group_classes) in enumerate(groups):
        wanted = set(group_classes)
        splits: dict[str, list[Example]] = {}
        for split, cap in (("train", train_per_class), ("test", test_per_class), ("validation", test_per_class)):
            chosen = [r for r in rows.get(split, []) if key(r) in wanted]
            if cap is not None:
                by_class: dict[str, list] = {}
                for r in sorted(chosen, key=lambda r: split_share(seed + 1, r[0])):
                    by_class.setdefault(key(r), []).append(r)
                chosen = [r for c in group_classes for r in by_class.get(c, [])[:cap]]
            examples = [Example(r[0], index[key(r)]) for r in chosen]
            if split == "train":
                rng.shuffle(examples)
            splits[split] = examples
        if not splits["test"]:
            raise ValueError(f"task {task_name!r} has no test examples (classes {group_classes})")
        tasks.append(Task(f"t{t}:{task_name}", [index[c] for c in group_classes], **splits))
    meta = {
        "source": describe_source(train),
        "text_columns": text_columns,
        "label_column": label_column,
        "task_column": task_column,
        "seed": seed,
        "carved": carved,
        "test_shares_train_text": shared,
    }
    sequence = TaskSequence(name or Path(describe_source(train)).stem, class_names, tasks, protocol, meta)
    if tokenizer is not None:
        sequence = tokenize_sequence(sequence, tokenizer, max_length)
    return sequence


def _groups(
    rows: list, key: Any, task_column: Optional[str], classes: Any, n_tasks: Any, per_task: Any, seed: int, cap: Any
) -> list[tuple[str, list[str]]]:
    """``[(task name, its classes)]`` in task order."""
    if task_column is not None:
        if classes is not None or per_task is not None:
            raise ValueError(
                "with `task_column` each task's classes come from the data: drop `classes` and `classes_per_task`"
            )
        order: dict[str, list[str]] = {}
        for r in rows:
            order.setdefault(r[2], [])
            if key(r) not in order[r[2]]:
                order[r[2]].append(key(r))
        if n_tasks is not None and n_tasks != len(order):
            raise ValueError(
                f"`n_tasks` is {n_tasks} but column {task_column!r} names {len(order)} tasks: {list(order)}"
            )
        return [(task, sorted(names)) for task, names in order.items()]
    counts: dict[str, int] = {}
    for r in rows:
        counts[key(r)] = counts.get(key(r), 0) + 1
    if classes is not None:
        nested = [list(g) for g in classes] if all(not isinstance(c, str) for c in classes) else None
        flat = [c for g in nested for c in g] if nested else [str(c) for c in classes]
        unknown = [c for c in flat if c not in counts]
        if unknown:
            raise ValueError(
                f"`classes` names {unknown[0]!r}, not a label of the training data; its labels: {sorted(counts)}"
            )
        if len(set(flat)) != len(flat):
            raise ValueError(f"`classes` repeats {sorted({c for c in flat if flat.count(c) > 1})}")
        if nested:
            return [("+".join(g), g) for g in nested]
        if per_task is None or n_tasks is None or n_tasks * per_task != len(flat):
            raise ValueError(
                f"a flat `classes` list ({len(flat)} names) needs `n_tasks` x `classes_per_task` equal to its length; "
                "or give one list of names per task"
            )
        return _deal(flat, per_task, n_tasks)
    if per_task is None:
        raise ValueError("give `classes_per_task` (with `n_tasks`), `classes`, or a `task_column`")
    if len(counts) == 1:
        raise ValueError(
            f"the label column holds one class only ({next(iter(counts))!r}): a classifier needs at least 2; check "
            "`label_column` (or the file's label column)"
        )
    eligible = sorted(c for c, n in counts.items() if cap is None or n >= cap)
    if n_tasks is None:
        n_tasks = len(eligible) // per_task
    needed = n_tasks * per_task
    if needed == 0 or len(eligible) < needed:
        capped = f" with at least {cap} training examples" if cap is not None else ""
        raise ValueError(
            f"n_tasks x classes_per_task = {n_tasks} x {per_task} = {needed} classes needed, but the training data "
            f"has {len(eligible)} classes{capped} ({len(counts)} in all): lower `n_tasks` or `classes_per_task`"
            + (" or `train_per_class`" if cap is not None else "")
        )
    return _deal(random.Random(seed).sample(eligible, needed), per_task, n_tasks)


def tokenize_sequence(sequence: TaskSequence, tokenizer: Any, max_length: int, progress: bool = True) -> TaskSequence:
    """``sequence`` with every example's text tokenized once through ``datasets.map``, as :class:`Tokenized` inputs;
    ``meta`` records how many examples were truncated to ``max_length``. The result is cached on disk (in
    ``datasets``' cache folder) under a hash of the texts, the tokenizer's vocabulary and ``max_length``, so a later
    run of the same data and model reads it back instead of tokenizing again."""
    datasets = require_datasets()
    texts = sorted({ex.inputs for task in sequence.tasks for ex in task.train + task.test + task.validation})
    table = datasets.Dataset.from_dict({"text": texts})

    def encode(batch: dict[str, list]) -> dict[str, list]:
        cut = tokenizer(batch["text"], truncation=True, max_length=max_length)["input_ids"]
        full = tokenizer(batch["text"], truncation=False)["input_ids"]
        return {"input_ids": cut, "truncated": [len(f) > max_length for f in full]}

    # An in-memory table's map is not cached by `datasets` on its own: name the cache file after everything the
    # result depends on (the texts, the tokenizer's vocabulary and class, max_length), so a later run loads it.
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode() + b"\0")
    for token, index in sorted(tokenizer.get_vocab().items()):
        digest.update(f"{token}\0{index}\0".encode())
    digest.update(repr((type(tokenizer).__name__, max_length)).encode())
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "peft_ext_tokenized" / f"{digest.hexdigest()[:32]}.arrow"
    cache.parent.mkdir(parents=True, exist_ok=True)
    with quiet_progress(datasets, not progress):
        encoded = table.map(encode, batched=True, desc="tokenizing", cache_file_name=str(cache))
    columns = encoded.to_dict()
    ids = {text: tuple(v) for text, v in zip(texts, columns["input_ids"])}
    truncated = sum(columns["truncated"])

    def convert(examples: list[Example]) -> list[Example]:
        return [Example(Tokenized(ex.inputs, ids[ex.inputs]), ex.label) for ex in examples]

    tasks = [
        Task(t.name, list(t.classes), convert(t.train), convert(t.test), convert(t.validation)) for t in sequence.tasks
    ]
    meta = {**sequence.meta, "max_length": max_length, "truncated": truncated}
    return TaskSequence(sequence.name, list(sequence.class_names), tasks, sequence.protocol, meta, sequence.kind)
