"""Passes that score each example on its own (evaluation, a head's statistics) read the examples shortest first, so
batches pad less; what they compute does not depend on the order."""

from __future__ import annotations

import random

import pytest
import torch

from peft_ext.continual.context import by_length
from peft_ext.continual.evaluation import evaluate_heads
from peft_ext.data.tasks import Example
from peft_ext.data.user_data import Tokenized

from .helpers import tiny_classifier


def _texts(n: int = 40, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    words = ["ab", "cd", "efg", "hi", "jklm", "no", "pq"]
    return [Example(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))), i % 3) for i in range(n)]


def _collate(batches: list[int]):
    """Characters as token ids (a-z -> 2..27, space 1), right-padded with 0 to the batch's longest; records each
    batch's padded length."""

    def collate(examples):
        ids = [[1 if ch == " " else ord(ch) - 95 for ch in ex.inputs] for ex in examples]
        width = max(map(len, ids))
        batches.append(width)
        padded = torch.tensor([row + [0] * (width - len(row)) for row in ids])
        return {
            "input_ids": padded,
            "attention_mask": (padded > 0).long(),
            "labels": torch.tensor([e.label for e in examples]),
        }

    return collate


def test_by_length_sorts_texts_pairs_and_token_ids_stably_and_leaves_other_inputs():
    texts = [Example("ccc", 0), Example("a", 1), Example("bb", 2), Example("d", 3)]
    assert [e.label for e in by_length(texts)] == [1, 3, 2, 0]  # "a" before "d": stable
    pairs = [Example(("aaa", "b"), 0), Example(("a", "b"), 1)]
    assert [e.label for e in by_length(pairs)] == [1, 0]
    tokens = [Example(Tokenized("x", (1, 2, 3)), 0), Example(Tokenized("y", (1,)), 1)]
    assert [e.label for e in by_length(tokens)] == [1, 0]
    tensors = [Example(torch.zeros(3), 0), Example(torch.zeros(1), 1)]
    assert [e.label for e in by_length(tensors)] == [0, 1]  # no length known: the order stays


def test_evaluation_pads_less_and_scores_the_same_in_any_order():
    model = tiny_classifier(3)
    examples = _texts()
    widths: list[int] = []
    got = evaluate_heads(model, examples, [0, 1, 2], 3, _collate(widths), torch.device("cpu"), {"": None}, 8)
    assert widths == sorted(widths)  # shortest first
    unsorted_widths: list[int] = []
    for start in range(0, len(examples), 8):
        _collate(unsorted_widths)(examples[start : start + 8])
    assert sum(widths) < 0.8 * sum(unsorted_widths)  # less padding than the given order
    shuffled = examples[:]
    random.Random(1).shuffle(shuffled)
    again = evaluate_heads(model, shuffled, [0, 1, 2], 3, _collate([]), torch.device("cpu"), {"": None}, 8)
    assert got == again
    # the accuracy is the examples' own: each scored alone gives the same
    alone = sum(
        evaluate_heads(model, [ex], [0, 1, 2], 3, _collate([]), torch.device("cpu"), {"": None}, 1)[""]
        for ex in examples
    )
    assert got[""] == pytest.approx(alone / len(examples))
