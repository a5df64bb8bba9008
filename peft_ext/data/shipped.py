"""The declaration of a data set that ships with the package (:class:`ShippedDataset`) and what every shipped data
set does the same way; the declarations themselves are in :mod:`.registry`.

Each is one committed, xz-compressed TSV of labelled texts. The train/test split of a record is a fixed function of
its key (:class:`~.provenance.HashSplit`: a SHA-1 hash), seeded caps keep the records with the smallest SHA-1 of
``f"{seed}:{key}"`` per class, a seeded ``random.Random(seed).sample`` picks and orders the classes of a task
sequence, and the validation split is carved from the train-split records the capped training data leaves out. Only
two things are code per data set, named in its declaration by ``"module:function"``: how a row of the file becomes a
record, and how the rows are built from the source files (:mod:`.build` runs it).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import lzma
import os
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .provenance import hash_split
from .tasks import PROTOCOLS, Example, Task, TaskSequence

if TYPE_CHECKING:
    from .provenance import DebianSource, HashSplit, License

__all__ = [
    "ShippedDataset",
    "cap_per_class",
    "check_class_names",
    "count_by_class",
    "file_sha256",
    "hash_split",
    "seeded_rank",
]

R = TypeVar("R")
SPLITS = ("train", "test")
#: Where the committed files and their licenses are.
FILES = Path(__file__).resolve().parent / "files"


def tsv_rows(path: str, columns: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
    """``(line number, fields)`` of every row of the xz-compressed TSV at ``path``, whose header must be ``columns``
    and whose rows must have one field per column (``ValueError`` naming the file and line otherwise)."""
    with lzma.open(path, "rt", encoding="utf-8", newline="\n") as fh:
        header = fh.readline().rstrip("\n").split("\t")
        if tuple(header) != columns:
            raise ValueError(f"{path} has columns {header}, expected {list(columns)}")
        for lineno, line in enumerate(fh, start=2):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != len(columns):
                raise ValueError(f"{path}:{lineno} has {len(fields)} fields, expected {len(columns)}")
            yield lineno, fields


def seeded_rank(seed: int, key: str) -> bytes:
    """The sort key of a record in the seeded caps: SHA-1 of ``f"{seed}:{key}"``."""
    return hashlib.sha1(f"{seed}:{key}".encode()).digest()


def positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


def check_class_names(names: Iterable[str], valid: Sequence[str], arg: str) -> list[str]:
    """``names`` as a list, refusing a bare string and names outside ``valid``.

    Args:
        names: Class names asked for.
        valid: Every class name of the data set.
        arg: The argument's name (and the classes' word), e.g. ``"supersenses"``, for the messages.
    """
    if isinstance(names, str):
        raise ValueError(f"`{arg}` must be an iterable of names, not the string {names!r}")
    names = list(names)
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise ValueError(f"Unknown {arg} {unknown}; valid names are {list(valid)}")
    return names


def cap_per_class(
    records: Sequence[R], max_per_class: int | None, seed: int, key: Callable[[R], str], label: Callable[[R], str]
) -> list[R]:
    """At most ``max_per_class`` records per class, in their given order.

    The kept ones are those with the smallest :func:`seeded_rank`, so the subset is deterministic, changes with
    ``seed``, and a smaller cap keeps a subset of what a larger one keeps. ``None`` keeps all.
    """
    if max_per_class is None:
        return list(records)
    by_class: dict[str, list[R]] = {}
    for r in records:
        by_class.setdefault(label(r), []).append(r)
    keep = {
        key(r)
        for members in by_class.values()
        for r in sorted(members, key=lambda r: seeded_rank(seed, key(r)))[:max_per_class]
    }
    return [r for r in records if key(r) in keep]


def count_by_class(
    records: Iterable[R], order: Sequence[str], label: Callable[[R], str], split: Callable[[R], str]
) -> dict[str, dict[str, int]]:
    """``{class: {"train": n, "test": m}}`` for the classes of ``order`` that have records, in that order."""
    counts = Counter((label(r), split(r)) for r in records)
    present = {name for name, _ in counts}
    return {name: {s: counts[name, s] for s in ("train", "test")} for name in order if name in present}


@functools.lru_cache(maxsize=8)
def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def file_sha256(path: str | Path) -> str:
    """SHA-256 of the file at ``path`` (hex), computed once per path."""
    return _sha256(str(Path(path).resolve()))


_split = attrgetter("split")


@functools.cache
def resolve(target: str) -> Callable[..., Any]:
    """The function a declaration names as ``"package.module:name"``, imported on first use (a data set's module
    imports the registry, so the registry names its code rather than importing it)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@functools.lru_cache(maxsize=8)
def _parse(data: ShippedDataset, path: str, mtime_ns: int, size: int) -> tuple[Any, ...]:
    # mtime and size are part of the key so a rebuilt file is re-read rather than served stale.
    del mtime_ns, size
    record = resolve(data.record)
    return tuple(record(path, lineno, fields) for lineno, fields in tsv_rows(path, data.columns))


@dataclass(frozen=True, eq=False)
class ShippedDataset:
    """A labelled-text data set that ships with the package, declared: its file, source, license, columns and split
    rule, and how it is loaded, counted and dealt into continual-learning task sequences. ``data.dataset`` names one
    (:data:`peft_ext.data.registry.SHIPPED`); ``python -m peft_ext.data build NAME`` rebuilds its file.

    Args:
        name: Its ``data.dataset`` name, and the build command's.
        describe: One line for messages and docs.
        title: What it is, recorded as ``TaskSequence.meta["dataset"]``.
        file: The committed file in ``peft_ext/data/files``, an xz-compressed TSV.
        columns: The file's header.
        key: The column that identifies a record (the seeded caps rank it).
        label: The column of the class name.
        text: The column a classifier sees (``Example.inputs``).
        input: What ``text`` holds, recorded as ``TaskSequence.meta["input"]``.
        split_rule: The train/test rule (each record's ``split`` attribute follows it).
        class_names: Every class name, in the data set's order.
        class_arg: The loaders' keyword for class names (``"supersenses"``), used in messages.
        item_word: What a record is, plural (``"synsets"``), used in messages.
        source: What the file is built from.
        license: What the file is distributed under.
        record: ``"module:function"``, ``(path, line number, fields) -> record``: a row as a record whose attributes
            are the columns and ``split`` (a bad row raises ``ValueError`` naming the file and line).
        build: ``"module:function"``, ``(source folder) -> rows``: the file's rows (tuples of strings, in file
            order) built from :attr:`source`'s files.
        sequence_name: The prefix of the sequences' names: ``f"{sequence_name}-{n_tasks}x{k}-seed{seed}"``.
        defaults: ``n_tasks``, ``classes_per_task``, ``train_per_class`` and ``test_per_class`` for a job config that
            leaves them unset.
    """

    name: str
    describe: str
    title: str
    file: str
    columns: tuple[str, ...]
    key: str
    label: str
    text: str
    input: str
    split_rule: HashSplit
    class_names: tuple[str, ...]
    class_arg: str
    item_word: str
    source: DebianSource
    license: License
    record: str
    build: str
    sequence_name: str
    defaults: dict[str, int]

    @property
    def path(self) -> Path:
        """The committed file."""
        return FILES / self.file

    @property
    def rebuild(self) -> str:
        """The command that rebuilds the file (from :attr:`source`)."""
        return f"python -m peft_ext.data build {self.name}"

    @functools.cached_property
    def key_of(self) -> Callable[[Any], str]:
        """``record -> its key`` (the :attr:`key` column)."""
        return attrgetter(self.key)

    @functools.cached_property
    def label_of(self) -> Callable[[Any], str]:
        """``record -> its class name`` (the :attr:`label` column)."""
        return attrgetter(self.label)

    @functools.cached_property
    def text_of(self) -> Callable[[Any], str]:
        """``record -> what a classifier sees`` (the :attr:`text` column)."""
        return attrgetter(self.text)

    def names(self) -> tuple[str, ...]:
        """Every class name of the data set."""
        return self.class_names

    def read(self, path: str | os.PathLike[str] | None = None) -> tuple[Any, ...]:
        """Every record of the file at ``path`` (default: the shipped one), parsed once per file version (a
        rebuilt file is re-read); a missing file raises ``FileNotFoundError`` saying how to rebuild it."""
        p = Path(path) if path is not None else self.path
        if not p.is_file():
            raise FileNotFoundError(f"{self.name} data file {p} not found; rebuild it with `{self.rebuild} --out {p}`")
        stat = p.stat()
        return _parse(self, str(p.resolve()), stat.st_mtime_ns, stat.st_size)

    def load(
        self,
        split: str | None = None,
        classes: Iterable[str] | None = None,
        *,
        max_per_class: int | None = None,
        seed: int = 0,
        path: str | os.PathLike[str] | None = None,
    ) -> list[Any]:
        """The records of ``split`` (``"train"``, ``"test"``, ``None`` for both) and ``classes`` (``None``: all), in
        file order, at most ``max_per_class`` per class (:func:`cap_per_class` with ``seed``)."""
        if split is not None and split not in SPLITS:
            raise ValueError(f"`split` must be one of {SPLITS} or None, got {split!r}")
        if max_per_class is not None and (not isinstance(max_per_class, int) or max_per_class <= 0):
            raise ValueError(f"`max_per_class` must be a positive int or None, got {max_per_class!r}")
        wanted = set(check_class_names(classes, self.class_names, self.class_arg)) if classes is not None else None
        records = [
            r
            for r in self.read(path)
            if (split is None or r.split == split) and (wanted is None or self.label_of(r) in wanted)
        ]
        return cap_per_class(records, max_per_class, seed, self.key_of, self.label_of)

    def class_counts(self, path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, int]]:
        """``{class: {"train": n, "test": m}}`` for the classes that have records, in the data set's order."""
        return count_by_class(self.read(path), self.class_names, self.label_of, _split)

    def stats_markdown(self, path: str | os.PathLike[str] | None = None) -> str:
        """The per-class train / test counts as a Markdown table (``files/README.md`` shows it)."""
        counts = self.class_counts(path)
        lines = [f"| {self.label} | train | test | total |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {c['train']} | {c['test']} | {c['train'] + c['test']} |" for name, c in counts.items()]
        train = sum(c["train"] for c in counts.values())
        test = sum(c["test"] for c in counts.values())
        lines.append(f"| **all ({len(counts)} classes)** | {train} | {test} | {train + test} |")
        return "\n".join(lines)

    def task_sequence(
        self,
        n_tasks: int,
        classes_per_task: int,
        seed: int,
        train_per_class: int,
        test_per_class: int,
        protocol: str = "class-incremental",
        classes: Sequence[str] | None = None,
        path: str | os.PathLike[str] | None = None,
        val_per_class: int = 0,
    ) -> TaskSequence:
        """A continual-learning sequence of classification tasks with disjoint classes.

        A class is eligible when it has at least ``train_per_class + val_per_class`` train and ``test_per_class``
        test records. ``random.Random(seed).sample`` over the sorted eligible names picks and orders the classes
        (unless ``classes`` gives them), which are dealt to tasks ``classes_per_task`` at a time. Each class
        contributes exactly ``train_per_class`` train and ``test_per_class`` test records, chosen by
        :func:`cap_per_class` with the same ``seed``. Labels are global ids into the chosen class names (in task
        order). Train examples are shuffled with ``random.Random(f"{seed}:train:{t}")``; test examples keep the
        records' order.

        The validation split (``val_per_class`` > 0) is, per class, the ``val_per_class`` train-split records ranked
        right after the training ones (the same seeded ranking), in the records' order, less any whose text is also
        a train or test example's. It is disjoint from train and test, and asking for it changes neither the
        training nor the test examples (only, when a class is too small for both, which classes are eligible).

        Args:
            n_tasks: Number of tasks.
            classes_per_task: New classes per task.
            seed: Picks and orders the classes and the capped example subsets.
            train_per_class: Train examples per class.
            test_per_class: Test examples per class.
            protocol: ``"class-incremental"`` or ``"task-incremental"``.
            classes: Use exactly these classes in this order (``n_tasks * classes_per_task`` names, all eligible)
                instead of a seeded pick.
            path: The file to read; defaults to the shipped one.
            val_per_class: Validation examples per class (``Task.validation``; 0: none).
        """
        n_tasks = positive_int("n_tasks", n_tasks)
        classes_per_task = positive_int("classes_per_task", classes_per_task)
        train_per_class = positive_int("train_per_class", train_per_class)
        test_per_class = positive_int("test_per_class", test_per_class)
        if isinstance(val_per_class, bool) or not isinstance(val_per_class, int) or val_per_class < 0:
            raise ValueError(f"`val_per_class` must be an int >= 0, got {val_per_class!r}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"`protocol` must be one of {PROTOCOLS}, got {protocol!r}")
        records = self.read(path)
        counts = self.class_counts(path)
        eligible = sorted(
            name
            for name, c in counts.items()
            if c["train"] >= train_per_class + val_per_class and c["test"] >= test_per_class
        )
        need = _Need(n_tasks * classes_per_task, train_per_class + val_per_class, test_per_class)
        chosen = (
            self._given_classes(classes, counts, eligible, need, f"{n_tasks} * {classes_per_task}")
            if classes is not None
            else self._sampled_classes(eligible, need, seed, f"{n_tasks} * {classes_per_task}")
        )
        label_id = {name: i for i, name in enumerate(chosen)}
        wanted_all = set(chosen)

        def select(which: str, cap: int) -> list[Any]:
            kept = [r for r in records if r.split == which and self.label_of(r) in wanted_all]
            return cap_per_class(kept, cap, seed, self.key_of, self.label_of)

        data = {which: select(which, cap) for which, cap in (("train", train_per_class), ("test", test_per_class))}
        validation: list[Any] = []
        if val_per_class:
            # A smaller cap keeps a subset of a larger one: train + validation minus train is the validation part.
            wider = select("train", train_per_class + val_per_class)
            used = {self.key_of(r) for r in data["train"]}
            seen = {self.text_of(r) for part in data.values() for r in part}  # a few records may share a text
            validation = [r for r in wider if self.key_of(r) not in used and self.text_of(r) not in seen]

        def examples(part: list[Any], wanted: set[str]) -> list[Example]:
            return [Example(self.text_of(r), label_id[self.label_of(r)]) for r in part if self.label_of(r) in wanted]

        tasks = []
        for t in range(n_tasks):
            names = chosen[t * classes_per_task : (t + 1) * classes_per_task]
            wanted = set(names)
            train = examples(data["train"], wanted)
            random.Random(f"{seed}:train:{t}").shuffle(train)
            tasks.append(
                Task(
                    f"t{t}:" + "+".join(names),
                    [label_id[n] for n in names],
                    train,
                    examples(data["test"], wanted),
                    examples(validation, wanted),
                )
            )
        source = Path(path) if path is not None else self.path
        return TaskSequence(
            name=f"{self.sequence_name}-{n_tasks}x{classes_per_task}-seed{seed}",
            class_names=list(chosen),
            tasks=tasks,
            protocol=protocol,  # type: ignore[arg-type]
            meta={
                "dataset": self.title,
                "source": source.name,
                "source_sha256": file_sha256(source),
                "license": str(self.license),
                "input": self.input,
                "seed": seed,
                "n_tasks": n_tasks,
                "classes_per_task": classes_per_task,
                "train_per_class": train_per_class,
                "test_per_class": test_per_class,
                "val_per_class": val_per_class,
                "test_percent": self.split_rule.test_percent,
                "class_selection": "given" if classes is not None else "random.Random(seed).sample(eligible)",
                "n_eligible": len(eligible),
            },
        )

    def _given_classes(
        self, classes: Sequence[str], counts: dict[str, dict[str, int]], eligible: list[str], need: _Need, product: str
    ) -> list[str]:
        chosen = check_class_names(classes, self.class_names, self.class_arg)
        if len(set(chosen)) != len(chosen):
            dupes = sorted({name for name in chosen if chosen.count(name) > 1})
            raise ValueError(f"`{self.class_arg}` repeats {dupes}")
        if len(chosen) != need.classes:
            raise ValueError(
                f"`{self.class_arg}` has {len(chosen)} names but n_tasks * classes_per_task = {product} = "
                f"{need.classes}"
            )
        too_small = [name for name in chosen if name not in eligible]
        if too_small:
            detail = ", ".join(
                f"{n} ({counts.get(n, {}).get('train', 0)}/{counts.get(n, {}).get('test', 0)})" for n in too_small
            )
            raise ValueError(
                f"{self.class_arg.capitalize()} {detail} have fewer than {need.train} train / {need.test} test "
                f"{self.item_word}; eligible at these caps: {eligible}"
            )
        return chosen

    def _sampled_classes(self, eligible: list[str], need: _Need, seed: int, product: str) -> list[str]:
        if need.classes > len(eligible):
            raise ValueError(
                f"n_tasks * classes_per_task = {product} = {need.classes} classes needed, but only {len(eligible)} "
                f"{self.class_arg} have at least {need.train} train and {need.test} test {self.item_word}; lower the "
                "caps or ask for fewer classes"
            )
        return random.Random(seed).sample(eligible, need.classes)


@dataclass(frozen=True)
class _Need:
    classes: int  # n_tasks * classes_per_task
    train: int  # train (+ validation) records per class
    test: int  # test records per class
