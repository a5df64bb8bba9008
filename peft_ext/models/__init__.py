"""Model loaders: the offline MiniLM-L6 text classifier, the offline SmolLM2-135M-Instruct causal LM and tiny random
transformers for tests."""

from __future__ import annotations

from .smollm2 import SMOLLM2, smollm2_gguf, smollm2_path
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
    "SMOLLM2",
    "SentenceClassifier",
    "load_pretrained_quietly",
    "load_causal_lm",
    "load_text_classifier",
    "minilm_path",
    "resolve_backbone",
    "smollm2_gguf",
    "smollm2_path",
    "tiny_bert",
    "tiny_clip",
    "tiny_llama",
    "tiny_qwen2",
    "tiny_vit",
]
