"""What a model's structure tells a tuner: its input embeddings (token or patch) and, for an encoder-decoder, its two
stacks. Shared by the tuners that route or mask by the model's inputs (PCLR's query, SplitLoRA's token masks)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

from torch import nn

__all__ = ["encoder_decoder_stacks", "find_input_embeddings", "find_patch_embeddings"]


def _input_embedding_modules(model: nn.Module) -> Iterator[nn.Module]:
    # get_input_embeddings() of the model and of its submodules that have one (wrappers such as SentenceClassifier
    # hold a transformers model), in module order
    for module in model.modules():
        getter = getattr(module, "get_input_embeddings", None)
        if callable(getter):
            try:
                embedding = getter()
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(embedding, nn.Module):
                yield embedding


def find_input_embeddings(model: nn.Module) -> Optional[nn.Embedding]:
    """The model's input token embedding: ``get_input_embeddings()`` of the model or of its first submodule that
    has one (wrappers such as ``SentenceClassifier`` hold a transformers encoder); ``None`` if there is none."""
    return next((e for e in _input_embedding_modules(model) if isinstance(e, nn.Embedding)), None)


def find_patch_embeddings(model: nn.Module) -> Optional[tuple[nn.Module, int]]:
    """The model's patch embedding and its width: an input embedding (``get_input_embeddings()``) that is or holds a
    convolution (ViT's ``ViTPatchEmbeddings``, CLIP's vision ``patch_embedding``); ``None`` if there is none."""
    for embedding in _input_embedding_modules(model):
        conv = next((m for m in embedding.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
        if conv is not None:
            return embedding, conv.out_channels
    return None


def encoder_decoder_stacks(model: nn.Module) -> Optional[tuple[nn.Module, nn.Module]]:
    """``(encoder, decoder)`` of a transformers encoder-decoder (``config.is_encoder_decoder``: T5, BART, ...), the
    modules ``get_encoder()`` / ``get_decoder()`` return; ``None`` for any other model."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False):
        return None
    get_encoder, get_decoder = getattr(model, "get_encoder", None), getattr(model, "get_decoder", None)
    if not callable(get_encoder) or not callable(get_decoder):
        return None
    encoder, decoder = get_encoder(), get_decoder()
    if not isinstance(encoder, nn.Module) or not isinstance(decoder, nn.Module) or encoder is model:
        return None
    return encoder, decoder
