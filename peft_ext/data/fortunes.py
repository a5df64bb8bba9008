"""Fortune-cookie topic classification: predict which fortune(6) file (art, computers, food, law, ...) a saying
comes from.

The package ships ``files/fortunes.tsv.xz``: short entries of twelve topic files of Debian's ``fortunes`` package,
attributions removed, one row per entry with columns ``id`` (``<category>/<n>``, the entry's position in its source
file), ``category`` and ``text``. Its declaration (source, license, columns, split rule) is
:data:`~peft_ext.data.registry.FORTUNES`; ``python -m peft_ext.data build fortunes`` rebuilds it (the filtering is
documented in :mod:`.fortunes_build` and ``files/README.md``). Loading it needs nothing outside this package.

It is the second shipped benchmark next to WordNet glosses (:mod:`.wordnet`): everyday jokes, quotations and
aphorisms rather than dictionary definitions, with classes that are topics rather than lexical categories. The
train/test split is a fixed function of the text (a SHA-1 hash, about 30% test: the classes are small), and task
sequences are built exactly as WordNet's are (:class:`~peft_ext.data.shipped.ShippedDataset`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .registry import FORTUNES
from .tasks import TaskSequence

__all__ = ["FortuneExample", "fortune_from_row", "fortunes_task_sequence", "load_fortunes", "read_fortune_file"]

#: The fortune files used, one class each (:data:`~peft_ext.data.registry.FORTUNES` says why these).
CATEGORIES: tuple[str, ...] = FORTUNES.class_names
TEST_PERCENT = FORTUNES.split_rule.test_percent
DEFAULT_PATH = FORTUNES.path


@dataclass(frozen=True, slots=True)
class FortuneExample:
    """One fortune with its topic label.

    Args:
        id: ``<category>/<n>``: the entry's 0-based position in its source file, 4 digits (``"food/0042"``).
        category: The fortune file it comes from (one of :data:`CATEGORIES`); this is the class label.
        text: The entry, attribution removed, whitespace collapsed to single spaces.
        split: ``"train"`` or ``"test"`` (see :func:`split_of`).
    """

    id: str
    category: str
    text: str
    split: str


def split_of(text: str) -> str:
    """The split of a fortune: ``"test"`` for about :data:`TEST_PERCENT` percent of texts, else ``"train"`` (SHA-1
    of the text, so a text is in the same split whatever its id).

    Args:
        text: The fortune's text as stored.
    """
    return FORTUNES.split_rule.of(text)


def fortune_from_row(path: str, lineno: int, fields: list[str]) -> FortuneExample:
    """One row of the fortunes file as a record; a category outside :data:`CATEGORIES` raises ``ValueError`` naming
    the file and line."""
    id_, category, text = fields
    if category not in CATEGORIES:
        raise ValueError(f"{path}:{lineno} has category {category!r}, not one of {list(CATEGORIES)}")
    return FortuneExample(id_, category, text, split_of(text))


def read_fortune_file(path: str | os.PathLike[str] | None = None) -> tuple[FortuneExample, ...]:
    """Every record of the fortunes file at ``path`` (default: the packaged one), read once per file version.

    Args:
        path: A file written by ``python -m peft_ext.data build fortunes``.
    """
    return FORTUNES.read(path)


def load_fortunes(
    split: str | None = None,
    categories: Iterable[str] | None = None,
    max_per_class: int | None = None,
    seed: int = 0,
    path: str | os.PathLike[str] | None = None,
) -> list[FortuneExample]:
    """Load fortunes labelled with their category, in id order.

    Args:
        split: ``"train"``, ``"test"`` or ``None`` for both.
        categories: Keep only these classes (names from :data:`CATEGORIES`); ``None`` keeps all.
        max_per_class: Keep at most this many entries per class (within ``split``): those with the smallest SHA-1
            of ``f"{seed}:{text}"``, so a smaller cap keeps a subset of what a larger one keeps. ``None`` keeps all.
        seed: Picks the capped subset; unused without ``max_per_class``.
        path: Fortunes file to read; defaults to the one shipped with the package.
    """
    return FORTUNES.load(split, categories, max_per_class=max_per_class, seed=seed, path=path)


def class_counts(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, int]]:
    """Number of entries per category and split: ``{category: {"train": n, "test": m}}``, in CATEGORIES order.

    Args:
        path: Fortunes file to read; defaults to the one shipped with the package.
    """
    return FORTUNES.class_counts(path)


def fortunes_task_sequence(
    n_tasks: int = 4,
    classes_per_task: int = 3,
    seed: int = 0,
    train_per_class: int = 60,
    test_per_class: int = 30,
    protocol: str = "class-incremental",
    categories: Sequence[str] | None = None,
    path: str | os.PathLike[str] | None = None,
    val_per_class: int = 0,
) -> TaskSequence:
    """A continual-learning sequence of fortune topic-classification tasks with disjoint classes, built as every
    shipped data set's is (:meth:`~peft_ext.data.shipped.ShippedDataset.task_sequence` documents how); at the defaults
    all twelve topics are eligible. ``Example.inputs`` is the fortune's text.

    Args:
        categories: Use exactly these classes in this order (``n_tasks * classes_per_task`` names, all eligible)
            instead of a seeded pick.
        n_tasks, classes_per_task, seed, train_per_class, test_per_class, protocol, path, val_per_class: As
            :meth:`~peft_ext.data.shipped.ShippedDataset.task_sequence` takes them.
    """
    return FORTUNES.task_sequence(
        n_tasks, classes_per_task, seed, train_per_class, test_per_class, protocol, categories, path, val_per_class
    )
