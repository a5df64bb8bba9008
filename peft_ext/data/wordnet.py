"""WordNet 3.0 gloss classification: predict a synset's supersense (lexicographer file) from its definition.

The package ships ``files/wordnet_glosses.tsv.xz``, one row per WordNet 3.0 synset (117,659 rows). Its declaration
(source, license, columns, split rule) is :data:`~peft_ext.data.registry.WORDNET`; ``python -m peft_ext.data build
wordnet`` rebuilds it from Debian's ``wordnet-base`` (:mod:`.wordnet_build`). Loading it needs nothing outside this
package.

The train/test split is a fixed function of the synset id (a SHA-1 hash, about 20% test), so it never depends on
the caps, the seed or the classes asked for, and a synset is in the same split in every task sequence.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .registry import WORDNET
from .shipped import SPLITS
from .tasks import TaskSequence

__all__ = [
    "DEFAULT_PATH",
    "LEXNAMES",
    "SPLITS",
    "TEST_PERCENT",
    "GlossExample",
    "class_counts",
    "gloss_from_row",
    "load_wordnet_glosses",
    "read_gloss_file",
    "split_of",
    "wordnet_task_sequence",
]

#: The 45 supersenses, indexed by the ``lex_filenum`` field of the data files (WordNet's lexnames(5WN)).
LEXNAMES: tuple[str, ...] = WORDNET.class_names
TEST_PERCENT = WORDNET.split_rule.test_percent
DEFAULT_PATH = WORDNET.path
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
    return WORDNET.split_rule.of(synset)


def gloss_from_row(path: str, lineno: int, fields: list[str]) -> GlossExample:
    """One row of the gloss file as a record (every field is free text, so any row of five fields is one)."""
    del path, lineno
    synset, supersense, lemmas, definition, examples = fields
    return GlossExample(
        synset,
        supersense,
        tuple(lemmas.split(" ")),
        definition,
        tuple(examples.split(EXAMPLE_SEP)) if examples else (),
        split_of(synset),
    )


def read_gloss_file(path: str | os.PathLike[str] | None = None) -> tuple[GlossExample, ...]:
    """Every record of the gloss file at ``path`` (default: the packaged one), read once per file version.

    Args:
        path: A file written by ``python -m peft_ext.data build wordnet``.
    """
    return WORDNET.read(path)


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
    return WORDNET.load(split, supersenses, max_per_class=max_per_class, seed=seed, path=path)


def class_counts(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, int]]:
    """Number of synsets per supersense and split: ``{supersense: {"train": n, "test": m}}``, in LEXNAMES order.

    Args:
        path: Gloss file to read; defaults to the one shipped with the package.
    """
    return WORDNET.class_counts(path)


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
    """A continual-learning sequence of WordNet supersense-classification tasks with disjoint classes, built as every
    shipped data set's is (:meth:`~peft_ext.data.shipped.ShippedDataset.task_sequence` documents how: eligible
    classes, seeded picks and caps, the validation carve). ``Example.inputs`` is :attr:`GlossExample.text`.

    At the default caps (100/40) 41 of the 45 supersenses are eligible (``adj.ppl``, ``noun.Tops``, ``noun.motive``
    and ``verb.weather`` are too small). Both default-cap layouts below sample 20 classes, so they see the same 20 in
    the same order; seed 0 picks

    * 5x4: ``t0`` noun.state, noun.time, adv.all, noun.person; ``t1`` verb.consumption, verb.competition,
      noun.substance, noun.possession; ``t2`` verb.communication, noun.relation, noun.plant, verb.change; ``t3``
      noun.attribute, verb.perception, noun.animal, noun.communication; ``t4`` verb.social, noun.act, verb.contact,
      noun.cognition.
    * 10x2: ``t0`` noun.state, noun.time; ``t1`` adv.all, noun.person; ``t2`` verb.consumption, verb.competition;
      ``t3`` noun.substance, noun.possession; ``t4`` verb.communication, noun.relation; ``t5`` noun.plant,
      verb.change; ``t6`` noun.attribute, verb.perception; ``t7`` noun.animal, noun.communication; ``t8``
      verb.social, noun.act; ``t9`` verb.contact, noun.cognition.

    Args:
        supersenses: Use exactly these classes in this order (``n_tasks * classes_per_task`` names, all eligible)
            instead of a seeded pick.
        n_tasks, classes_per_task, seed, train_per_class, test_per_class, protocol, path, val_per_class: As
            :meth:`~peft_ext.data.shipped.ShippedDataset.task_sequence` takes them.
    """
    return WORDNET.task_sequence(
        n_tasks, classes_per_task, seed, train_per_class, test_per_class, protocol, supersenses, path, val_per_class
    )
