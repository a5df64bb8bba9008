"""Fortune-cookie topic classification: predict which fortune(6) file (art, computers, food, law, ...) a saying
comes from.

The package ships ``files/fortunes.tsv.xz``: short entries of twelve topic files of Debian's ``fortunes`` package,
attributions removed, one row per entry with columns ``id`` (``<category>/<n>``, the entry's position in its source
file), ``category`` and ``text``. It was built by :func:`~peft_ext.data.fortunes_build.build_fortunes`
(``python -m peft_ext.data.fortunes_build``; the filtering is documented there and in ``files/README.md``) and is
distributed under the fortune-mod BSD license in ``files/FORTUNES_LICENSE``. Loading it needs nothing outside this
package.

It is the second shipped benchmark next to WordNet glosses (:mod:`.wordnet`): everyday jokes, quotations and
aphorisms rather than dictionary definitions, with classes that are topics rather than lexical categories. The
train/test split is a fixed function of the text (a SHA-1 hash, about 30% test: the classes are small), and task
sequences are built exactly as WordNet's are (:class:`~peft_ext.data.shipped.ShippedTexts`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .shipped import ShippedTexts, hash_split
from .tasks import TaskSequence

__all__ = ["FORTUNES", "FortuneExample", "fortunes_task_sequence", "load_fortunes", "read_fortune_file"]

#: The fortune files used, one class each: topics that fortune-mod's ``cookie-files`` describes as distinct and that
#: keep at least 130 entries after filtering.
CATEGORIES: tuple[str, ...] = (
    "art",
    "computers",
    "drugs",
    "education",
    "food",
    "law",
    "literature",
    "love",
    "politics",
    "science",
    "startrek",
    "work",
)
TEST_PERCENT = 30
DEFAULT_PATH = Path(__file__).resolve().parent / "files" / "fortunes.tsv.xz"
COLUMNS = ("id", "category", "text")


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
    return hash_split(text, TEST_PERCENT)


def _record(path: str, lineno: int, fields: list[str]) -> FortuneExample:
    id_, category, text = fields
    if category not in CATEGORIES:
        raise ValueError(f"{path}:{lineno} has category {category!r}, not one of {list(CATEGORIES)}")
    return FortuneExample(id_, category, text, split_of(text))


#: The data set as the job's ``data.dataset: fortunes`` sees it.
FORTUNES: ShippedTexts[FortuneExample] = ShippedTexts(
    name="fortunes",
    file=DEFAULT_PATH,
    columns=COLUMNS,
    record=_record,
    rebuild="python -m peft_ext.data.fortunes_build",
    class_names=CATEGORIES,
    class_arg="categories",
    item_word="entries",
    key=lambda r: r.text,
    label=lambda r: r.category,
    text=lambda r: r.text,
    test_percent=TEST_PERCENT,
    provenance={
        "dataset": "Debian fortunes: fortune -> fortune file (topic)",
        "license": "fortune-mod BSD license (peft_ext/data/files/FORTUNES_LICENSE)",
        "input": "text (attribution removed)",
    },
    sequence_name="fortunes",
    defaults={"n_tasks": 4, "classes_per_task": 3, "train_per_class": 60, "test_per_class": 30},
    describe="fortune cookie -> fortune file (topic)",
)


def read_fortune_file(path: str | os.PathLike[str] | None = None) -> tuple[FortuneExample, ...]:
    """Every record of the fortunes file at ``path`` (default: the packaged one), read once per file version.

    Args:
        path: A file written by :func:`~peft_ext.data.fortunes_build.build_fortunes`.
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
    """A continual-learning sequence of fortune topic-classification tasks with disjoint classes.

    Built exactly as :func:`~peft_ext.data.wordnet.wordnet_task_sequence` builds WordNet's (both are
    :meth:`ShippedTexts.task_sequence <peft_ext.data.shipped.ShippedTexts.task_sequence>`, which documents the other
    keywords: ``seed``, ``protocol``, ``path``, ``val_per_class``): a class is eligible with at least
    ``train_per_class + val_per_class`` train and ``test_per_class`` test entries (at the defaults all twelve are),
    ``random.Random(seed).sample`` over the sorted eligible names picks and orders the classes, dealt to tasks
    ``classes_per_task`` at a time; each class contributes exactly ``train_per_class`` train and ``test_per_class``
    test entries (the seeded caps of :func:`load_fortunes`), train examples are shuffled per task, and the validation
    split holds the train-split entries ranked right after the training ones. ``Example.inputs`` is the fortune's
    text.

    Args:
        n_tasks: Number of tasks.
        classes_per_task: New classes per task.
        categories: Use exactly these classes in this order (``n_tasks * classes_per_task`` names, all eligible)
            instead of a seeded pick.
        train_per_class: Train examples per class.
        test_per_class: Test examples per class.
        seed, protocol, path, val_per_class: As :meth:`~peft_ext.data.shipped.ShippedTexts.task_sequence` takes
            them.
    """
    return FORTUNES.task_sequence(
        n_tasks, classes_per_task, seed, train_per_class, test_per_class, protocol, categories, path, val_per_class
    )
