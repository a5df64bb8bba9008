"""Tiny, randomly initialized transformers models built from configs, for fast mechanical tests.

They have the real module structure (names such as ``q_proj``, ``query``, ``out_proj``) so target-module patterns
written for the full-size models match, but they run in milliseconds on a CPU and need no download.
"""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    CLIPConfig,
    CLIPModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)


def _sizes(hidden_size: int, num_layers: int) -> dict[str, int]:
    # every tiny model: 4 attention heads and an MLP twice the width
    return {
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
    }


def tiny_llama(vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama causal LM (q/k/v/o_proj, gate/up/down_proj) with random weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, num_key_value_heads=2, max_position_embeddings=128, **_sizes(hidden_size, num_layers)
    )
    return LlamaForCausalLM(config).eval()


def tiny_qwen2(vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 2, seed: int = 0) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 causal LM (q/k/v_proj with biases, o_proj, gate/up/down_proj) with random weights: a second
    decoder family beside :func:`tiny_llama`."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size, num_key_value_heads=2, max_position_embeddings=128, **_sizes(hidden_size, num_layers)
    )
    return Qwen2ForCausalLM(config).eval()


def tiny_bert(
    vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 2, num_labels: int = 3, seed: int = 0
) -> BertForSequenceClassification:
    """A 2-layer BERT sequence classifier (query/key/value, dense) with random weights."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size, max_position_embeddings=128, num_labels=num_labels, **_sizes(hidden_size, num_layers)
    )
    return BertForSequenceClassification(config).eval()


def tiny_vit(image_size: int = 16, patch_size: int = 4, hidden_size: int = 32, num_labels: int = 10, seed: int = 0):
    """A 2-layer ViT image classifier with random weights (default 16x16 RGB inputs)."""
    torch.manual_seed(seed)
    config = ViTConfig(image_size=image_size, patch_size=patch_size, num_labels=num_labels, **_sizes(hidden_size, 2))
    return ViTForImageClassification(config).eval()


def tiny_clip(text_hidden: int = 32, vision_hidden: int = 48, projection_dim: int = 16, seed: int = 0) -> CLIPModel:
    """A dual-encoder CLIP with towers of different widths (text 32, vision 48 by default), random weights."""
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config={
            "vocab_size": 128,
            "hidden_size": text_hidden,
            "intermediate_size": 2 * text_hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 32,
            # token ids inside the tiny vocabulary (CLIP's defaults, 49406/49407, are not)
            "pad_token_id": 1,
            "bos_token_id": 0,
            "eos_token_id": 2,
        },
        vision_config={
            "image_size": 16,
            "patch_size": 4,
            "hidden_size": vision_hidden,
            "intermediate_size": 2 * vision_hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        },
        projection_dim=projection_dim,
    )
    return CLIPModel(config).eval()
