"""Batch builders that turn task examples into model inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from .tasks import Example


class TextCollator:
    """Tokenize a list of text examples with dynamic padding (to the longest in the batch, at most ``max_length``).

    Args:
        tokenizer: A transformers tokenizer.
        max_length: Truncation length in tokens.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int = 64) -> None:
        if max_length < 2:
            raise ValueError(f"`max_length` must be >= 2 tokens, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, examples: Sequence[Example]) -> dict[str, Any]:
        texts = [ex.inputs for ex in examples]
        bad = [t for t in texts if not isinstance(t, str)]
        if bad:
            raise TypeError(f"TextCollator needs string inputs, got {type(bad[0]).__name__}")
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        return {
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "labels": torch.tensor([ex.label for ex in examples], dtype=torch.long),
        }
