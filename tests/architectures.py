"""Tiny random models of the transformers architectures the suite checks every adapter type on.

Each :class:`Arch` builds its model from a config (no download), seeded, and makes a batch with labels (the loss
``model(**batch).loss``) and, for models that generate, a prompt. The families cover what differs for an adapter:
decoders with and without grouped-query attention, fused projections, GPT-2's ``Conv1D`` linear layers, an MLP fed
flattened tokens (OPT reshapes to ``(batch x seq, d)`` before ``fc1`` / ``fc2``), an encoder, encoder-decoders and a
vision encoder. Used by tests/test_architectures.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers as tf
from torch import nn

VOCAB = 96
WIDTH = 32


@dataclass(frozen=True)
class Arch:
    """One architecture: how to build it and feed it.

    Args:
        name: Test id.
        build: The model (seeded, eval mode).
        kind: ``causal`` (input_ids, labels = input_ids), ``seq2seq`` (input_ids, labels), ``classifier``
            (input_ids, class labels) or ``vision`` (pixel_values, class labels).
        note: What is particular about it (the docs' table).
    """

    name: str
    build: Callable[[], nn.Module]
    kind: str
    note: str

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build().eval()

    def batch(self, seed: int = 0, size: int = 3, length: int = 7) -> dict[str, torch.Tensor]:
        """A training batch with labels (the model computes its loss)."""
        g = torch.Generator().manual_seed(seed)
        if self.kind == "vision":
            return {"pixel_values": torch.randn(size, 3, 16, 16, generator=g), "labels": torch.arange(size) % 3}
        ids = torch.randint(4, VOCAB, (size, length), generator=g)
        if self.kind == "causal":
            return {"input_ids": ids, "labels": ids.clone()}
        if self.kind == "classifier":
            return {"input_ids": ids, "labels": torch.arange(size) % 3}
        return {"input_ids": ids, "labels": torch.randint(4, VOCAB, (size, 5), generator=g)}

    @property
    def generates(self) -> bool:
        return self.kind in ("causal", "seq2seq")


def _causal(config_cls: Any, model_cls: Any, **extra: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        config = config_cls(vocab_size=VOCAB, **extra)
        # special tokens inside the tiny vocabulary (the configs' defaults are real models' ids)
        config.update({"bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0})
        if config.is_encoder_decoder:
            config.decoder_start_token_id = 0
        return model_cls(config)

    return build


def _both_stacks(**sizes: int) -> dict[str, int]:
    """An encoder-decoder config's settings of each stack: every one of ``sizes`` for both (``layers=1``:
    ``encoder_layers=1`` and ``decoder_layers=1``)."""
    return {f"{stack}_{key}": value for stack in ("encoder", "decoder") for key, value in sizes.items()}


# the sizes the architectures here share, in the names most configs use; with the MLP width, those of the decoders,
# BERT and ViT
_LAYERS = dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4)
_DECODER = dict(intermediate_size=64, **_LAYERS)

ARCHS = [
    Arch(
        "llama",
        _causal(tf.LlamaConfig, tf.LlamaForCausalLM, num_key_value_heads=4, **_DECODER),
        "causal",
        "decoder, separate q/k/v/o, gated MLP",
    ),
    Arch(
        "mistral-gqa",
        _causal(tf.MistralConfig, tf.MistralForCausalLM, num_key_value_heads=2, **_DECODER),
        "causal",
        "grouped-query attention (2 key/value heads for 4 query heads)",
    ),
    Arch(
        "qwen2",
        _causal(tf.Qwen2Config, tf.Qwen2ForCausalLM, num_key_value_heads=2, **_DECODER),
        "causal",
        "q/k/v with bias, GQA",
    ),
    Arch(
        "gemma",
        _causal(tf.GemmaConfig, tf.GemmaForCausalLM, num_key_value_heads=1, head_dim=8, **_DECODER),
        "causal",
        "multi-query attention, scaled embeddings",
    ),
    Arch(
        "phi3",
        _causal(tf.Phi3Config, tf.Phi3ForCausalLM, num_key_value_heads=4, **_DECODER),
        "causal",
        "fused qkv_proj and gate_up_proj",
    ),
    Arch(
        "gpt-neox",
        _causal(tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, **_DECODER),
        "causal",
        "fused query_key_value, parallel attention and MLP",
    ),
    Arch(
        "falcon",
        _causal(tf.FalconConfig, tf.FalconForCausalLM, **_LAYERS),
        "causal",
        "fused query_key_value, multi-query",
    ),
    Arch(
        "gpt2",
        _causal(tf.GPT2Config, tf.GPT2LMHeadModel, n_embd=WIDTH, n_layer=2, n_head=4, n_positions=64),
        "causal",
        "transformers Conv1D layers (weight in x out)",
    ),
    Arch(
        "opt",
        _causal(
            tf.OPTConfig,
            tf.OPTForCausalLM,
            ffn_dim=64,
            word_embed_proj_dim=WIDTH,
            max_position_embeddings=64,
            **_LAYERS,
        ),
        "causal",
        "MLP on flattened tokens (batch x seq, d)",
    ),
    Arch(
        "bert",
        lambda: tf.BertForSequenceClassification(tf.BertConfig(vocab_size=VOCAB, num_labels=3, **_DECODER)),
        "classifier",
        "encoder with a 3-class head",
    ),
    Arch(
        "t5",
        _causal(tf.T5Config, tf.T5ForConditionalGeneration, d_model=WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
        "seq2seq",
        "encoder-decoder, decoder inputs from the labels",
    ),
    Arch(
        "bart",
        _causal(
            tf.BartConfig,
            tf.BartForConditionalGeneration,
            d_model=WIDTH,
            max_position_embeddings=64,
            **_both_stacks(layers=1, attention_heads=4, ffn_dim=64),
        ),
        "seq2seq",
        "encoder-decoder with learned positions",
    ),
    Arch(
        "vit",
        lambda: tf.ViTForImageClassification(tf.ViTConfig(image_size=16, patch_size=4, num_labels=3, **_DECODER)),
        "vision",
        "vision encoder, no token embeddings, 3-class head",
    ),
]
