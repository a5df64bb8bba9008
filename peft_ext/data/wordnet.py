"""WordNet 3.0 gloss classification: predict a synset's supersense (lexicographer file) from its definition.

The package ships ``files/wordnet_glosses.tsv.xz``, one row per WordNet 3.0 synset (117,659 rows) with columns
``synset``, ``supersense``, ``lemmas``, ``definition`` and ``examples``. It was built from Debian's ``wordnet-base``
data files by :func:`~peft_ext.data.wordnet_build.build_wordnet_glosses` (``python -m peft_ext.data build``) and
is distributed under the WordNet 3.0 license in ``files/WORDNET_LICENSE``. Loading it needs nothing outside this
package.

The train/test split is a fixed function of the synset id (a SHA-1 hash, about 20% test), so it never depends on
the caps, the seed or the classes asked for, and a synset is in the same split in every task sequence.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .shipped import (
    cap_per_class,
    check_class_names,
    count_by_class,
    file_sha256,
    hash_split,
    read_versioned,
    shipped_task_sequence,
    tsv_rows,
)
from .tasks import TaskSequence

__all__ = [
    "DEFAULT_PATH",
    "LEXNAMES",
    "SPLITS",
    "TEST_PERCENT",
    "GlossExample",
    "class_counts",
    "load_wordnet_glosses",
    "read_gloss_file",
    "split_of",
    "wordnet_task_sequence",
]

# Lexicographer file names, indexed by the ``lex_filenum`` field of the data files (WordNet's lexnames(5WN)).
LEXNAMES: tuple[str, ...] = (
    "adj.all",
    "adj.pert",
    "adv.all",
    "noun.Tops",
    "noun.act",
    "noun.animal",
    "noun.artifact",
    "noun.attribute",
    "noun.body",
    "noun.cognition",
    "noun.communication",
    "noun.event",
    "noun.feeling",
    "noun.food",
    "noun.group",
    "noun.location",
    "noun.motive",
    "noun.object",
    "noun.person",
    "noun.phenomenon",
    "noun.plant",
    "noun.possession",
    "noun.process",
    "noun.quantity",
    "noun.relation",
    "noun.shape",
    "noun.state",
    "noun.substance",
    "noun.time",
    "verb.body",
    "verb.change",
    "verb.cognition",
    "verb.communication",
    "verb.competition",
    "verb.consumption",
    "verb.contact",
    "verb.creation",
    "verb.emotion",
    "verb.motion",
    "verb.perception",
    "verb.possession",
    "verb.social",
    "verb.stative",
    "verb.weather",
    "adj.ppl",
)

SPLITS = ("train", "test")
TEST_PERCENT = 20
DEFAULT_PATH = Path(__file__).resolve().parent / "files" / "wordnet_glosses.tsv.xz"
COLUMNS = ("synset", "supersense", "lemmas", "definition", "examples")
# Joins the examples of one synset in the file; no WordNet 3.0 gloss contains "|" after the field separator.
EXAMPLE_SEP = " | "


@dataclass(frozen=True, slots=True)
class GlossExample:
    """One WordNet 3.0 synset with its supersense label.

    Args:
        synset: Synset id: the part of speech (``n``, ``v``, ``a`` for adjectives and satellites, ``r``) followed by
            the 8-digit offset in that data file, e.g. ``"n02084071"``.
        supersense: The lexicographer file name (one of :data:`LEXNAMES`); this is the class label.
        lemmas: The synset's words, underscores as in WordNet (``"take_a_breath"``), adjective markers removed.
        definition: The gloss up to its first quoted example.
        examples: The quoted usage examples, quotes removed (an attribution such as ``- Shakespeare`` is kept).
        split: ``"train"`` or ``"test"`` (see :func:`split_of`).
    """

    synset: str
    supersense: str
    lemmas: tuple[str, ...]
    definition: str
    examples: tuple[str, ...]
    split: str

    @property
    def text(self) -> str:
        """The input a classifier sees: the definition alone.

        Lemmas and examples are left out on purpose: a lemma often names its class outright (``"dog"``), and
        examples are missing for most synsets, so the definition is the one field that is always there and carries
        no label leak.
        """
        return self.definition


def split_of(synset: str) -> str:
    """The split of a synset: ``"test"`` for about :data:`TEST_PERCENT` percent of ids, else ``"train"``.

    SHA-1 of the id rather than Python's ``hash()``, which is salted per process for strings.

    Args:
        synset: A synset id such as ``"n02084071"``.
    """
    return hash_split(synset, TEST_PERCENT)


@functools.lru_cache(maxsize=4)
def _read_file(path: str, mtime_ns: int, size: int) -> tuple[GlossExample, ...]:
    # mtime and size are part of the key so a rebuilt file is re-read rather than served stale.
    del mtime_ns, size
    records = []
    for _, fields in tsv_rows(path, COLUMNS):
        synset, supersense, lemmas, definition, examples = fields
        records.append(
            GlossExample(
                synset,
                supersense,
                tuple(lemmas.split(" ")),
                definition,
                tuple(examples.split(EXAMPLE_SEP)) if examples else (),
                split_of(synset),
            )
        )
    return tuple(records)


def read_gloss_file(path: str | os.PathLike[str] | None = None) -> tuple[GlossExample, ...]:
    """Every record of the gloss file at ``path`` (default: the packaged one), read once per file version.

    Args:
        path: A file written by :func:`~peft_ext.data.wordnet_build.build_wordnet_glosses`.
    """
    p = Path(path) if path is not None else DEFAULT_PATH
    return read_versioned(p, _read_file, "WordNet gloss file", "python -m peft_ext.data build")


def _check_supersenses(supersenses: Iterable[str]) -> list[str]:
    return check_class_names(supersenses, LEXNAMES, "supersenses")


def _key(r: GlossExample) -> str:
    return r.synset


def _label(r: GlossExample) -> str:
    return r.supersense


def load_wordnet_glosses(
    split: str | None = None,
    supersenses: Iterable[str] | None = None,
    max_per_class: int | None = None,
    seed: int = 0,
    path: str | os.PathLike[str] | None = None,
) -> list[GlossExample]:
    """Load WordNet 3.0 synsets labelled with their supersense, sorted by synset id.

    Args:
        split: ``"train"``, ``"test"`` or ``None`` for both.
        supersenses: Keep only these classes (names from :data:`LEXNAMES`); ``None`` keeps all.
        max_per_class: Keep at most this many synsets per class (within ``split``). The kept ones are those with the
            smallest SHA-1 of ``f"{seed}:{synset}"``, so the subset is deterministic, changes with ``seed``, and a
            smaller cap keeps a subset of what a larger one keeps. ``None`` keeps all.
        seed: Picks the capped subset; unused without ``max_per_class``.
        path: Gloss file to read; defaults to the one shipped with the package.

    Returns:
        The matching examples in synset-id order.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"`split` must be one of {SPLITS} or None, got {split!r}")
    if max_per_class is not None and (not isinstance(max_per_class, int) or max_per_class <= 0):
        raise ValueError(f"`max_per_class` must be a positive int or None, got {max_per_class!r}")
    wanted = set(_check_supersenses(supersenses)) if supersenses is not None else None
    records = [
        r
        for r in read_gloss_file(path)
        if (split is None or r.split == split) and (wanted is None or r.supersense in wanted)
    ]
    return cap_per_class(records, max_per_class, seed, _key, _label)


def class_counts(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, int]]:
    """Number of synsets per supersense and split: ``{supersense: {"train": n, "test": m}}``, in LEXNAMES order.

    Args:
        path: Gloss file to read; defaults to the one shipped with the package.
    """
    return count_by_class(read_gloss_file(path), LEXNAMES, _label, lambda r: r.split)


def wordnet_task_sequence(
    n_tasks: int = 5,
    classes_per_task: int = 4,
    seed: int = 0,
    train_per_class: int = 100,
    test_per_class: int = 40,
    protocol: str = "class-incremental",
    supersenses: Sequence[str] | None = None,
    path: str | os.PathLike[str] | None = None,
    val_per_class: int = 0,
) -> TaskSequence:
    """A continual-learning sequence of WordNet supersense-classification tasks with disjoint classes.

    A class is eligible when it has at least ``train_per_class + val_per_class`` train and ``test_per_class`` test
    synsets; at the
    default caps (100/40) that is 41 of the 45 supersenses (``adj.ppl``, ``noun.Tops``, ``noun.motive`` and
    ``verb.weather`` are too small). ``random.Random(seed).sample`` over the sorted eligible names picks and orders
    the classes, which are dealt to tasks ``classes_per_task`` at a time. Both default-cap layouts below sample 20
    classes, so they see the same 20 in the same order. At the default caps, seed 0 picks

    * 5x4: ``t0`` noun.state, noun.time, adv.all, noun.person; ``t1`` verb.consumption, verb.competition,
      noun.substance, noun.possession; ``t2`` verb.communication, noun.relation, noun.plant, verb.change; ``t3``
      noun.attribute, verb.perception, noun.animal, noun.communication; ``t4`` verb.social, noun.act, verb.contact,
      noun.cognition.
    * 10x2: ``t0`` noun.state, noun.time; ``t1`` adv.all, noun.person; ``t2`` verb.consumption, verb.competition;
      ``t3`` noun.substance, noun.possession; ``t4`` verb.communication, noun.relation; ``t5`` noun.plant,
      verb.change; ``t6`` noun.attribute, verb.perception; ``t7`` noun.animal, noun.communication; ``t8``
      verb.social, noun.act; ``t9`` verb.contact, noun.cognition.

    Each class contributes exactly ``train_per_class`` train and ``test_per_class`` test examples, chosen as in
    :func:`load_wordnet_glosses` with the same ``seed``. ``Example.inputs`` is :attr:`GlossExample.text` (the
    definition) and labels are global ids into ``class_names`` (the chosen supersenses in task order). Train examples
    are shuffled with a seeded RNG (so classes are interleaved); test examples stay in synset-id order.

    The validation split (``val_per_class`` > 0) is carved from the train-split synsets that the training data does
    not use: per class, the ``val_per_class`` synsets ranked right after the ``train_per_class`` training ones (the
    same seeded SHA-1 ranking), in synset-id order, less any whose gloss text is also a train or test example's (a
    few synsets share a definition). It is disjoint from train and test, reproducible from the seed,
    and asking for it changes neither the training nor the test examples (only, when a class is too small for both,
    which classes are eligible).

    Args:
        n_tasks: Number of tasks.
        classes_per_task: New classes per task.
        seed: Picks and orders the classes and the capped example subsets.
        train_per_class: Train examples per class.
        test_per_class: Test examples per class.
        protocol: ``"class-incremental"`` or ``"task-incremental"``.
        supersenses: Use exactly these classes in this order (``n_tasks * classes_per_task`` names, all eligible)
            instead of a seeded pick.
        path: Gloss file to read; defaults to the one shipped with the package.
        val_per_class: Validation examples per class (``Task.validation``; 0: none).
    """
    source = Path(path) if path is not None else DEFAULT_PATH
    return shipped_task_sequence(
        lambda: read_gloss_file(path),
        key=_key,
        label=_label,
        text=lambda r: r.text,
        split=lambda r: r.split,
        class_names=LEXNAMES,
        n_tasks=n_tasks,
        classes_per_task=classes_per_task,
        seed=seed,
        train_per_class=train_per_class,
        test_per_class=test_per_class,
        protocol=protocol,
        classes=supersenses,
        val_per_class=val_per_class,
        class_arg="supersenses",
        item_word="synsets",
        name=f"wordnet-supersenses-{n_tasks}x{classes_per_task}-seed{seed}",
        meta=lambda: {
            "dataset": "WordNet 3.0 gloss -> supersense (lexicographer file)",
            "source": source.name,
            "source_sha256": file_sha256(source),
            "license": "WordNet 3.0 license (peft_ext/data/files/WORDNET_LICENSE)",
            "input": "definition",
        },
        test_percent=TEST_PERCENT,
    )
