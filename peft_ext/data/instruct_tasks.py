"""Instruction tasks made of real data: six families of ``(prompt, answer)`` pairs built from the two shipped data
sets (WordNet 3.0 glosses and the fortunes), for continual instruction tuning of a small chat model.

Each family (:data:`INSTRUCTION_TASKS`) asks a different question in a different format: a noun's category, the word a
definition defines, a word's part of speech, a fortune's topic, a word's definition, the word an example sentence
illustrates. Prompts are short plain-English instructions (prompt and answer together at most :data:`MAX_WORDS`
words, about 60 tokens of a chat LLM's tokenizer), answers are lower-case where they are labels, and an item whose
answer would be ambiguous is dropped (a noun of two categories, a definition two words share, ...).

Splits: an item's train/test split is a fixed function of its key (:class:`~.provenance.HashSplit`), whatever the
sizes asked for. The WordNet families key every item by the word it asks about or for, so a word is in the same split
in all of them (a test word of one family is never a training word of another); the fortunes keep the split of the
shipped classification data (by text). :func:`shipped_instruction_sequence` then takes a seeded sample within each
split, the validation examples from the train split, never the test one.
"""

from __future__ import annotations

import difflib
import functools
import json
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .provenance import HashSplit
from .registry import FORTUNES, SHIPPED, WORDNET
from .shipped import file_sha256, seeded_rank
from .tasks import Example, Instruction, Task, TaskSequence

__all__ = [
    "INSTRUCTION_TASKS",
    "MAX_WORDS",
    "InstructionTask",
    "check_families",
    "instruction_candidates",
    "shipped_instruction_sequence",
    "write_trl_files",
]

#: The most words a prompt and its answer may have together: about 60 tokens, what a 135M chat model on two CPU
#: cores trains on in reasonable time.
MAX_WORDS = 40
#: ``(key, prompt, answer)``: one item of a family.
Triple = tuple[str, str, str]


@dataclass(frozen=True)
class InstructionTask:
    """One family of shipped instruction tasks, declared.

    Args:
        name: The family's name, the task's class name (``"supersense"``).
        source: The shipped data set it reads (a name of :data:`~peft_ext.data.registry.SHIPPED`).
        describe: One line: what the prompt holds and what the answer is.
        metric: ``"exact_match"`` where the answer is a label or a word, ``"rouge_l"`` where it is a sentence.
        build: ``records of the data set -> (key, prompt, answer) triples``; a key may come more than once (the first
            triple is kept) and a triple whose answer is ambiguous is left out. The WordNet builders judge ambiguity
            on every sense of a word, from an index of the same file built once per process.
        split_rule: The train/test rule, applied to the key.
        labels: The closed set of answers of a label family (the sample is balanced over them), ``None`` for open
            answers.
    """

    name: str
    source: str
    describe: str
    metric: str
    build: Callable[[Sequence[Any]], Iterable[Triple]]
    split_rule: HashSplit
    labels: tuple[str, ...] | None = None


# ---------------------------------------------------------------------------------------------------------------
# WordNet: a lemma index over the whole of WordNet, so ambiguity is judged on every sense, not only the kept ones

# Lower-case words, one space or hyphen between parts: common words and phrases, no proper nouns or genus names; at
# most three words, so an exact-match answer stays a word, not a phrase ("department of computer science").
_WORD = re.compile(r"[a-z]+(?:-[a-z]+)*(?: [a-z]+(?:-[a-z]+)*){0,2}")
_NON_WORD = re.compile(r"[^a-z-]+")
_NON_LETTER = re.compile(r"[^a-z]+")
_POS = {"n": "noun", "v": "verb", "a": "adjective", "r": "adverb"}
# Eight noun supersenses that one plain word names for a chat model; the abstract ones (noun.act, noun.state,
# noun.cognition, ...) have no such word.
_SUPERSENSES = {
    "noun.animal": "animal",
    "noun.artifact": "artifact",
    "noun.body": "body",
    "noun.food": "food",
    "noun.location": "location",
    "noun.person": "person",
    "noun.plant": "plant",
    "noun.time": "time",
}
# WordNet's morphy detachment rules (morphy(7WN)): a word such as "building" is a noun lemma and also a regular form
# of the verb "build", so its part of speech is not one, although only one lists it as a lemma.
_INFLECTIONS = {
    "noun": (("s", ""), ("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"), ("men", "man"),
             ("ies", "y")),
    "verb": (("s", ""), ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"), ("ing", "")),
    "adjective": (("er", ""), ("est", ""), ("er", "e"), ("est", "e")),
}  # fmt: skip


def _word(lemma: str) -> str | None:
    """A lemma as the word a prompt shows (underscores to spaces), ``None`` unless it is a lower-case word."""
    word = lemma.replace("_", " ")
    return word if _WORD.fullmatch(word) else None


@functools.lru_cache(maxsize=1)
def _senses() -> dict[str, tuple[Any, ...]]:
    """Every lemma of WordNet, lower-cased, with the synsets that list it (all senses, all parts of speech)."""
    senses: dict[str, list[Any]] = defaultdict(list)
    for r in WORDNET.read():
        for lemma in r.lemmas:
            senses[lemma.lower().replace("_", " ")].append(r)
    return {word: tuple(rs) for word, rs in senses.items()}


@functools.lru_cache(maxsize=1)
def _common_words() -> tuple[str, ...]:
    """The lemmas WordNet spells in lower case only, as words: no proper-noun sense ("Paris", "Bass")."""
    proper = {lemma.lower() for r in WORDNET.read() for lemma in r.lemmas if lemma != lemma.lower()}
    return tuple(w for w in _senses() if _WORD.fullmatch(w) and w.replace(" ", "_") not in proper)


def _parts_of_speech(word: str) -> set[str]:
    """The parts of speech ``word`` has as a lemma or as a regular inflection of a lemma."""
    senses = _senses()
    parts = {_POS[r.synset[0]] for r in senses.get(word, ())}
    for pos, rules in _INFLECTIONS.items():
        for suffix, ending in rules:
            if word.endswith(suffix) and len(word) > len(suffix):
                base = word[: -len(suffix)] + ending
                if any(_POS[r.synset[0]] == pos for r in senses.get(base, ())):
                    parts.add(pos)
    return parts


def _short(text: str, most: int) -> bool:
    return len(text.split()) <= most


def _plain(definition: str, most: int) -> bool:
    """At most ``most`` words and no quotation marks: a few WordNet glosses carry a quoted example or a stray quote
    (files/README.md), which would break the quotes the prompt puts around the definition."""
    return _short(definition, most) and '"' not in definition


def _contains(text: str, word: str) -> bool:
    """Whether ``word`` (a :data:`_WORD`) is in ``text`` as whole words, ignoring case and punctuation (a hyphenated
    word is one word: "self-supporting" does not contain "supporting")."""
    return f" {word} " in " " + _NON_WORD.sub(" ", text.lower()) + " "


def _gives_away(definition: str, word: str) -> bool:
    """Whether ``definition`` contains ``word`` or one of its parts' sequence, also inside a hyphenated word ("by
    broad-mindedness" gives away "broad")."""
    return f" {word.replace('-', ' ')} " in " " + _NON_LETTER.sub(" ", definition.lower()) + " "


def _supersense(records: Sequence[Any]) -> Iterator[Triple]:
    names = sorted(_SUPERSENSES.values())
    choices = ", ".join(names[:-1]) + f" or {names[-1]}"
    senses = _senses()
    for word in _common_words():
        nouns = {r.supersense for r in senses[word] if r.synset[0] == "n"}
        if len(nouns) == 1 and (sense := nouns.pop()) in _SUPERSENSES:
            prompt = f'Which category does the noun "{word}" belong to: {choices}? Answer with one word.'
            yield word, prompt, _SUPERSENSES[sense]


def _gloss_to_word(records: Sequence[Any]) -> Iterator[Triple]:
    # A definition two synsets with different first words share has no single answer.
    answers: dict[str, set[str]] = defaultdict(set)
    for r in records:
        answers[r.definition].add(r.lemmas[0])
    for r in records:
        word = _word(r.lemmas[0])
        definition = r.definition
        if word and len(answers[definition]) == 1 and _plain(definition, 14) and not _gives_away(definition, word):
            yield word, f'Which word means "{definition}"? Answer with the word only.', word


def _part_of_speech(records: Sequence[Any]) -> Iterator[Triple]:
    for word in _common_words():
        parts = _parts_of_speech(word)
        if len(parts) == 1:
            prompt = f'Is "{word}" a noun, a verb, an adjective or an adverb? Answer with one word.'
            yield word, prompt, parts.pop()


def _define(records: Sequence[Any]) -> Iterator[Triple]:
    senses = _senses()
    for r in records:
        for lemma in r.lemmas:
            word = _word(lemma)
            # One sense in the whole of WordNet: the definition is the word's, not one of several. A definition of one
            # or two words is a synonym, which ROUGE-L scores as an exact match.
            if word and len(senses[word]) == 1 and _plain(r.definition, 12) and len(r.definition.split()) >= 3:
                yield word, f'Define "{word}" in a few words.', r.definition


def _example_to_word(records: Sequence[Any]) -> Iterator[Triple]:
    # An example sentence two synsets share illustrates two words.
    owners = Counter(example for r in records for example in set(r.examples))
    for r in records:
        words = [w for w in map(_word, r.lemmas) if w]
        for example in r.examples:
            # Attributed quotations ("... - John Galsworthy"), elisions and stray quotes are not plain sentences.
            if owners[example] > 1 or not _short(example, 24) or re.search(r' - |\.\.\.|"', example):
                continue
            present = [w for w in words if _contains(example, w)]
            if len(present) == 1:
                prompt = f'Which word does this sentence show in use? Answer with the word only.\n"{example}"'
                yield present[0], prompt, present[0]


def _fortune_topic(records: Sequence[Any]) -> Iterator[Triple]:
    topics = FORTUNES.class_names
    choices = ", ".join(topics[:-1]) + f" or {topics[-1]}"
    for r in records:
        if _short(r.text, 30):
            yield r.text, f'Which topic is this saying about: {choices}? Answer with one word.\n"{r.text}"', r.category


# Every WordNet family keys by the word, so a word has one split in all of them; 20 % test as the gloss data set.
_WORD_SPLIT = HashSplit(column="word", test_percent=WORDNET.split_rule.test_percent)

#: The families of shipped instruction tasks, by name, in their default task order.
INSTRUCTION_TASKS: dict[str, InstructionTask] = {
    spec.name: spec
    for spec in (
        InstructionTask(
            "supersense",
            "wordnet",
            "a noun -> its category, one of 8 listed in the prompt",
            "exact_match",
            _supersense,
            _WORD_SPLIT,
            tuple(sorted(_SUPERSENSES.values())),
        ),
        InstructionTask(
            "gloss_to_word",
            "wordnet",
            "a definition -> the word it defines",
            "exact_match",
            _gloss_to_word,
            _WORD_SPLIT,
        ),
        InstructionTask(
            "part_of_speech",
            "wordnet",
            "a word -> its part of speech (noun, verb, adjective or adverb)",
            "exact_match",
            _part_of_speech,
            _WORD_SPLIT,
            tuple(_POS.values()),
        ),
        InstructionTask(
            "fortune_topic",
            "fortunes",
            "a fortune cookie -> its topic, one of 12 listed in the prompt",
            "exact_match",
            _fortune_topic,
            FORTUNES.split_rule,
            FORTUNES.class_names,
        ),
        InstructionTask("define", "wordnet", "a word -> its definition", "rouge_l", _define, _WORD_SPLIT),
        InstructionTask(
            "example_to_word",
            "wordnet",
            "an example sentence -> the word it shows in use",
            "exact_match",
            _example_to_word,
            _WORD_SPLIT,
        ),
    )
}


def check_families(families: Iterable[str]) -> list[str]:
    """``families`` as a list: names of :data:`INSTRUCTION_TASKS`, each at most once, at least one.

    Raises:
        ValueError: A bare string, an empty list, an unknown name (with the closest one and every valid one) or a
            name given twice.
    """
    if isinstance(families, str):
        raise ValueError(f"`tasks` must be a list of family names, not the string {families!r}")
    families = list(families)
    if not families:
        raise ValueError(f"`tasks` is empty: name some of {list(INSTRUCTION_TASKS)}")
    for name in families:
        if name not in INSTRUCTION_TASKS:
            close = difflib.get_close_matches(str(name), list(INSTRUCTION_TASKS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"`tasks` names an unknown family {name!r}{hint}; valid: {list(INSTRUCTION_TASKS)}")
    twice = sorted({name for name in families if families.count(name) > 1})
    if twice:
        raise ValueError(f"`tasks` lists {twice} more than once; each family is one task")
    return families


@functools.lru_cache(maxsize=16)
def instruction_candidates(family: str) -> dict[str, tuple[Triple, ...]]:
    """Every item of ``family`` by split, ``{"train": (key, prompt, answer) ..., "test": ...}``, in the order the
    family builds them: one per key (the first), none longer than :data:`MAX_WORDS` words. Built once per process.
    """
    spec = INSTRUCTION_TASKS[check_families([family])[0]]
    seen: set[str] = set()
    splits: dict[str, list[Triple]] = {"train": [], "test": []}
    for key, prompt, answer in spec.build(SHIPPED[spec.source].read()):
        if key in seen or len(prompt.split()) + len(answer.split()) > MAX_WORDS:
            continue
        seen.add(key)
        splits[spec.split_rule.of(key)].append((key, prompt, answer))
    return {split: tuple(items) for split, items in splits.items()}


def _ranked(spec: InstructionTask, items: Sequence[Triple], seed: int) -> list[Triple]:
    """``items`` in the seeded order the sample takes them in: by SHA-1 of ``seed``, family and key, and for a label
    family round-robin over its labels, so any prefix is as balanced as the labels allow."""
    ranked = sorted(items, key=lambda item: seeded_rank(seed, f"{spec.name}:{item[0]}"))
    if spec.labels is None:
        return ranked
    by_label = {label: [item for item in ranked if item[2] == label] for label in spec.labels}
    longest = max(len(members) for members in by_label.values())
    return [members[i] for i in range(longest) for members in by_label.values() if i < len(members)]


def shipped_instruction_sequence(
    tasks: Sequence[str] | None = None,
    train_per_task: int = 64,
    test_per_task: int = 32,
    val_per_task: int = 16,
    seed: int = 0,
    name: str | None = None,
) -> TaskSequence:
    """A generation task sequence of shipped instruction tasks, one task per family.

    Within each family's hash split (:func:`instruction_candidates`), items are ranked by the SHA-1 of ``seed``, the
    family and the key (a label family's round-robin over its labels, so the sample is balanced); the train split's
    first ``train_per_task`` are the training examples and the next ``val_per_task`` the validation ones, the test
    split's first ``test_per_task`` the test ones. The sample of a family depends on the seed and sizes, not on the
    task order, so sequences that reorder the same families train and score the same examples. Each split's examples
    are then shuffled with ``random.Random(f"{seed}:{family}:{split}")``.

    Args:
        tasks: Family names of :data:`INSTRUCTION_TASKS` in task order (default: all, in the registry's order).
        train_per_task: Training examples per task.
        test_per_task: Test examples per task.
        val_per_task: Validation examples per task, carved from the train split (0: none).
        seed: Picks and orders the examples.
        name: The sequence's name (default ``"instruct-<families>-seed<seed>"``).

    Returns:
        A ``kind="generation"`` :class:`~.tasks.TaskSequence` whose class names are the families; task ``i`` is
        ``Task(f"t{i}:{family}", [i], ...)`` with the family's ``metric``.

    Raises:
        ValueError: A bad family list (:func:`check_families`), a size below 1 (``val_per_task`` below 0), or more
            examples asked than a split holds (with how many it holds).
    """
    families = check_families(list(INSTRUCTION_TASKS) if tasks is None else tasks)
    for key, value, least in (
        ("train_per_task", train_per_task, 1),
        ("test_per_task", test_per_task, 1),
        ("val_per_task", val_per_task, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"`{key}` must be an int >= {least}, got {value!r}")
    built = []
    for label, family in enumerate(families):
        spec = INSTRUCTION_TASKS[family]
        candidates = instruction_candidates(family)
        have = {split: len(items) for split, items in candidates.items()}
        if train_per_task + val_per_task > have["train"]:
            raise ValueError(
                f"instruction task {family!r} has {have['train']} items in its train split, fewer than "
                f"train_per_task + val_per_task = {train_per_task} + {val_per_task}; ask for at most {have['train']}"
            )
        if test_per_task > have["test"]:
            raise ValueError(
                f"instruction task {family!r} has {have['test']} items in its test split, fewer than "
                f"test_per_task = {test_per_task}; ask for at most {have['test']}"
            )
        train_pool = _ranked(spec, candidates["train"], seed)
        parts = {
            "train": train_pool[:train_per_task],
            "validation": train_pool[train_per_task : train_per_task + val_per_task],
            "test": _ranked(spec, candidates["test"], seed)[:test_per_task],
        }
        examples = {}
        for split, items in parts.items():
            shuffled = [Example(Instruction(prompt, answer), label) for _, prompt, answer in items]
            random.Random(f"{seed}:{family}:{split}").shuffle(shuffled)
            examples[split] = shuffled
        built.append(
            Task(
                f"t{label}:{family}",
                [label],
                examples["train"],
                examples["test"],
                examples["validation"],
                metric=spec.metric,
            )
        )
    sources = sorted({INSTRUCTION_TASKS[f].source for f in families})
    meta = {
        "dataset": "shipped instruction tasks",
        "sources": {
            s: {"file": SHIPPED[s].file, "sha256": file_sha256(SHIPPED[s].path), "license": str(SHIPPED[s].license)}
            for s in sources
        },
        "families": {
            f: {"source": INSTRUCTION_TASKS[f].source, "metric": INSTRUCTION_TASKS[f].metric} for f in families
        },
        "seed": seed,
        "train_per_task": train_per_task,
        "test_per_task": test_per_task,
        "val_per_task": val_per_task,
        "candidates": {f: {s: len(items) for s, items in instruction_candidates(f).items()} for f in families},
    }
    return TaskSequence(
        name or f"instruct-{'-'.join(families)}-seed{seed}", list(families), built, meta=meta, kind="generation"
    )


def write_trl_files(sequence: TaskSequence, folder: str | Path) -> list[Path]:
    """Write a generation sequence as JSONL files in TRL's prompt-completion format (``{"prompt": ..., "completion":
    ...}``), one per task and non-empty split, named ``<class name>.<split>.jsonl`` (overwriting them), which
    :func:`~peft_ext.data.user_instructions.instruction_sequence_from_files` reads back.

    Args:
        sequence: A ``kind="generation"`` sequence, e.g. from :func:`shipped_instruction_sequence`.
        folder: Where to write (created if missing).

    Returns:
        The files written, task by task, in the order train, validation, test.
    """
    if not sequence.holds_instructions:
        raise ValueError(f"`sequence` {sequence.name!r} holds {sequence.kind} tasks; TRL files hold instructions")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for task in sequence.tasks:
        family = sequence.class_names[task.classes[0]]
        for split in ("train", "validation", "test"):
            examples = getattr(task, split)
            if not examples:
                continue
            path = out / f"{family}.{split}.jsonl"
            rows = (
                json.dumps({"prompt": ex.inputs.prompt, "completion": ex.inputs.answer}, ensure_ascii=False) + "\n"
                for ex in examples
            )
            path.write_text("".join(rows), encoding="utf-8")
            written.append(path)
    return written
