"""What the data sets shipped with the package (WordNet glosses: :mod:`.wordnet`; fortunes: :mod:`.fortunes`) share.

Each is one committed, xz-compressed TSV of labelled texts. The train/test split of a record is a fixed function of
its key (a SHA-1 hash), seeded caps keep the records with the smallest SHA-1 of ``f"{seed}:{key}"`` per class, a
seeded ``random.Random(seed).sample`` picks and orders the classes of a task sequence, and the validation split is
carved from the train-split records the capped training data leaves out. :func:`shipped_task_sequence` does all of
it for any record type, given how to read a record's key, class and text; :data:`SHIPPED` names the data sets the job
can run on (``data.dataset``) with the function that builds their sequences.
"""

from __future__ import annotations

import functools
import hashlib
import lzma
import os
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .tasks import PROTOCOLS, Example, Task, TaskSequence

__all__ = [
    "SHIPPED",
    "ShippedDataset",
    "cap_per_class",
    "check_class_names",
    "count_by_class",
    "file_sha256",
    "hash_split",
    "seeded_rank",
    "shipped_task_sequence",
]

R = TypeVar("R")


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


def write_xz(out: Path, data: bytes) -> Path:
    """Write ``data`` to ``out`` xz-compressed, reproducibly (no timestamp or file name in the container; preset 6,
    xz's default, within 0.3 % of preset 9 at a fraction of its memory) and atomically (a temporary file, then a
    rename); returns ``out``."""
    payload = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=6)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, out)
    return out


def read_versioned(path: Path, parse: Callable[[str, int, int], Any], what: str, rebuild: str) -> Any:
    """``parse(resolved path, mtime_ns, size)`` of the data file ``path`` (a cached parser keyed on the file's version,
    so a rebuilt file is re-read); a missing file raises ``FileNotFoundError`` saying how to rebuild it.

    Args:
        path: The file.
        parse: The module's ``functools.lru_cache``-wrapped reader.
        what: The file, for the message (``"fortunes file"``).
        rebuild: The command that rebuilds it, without ``--out``.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} not found; rebuild it with `{rebuild} --out {path}`")
    stat = path.stat()
    return parse(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


def hash_split(key: str, test_percent: int) -> str:
    """``"test"`` for about ``test_percent`` percent of keys, else ``"train"``: a fixed function of the key.

    SHA-1 of the key rather than Python's ``hash()``, which is salted per process for strings.

    Args:
        key: The record's key (a WordNet synset id, a fortune's text).
        test_percent: Share of keys in the test split, in percent.
    """
    digest = hashlib.sha1(key.encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % 100 < test_percent else "train"


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


@dataclass(frozen=True)
class _Words:
    arg: str  # the argument naming classes, e.g. "supersenses"
    items: str  # what a record is, plural, e.g. "synsets"


def shipped_task_sequence(
    records: Callable[[], Sequence[R]],
    *,
    key: Callable[[R], str],
    label: Callable[[R], str],
    text: Callable[[R], str],
    split: Callable[[R], str],
    class_names: Sequence[str],
    n_tasks: int,
    classes_per_task: int,
    seed: int,
    train_per_class: int,
    test_per_class: int,
    protocol: str,
    classes: Sequence[str] | None,
    val_per_class: int,
    class_arg: str,
    item_word: str,
    name: str,
    meta: Callable[[], dict[str, Any]],
    test_percent: int,
) -> TaskSequence:
    """A continual-learning sequence of classification tasks with disjoint classes over shipped records.

    A class is eligible when it has at least ``train_per_class + val_per_class`` train and ``test_per_class`` test
    records. ``random.Random(seed).sample`` over the sorted eligible names picks and orders the classes (unless
    ``classes`` gives them), which are dealt to tasks ``classes_per_task`` at a time. Each class contributes exactly
    ``train_per_class`` train and ``test_per_class`` test records, chosen by :func:`cap_per_class` with the same
    ``seed``. Labels are global ids into the chosen class names (in task order). Train examples are shuffled with
    ``random.Random(f"{seed}:train:{t}")``; test examples keep the records' order.

    The validation split (``val_per_class`` > 0) is, per class, the ``val_per_class`` train-split records ranked
    right after the training ones (the same seeded ranking), in the records' order, less any whose text is also a
    train or test example's. It is disjoint from train and test, and asking for it changes neither the training nor
    the test examples (only, when a class is too small for both, which classes are eligible).

    Args:
        records: Reads every record of the data set, in file order (called once, after the arguments are checked).
        key: A record's unique key (the caps rank it; the file's split is a function of it).
        label: A record's class name.
        text: What the classifier sees (``Example.inputs``).
        split: A record's split, ``"train"`` or ``"test"``.
        class_names: Every class name of the data set (for checking ``classes``).
        n_tasks, classes_per_task, seed, train_per_class, test_per_class, protocol, val_per_class: As in
            :func:`~peft_ext.data.wordnet.wordnet_task_sequence`.
        classes: Use exactly these classes in this order instead of a seeded pick.
        class_arg: The caller's name for ``classes`` (``"supersenses"``, ``"categories"``), used in messages.
        item_word: What a record is, plural (``"synsets"``, ``"entries"``), used in messages.
        name: The sequence's name.
        meta: Gives the provenance recorded first in ``TaskSequence.meta`` (data set, source, license, input); the
            caps, the seed and the class selection follow.
        test_percent: The data set's test share in percent (recorded in ``meta``).
    """
    words = _Words(class_arg, item_word)
    n_tasks = positive_int("n_tasks", n_tasks)
    classes_per_task = positive_int("classes_per_task", classes_per_task)
    train_per_class = positive_int("train_per_class", train_per_class)
    test_per_class = positive_int("test_per_class", test_per_class)
    if isinstance(val_per_class, bool) or not isinstance(val_per_class, int) or val_per_class < 0:
        raise ValueError(f"`val_per_class` must be an int >= 0, got {val_per_class!r}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"`protocol` must be one of {PROTOCOLS}, got {protocol!r}")
    n_classes = n_tasks * classes_per_task
    records = records()
    counts = count_by_class(records, class_names, label, split)
    eligible = sorted(
        name
        for name, c in counts.items()
        if c["train"] >= train_per_class + val_per_class and c["test"] >= test_per_class
    )
    if classes is not None:
        chosen = check_class_names(classes, class_names, words.arg)
        if len(set(chosen)) != len(chosen):
            dupes = sorted({name for name in chosen if chosen.count(name) > 1})
            raise ValueError(f"`{words.arg}` repeats {dupes}")
        if len(chosen) != n_classes:
            raise ValueError(
                f"`{words.arg}` has {len(chosen)} names but n_tasks * classes_per_task = {n_tasks} * "
                f"{classes_per_task} = {n_classes}"
            )
        too_small = [name for name in chosen if name not in eligible]
        if too_small:
            detail = ", ".join(
                f"{n} ({counts.get(n, {}).get('train', 0)}/{counts.get(n, {}).get('test', 0)})" for n in too_small
            )
            raise ValueError(
                f"{words.arg.capitalize()} {detail} have fewer than {train_per_class + val_per_class} train / "
                f"{test_per_class} test {words.items}; eligible at these caps: {eligible}"
            )
    else:
        if n_classes > len(eligible):
            raise ValueError(
                f"n_tasks * classes_per_task = {n_tasks} * {classes_per_task} = {n_classes} classes needed, but only "
                f"{len(eligible)} {words.arg} have at least {train_per_class + val_per_class} train and "
                f"{test_per_class} test {words.items}; lower the caps or ask for fewer classes"
            )
        chosen = random.Random(seed).sample(eligible, n_classes)

    label_of = {name: i for i, name in enumerate(chosen)}
    wanted_all = set(chosen)

    def select(which: str, cap: int) -> list[R]:
        kept = [r for r in records if split(r) == which and label(r) in wanted_all]
        return cap_per_class(kept, cap, seed, key, label)

    data = {which: select(which, cap) for which, cap in (("train", train_per_class), ("test", test_per_class))}
    validation: list[R] = []
    if val_per_class:
        # A smaller cap keeps a subset of a larger one: train + validation minus train is the validation part.
        wider = select("train", train_per_class + val_per_class)
        used = {key(r) for r in data["train"]}
        seen = {text(r) for part in data.values() for r in part}  # a few records may share a text
        validation = [r for r in wider if key(r) not in used and text(r) not in seen]
    tasks = []
    for t in range(n_tasks):
        names = chosen[t * classes_per_task : (t + 1) * classes_per_task]
        wanted = set(names)
        train = [Example(text(r), label_of[label(r)]) for r in data["train"] if label(r) in wanted]
        test = [Example(text(r), label_of[label(r)]) for r in data["test"] if label(r) in wanted]
        val = [Example(text(r), label_of[label(r)]) for r in validation if label(r) in wanted]
        random.Random(f"{seed}:train:{t}").shuffle(train)
        tasks.append(Task(f"t{t}:" + "+".join(names), [label_of[n] for n in names], train, test, val))
    return TaskSequence(
        name=name,
        class_names=list(chosen),
        tasks=tasks,
        protocol=protocol,  # type: ignore[arg-type]
        meta={
            **meta(),
            "seed": seed,
            "n_tasks": n_tasks,
            "classes_per_task": classes_per_task,
            "train_per_class": train_per_class,
            "test_per_class": test_per_class,
            "val_per_class": val_per_class,
            "test_percent": test_percent,
            "class_selection": "given" if classes is not None else "random.Random(seed).sample(eligible)",
            "n_eligible": len(eligible),
        },
    )


@dataclass(frozen=True)
class ShippedDataset:
    """A data set that ships with the package, as the job's ``data.dataset`` names it.

    Args:
        module: The module (under :mod:`peft_ext.data`) that loads it.
        sequence: The name of its task-sequence function there; it takes ``n_tasks``, ``classes_per_task``,
            ``seed``, ``train_per_class``, ``test_per_class``, ``val_per_class``, ``protocol`` and the class names
            as the keyword ``class_arg``.
        class_arg: The keyword of that function that takes explicit class names.
        class_names: The name of the module's tuple of every class name.
        defaults: ``n_tasks``, ``classes_per_task``, ``train_per_class`` and ``test_per_class`` for a config that
            leaves them unset.
        describe: One line for messages and docs.
    """

    module: str
    sequence: str
    class_arg: str
    class_names: str
    defaults: dict[str, int]
    describe: str

    def _module(self) -> Any:
        import importlib

        return importlib.import_module(f"{__package__}.{self.module}")

    def names(self) -> tuple[str, ...]:
        """Every class name of the data set."""
        return tuple(getattr(self._module(), self.class_names))

    def task_sequence(self, classes: Sequence[str] | None = None, **kwargs: Any) -> TaskSequence:
        """The data set's task sequence (keywords as its sequence function takes them; ``classes``: explicit names)."""
        return getattr(self._module(), self.sequence)(**kwargs, **{self.class_arg: classes})


#: The shipped data sets by their ``data.dataset`` name. The modules load lazily.
SHIPPED: dict[str, ShippedDataset] = {
    "wordnet": ShippedDataset(
        module="wordnet",
        sequence="wordnet_task_sequence",
        class_arg="supersenses",
        class_names="LEXNAMES",
        defaults={"n_tasks": 5, "classes_per_task": 4, "train_per_class": 80, "test_per_class": 40},
        describe="WordNet 3.0 gloss -> supersense",
    ),
    "fortunes": ShippedDataset(
        module="fortunes",
        sequence="fortunes_task_sequence",
        class_arg="categories",
        class_names="CATEGORIES",
        defaults={"n_tasks": 4, "classes_per_task": 3, "train_per_class": 60, "test_per_class": 30},
        describe="fortune cookie -> fortune file (topic)",
    ),
}
