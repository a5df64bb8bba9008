"""Instruction tasks for continual instruction tuning, generated (no data files): string transformations of random
lower-case words, one instruction family per task.

Each family asks for a different function of the word (reverse it, upper-case it, give its length, ...), so the
families compete for the same weights and a model fine-tuned on one forgets another: the interference continual
instruction tuning measures. The words are drawn from a seeded generator, so a sequence is the same on every machine.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from .tasks import Example, Instruction, Task, TaskSequence

__all__ = ["INSTRUCTION_FAMILIES", "instruction_task_sequence"]

_VOWELS = set("aeiou")

#: family name -> (instruction, answer of a word). The prompt is ``"<instruction>: <word>"``.
INSTRUCTION_FAMILIES: dict[str, tuple[str, Callable[[str], str]]] = {
    "reverse": ("reverse", lambda w: w[::-1]),
    "upper": ("uppercase", str.upper),
    "length": ("count the letters", lambda w: str(len(w))),
    "vowels": ("count the vowels", lambda w: str(sum(c in _VOWELS for c in w))),
    "first": ("first letter", lambda w: w[0]),
    "last": ("last letter", lambda w: w[-1]),
    "sort": ("sort the letters", lambda w: "".join(sorted(w))),
    "double": ("double each letter", lambda w: "".join(c + c for c in w)),
}


def instruction_task_sequence(
    families: Sequence[str] = ("reverse", "upper", "length"),
    train_per_task: int = 64,
    test_per_task: int = 16,
    val_per_task: int = 0,
    min_len: int = 3,
    max_len: int = 6,
    seed: int = 0,
) -> TaskSequence:
    """A generation task sequence, one task per instruction family, over fresh random words per task.

    Args:
        families: Instruction families in task order (keys of :data:`INSTRUCTION_FAMILIES`), each at most once.
        train_per_task: Training examples per task.
        test_per_task: Test examples per task.
        val_per_task: Validation examples per task (0: none).
        min_len: Shortest word.
        max_len: Longest word.
        seed: Seeds the words.

    Returns:
        A ``kind="generation"`` :class:`TaskSequence` whose class names are the families; the train, test and
        validation words of a task are distinct.
    """
    unknown = [f for f in families if f not in INSTRUCTION_FAMILIES]
    if unknown or not families:
        raise ValueError(f"`families` must name some of {sorted(INSTRUCTION_FAMILIES)}, got {list(families)}")
    if len(set(families)) != len(families):
        raise ValueError(f"`families` lists a family twice: {list(families)}")
    if train_per_task < 1 or test_per_task < 1 or val_per_task < 0:
        raise ValueError(
            f"need train_per_task >= 1, test_per_task >= 1, val_per_task >= 0; got {train_per_task}, "
            f"{test_per_task}, {val_per_task}"
        )
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    needed = train_per_task + test_per_task + val_per_task
    if needed > sum(26**n for n in range(min_len, max_len + 1)):
        raise ValueError(f"{needed} distinct words per task need longer words than max_len={max_len}")
    rng = random.Random(seed)
    tasks = []
    for label, family in enumerate(families):
        instruction, answer = INSTRUCTION_FAMILIES[family]
        words: dict[str, None] = {}  # insertion-ordered set: the order depends on the seed only
        while len(words) < needed:
            word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(min_len, max_len)))
            words.setdefault(word)
        examples = [Example(Instruction(f"{instruction}: {w}", answer(w)), label) for w in words]
        train, rest = examples[:train_per_task], examples[train_per_task:]
        tasks.append(Task(f"t{label}:{family}", [label], train, rest[:test_per_task], rest[test_per_task:]))
    meta = {"source": "instruction_task_sequence", "families": list(families), "seed": seed}
    return TaskSequence("instructions-" + "-".join(families), list(families), tasks, meta=meta, kind="generation")
