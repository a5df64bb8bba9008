"""Every data set a job's ``data.dataset`` can name: the shipped ones declared (:data:`SHIPPED`: source, license,
file, columns, split rule, classes and the code that parses and builds them), the instruction tasks built from them
(:data:`SHIPPED_INSTRUCTIONS`), and the kinds that read the user's own files (:data:`USER_DATASETS`). Each declares
what its task sequences hold (:func:`sequence_kind`): labelled texts for a classifier, or instructions for a causal LM.

A new shipped data set is one more :class:`~.shipped.ShippedDataset` here, a record type with its row parser, a
build function from its source files, its file and license in ``files/``; ``python -m peft_ext.data build NAME``
then rebuilds it, and the job, the config check and the benchmarks find it by name.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from .provenance import DebianSource, HashSplit, License
from .shipped import ShippedDataset
from .tasks import SEQUENCE_KINDS

__all__ = [
    "DATASETS",
    "FORTUNES",
    "INSTRUCT",
    "SHIPPED",
    "SHIPPED_INSTRUCTIONS",
    "USER_DATASETS",
    "WORDNET",
    "ShippedInstructions",
    "UserDataset",
    "check_dataset",
    "is_instruction_dataset",
    "sequence_kind",
    "shipped_dataset",
]


WORDNET = ShippedDataset(
    name="wordnet",
    describe="WordNet 3.0 gloss -> supersense",
    title="WordNet 3.0 gloss -> supersense (lexicographer file)",
    file="wordnet_glosses.tsv.xz",
    columns=("synset", "supersense", "lemmas", "definition", "examples"),
    key="synset",
    label="supersense",
    # The definition alone: a lemma often names its class outright ("dog"), and most synsets have no examples.
    text="definition",
    input="definition",
    split_rule=HashSplit(column="synset", test_percent=20),
    # The lexicographer files of lexnames(5WN), in the order of the data files' ``lex_filenum`` field.
    class_names=(
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
    ),
    class_arg="supersenses",
    item_word="synsets",
    source=DebianSource(
        package="wordnet-base",
        version="1:3.0-37",
        folder="/usr/share/wordnet",
        files=("data.adj", "data.adv", "data.noun", "data.verb"),
        upstream="Princeton WordNet 3.0 database files (https://wordnet.princeton.edu)",
    ),
    license=License("WordNet 3.0 license", "WORDNET_LICENSE"),
    record="peft_ext.data.wordnet:gloss_from_row",
    build="peft_ext.data.wordnet_build:gloss_rows",
    sequence_name="wordnet-supersenses",
    defaults={"n_tasks": 5, "classes_per_task": 4, "train_per_class": 80, "test_per_class": 40},
)

# The fortune files used, one class each: topics that fortune-mod's ``cookie-files`` describes as distinct and that
# keep at least 130 entries after filtering (files/README.md).
_FORTUNE_TOPICS = (
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

FORTUNES = ShippedDataset(
    name="fortunes",
    describe="fortune cookie -> fortune file (topic)",
    title="Debian fortunes: fortune -> fortune file (topic)",
    file="fortunes.tsv.xz",
    columns=("id", "category", "text"),
    key="text",
    label="category",
    text="text",
    input="text (attribution removed)",
    # More test than WordNet's 20 %: the classes are small. By text, so a text is in one split whatever its id.
    split_rule=HashSplit(column="text", test_percent=30),
    class_names=_FORTUNE_TOPICS,
    class_arg="categories",
    item_word="entries",
    source=DebianSource(
        package="fortunes",
        version="1:1.99.1-7.3",
        folder="/usr/share/games/fortunes",
        files=_FORTUNE_TOPICS,
        upstream="fortune-mod 1.99.1 data files (https://github.com/shlomif/fortune-mod)",
    ),
    license=License("fortune-mod BSD license", "FORTUNES_LICENSE"),
    record="peft_ext.data.fortunes:fortune_from_row",
    build="peft_ext.data.fortunes_build:fortune_rows",
    sequence_name="fortunes",
    defaults={"n_tasks": 4, "classes_per_task": 3, "train_per_class": 60, "test_per_class": 30},
)

#: The data sets that ship with the package, by their ``data.dataset`` name.
SHIPPED: dict[str, ShippedDataset] = {data.name: data for data in (WORDNET, FORTUNES)}


@dataclass(frozen=True)
class ShippedInstructions:
    """Instruction tasks built from shipped data sets (no file of their own): a ``data.dataset`` name whose sequences
    hold :class:`~.tasks.Instruction` examples, for a ``causal_lm``.

    Args:
        name: Its ``data.dataset`` name.
        describe: One line for messages and docs.
        sources: The shipped data sets its tasks read.
    """

    name: str
    describe: str
    sources: tuple[ShippedDataset, ...]

    @property
    def kind(self) -> str:
        """What its task sequences hold: ``"generation"`` (instructions)."""
        return "generation"


#: Instruction tasks of real data: WordNet and fortune questions in plain English (:mod:`.instruct_tasks`).
INSTRUCT = ShippedInstructions(
    name="instruct",
    describe="instruction tasks from WordNet 3.0 and the fortunes, for a `causal_lm` (docs/continual_instruct.md)",
    sources=(WORDNET, FORTUNES),
)

#: The instruction task sets that ship with the package, by their ``data.dataset`` name.
SHIPPED_INSTRUCTIONS: dict[str, ShippedInstructions] = {INSTRUCT.name: INSTRUCT}


@dataclass(frozen=True)
class UserDataset:
    """A ``data.dataset`` kind that reads the user's own files.

    Args:
        describe: What it reads, and where it is documented.
        kind: What its task sequences hold: ``"classification"`` (labelled texts) or ``"generation"`` (instructions).
    """

    describe: str
    kind: str


#: The ``data.dataset`` names that read the user's own files, and what they read.
USER_DATASETS: dict[str, UserDataset] = {
    "files": UserDataset(
        "your own classification data, read by Hugging Face `datasets` (docs/own_data.md)", "classification"
    ),
    "instructions": UserDataset(
        "instruction tasks in TRL's formats for a `causal_lm` (docs/continual_instruct.md)", "generation"
    ),
}

#: Every name ``data.dataset`` takes.
DATASETS: tuple[str, ...] = (*SHIPPED, *SHIPPED_INSTRUCTIONS, *USER_DATASETS)


def _did_you_mean(value: object, valid: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(str(value), valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_dataset(name: object) -> str:
    """``name`` when ``data.dataset`` may take it (:data:`DATASETS`); otherwise ``ValueError`` naming it, the
    closest valid name and every valid one."""
    if name not in DATASETS:
        raise ValueError(f"`dataset` must be one of {list(DATASETS)}, got {name!r}{_did_you_mean(name, DATASETS)}")
    return name  # type: ignore[return-value]


def sequence_kind(name: str) -> str:
    """What the task sequences of ``data.dataset`` ``name`` hold, as its declaration says: ``"classification"``
    (labelled texts, for a ``classifier``) or ``"generation"`` (instructions, for a ``causal_lm``); ``ValueError`` for
    an unknown name (:func:`check_dataset`)."""
    check_dataset(name)
    if name in SHIPPED:
        return "classification"  # a ShippedDataset is a file of labelled texts
    return {**SHIPPED_INSTRUCTIONS, **USER_DATASETS}[name].kind


def is_instruction_dataset(name: str) -> bool:
    """Whether ``data.dataset`` ``name`` holds instruction tasks, which train a ``causal_lm`` (and only it)."""
    return SEQUENCE_KINDS[sequence_kind(name)].holds_instructions


def shipped_dataset(name: str) -> ShippedDataset:
    """The shipped data set called ``name``; otherwise ``ValueError`` naming it, the closest name and every shipped
    one."""
    if name not in SHIPPED:
        raise ValueError(
            f"no shipped data set {name!r}{_did_you_mean(name, list(SHIPPED))}; shipped: {', '.join(SHIPPED)}"
        )
    return SHIPPED[name]
