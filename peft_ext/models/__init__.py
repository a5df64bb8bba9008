"""Model loaders: the offline MiniLM-L6 text classifier and tiny random transformers for tests."""

from __future__ import annotations

from .text import (
    SentenceClassifier,
    load_causal_lm,
    load_pretrained_quietly,
    load_text_classifier,
    minilm_path,
    resolve_backbone,
)
from .tiny import tiny_bert, tiny_clip, tiny_llama, tiny_qwen2, tiny_vit

__all__ = [
    "SentenceClassifier",
    "load_pretrained_quietly",
    "load_causal_lm",
    "load_text_classifier",
    "minilm_path",
    "resolve_backbone",
    "tiny_bert",
    "tiny_clip",
    "tiny_llama",
    "tiny_qwen2",
    "tiny_vit",
]
