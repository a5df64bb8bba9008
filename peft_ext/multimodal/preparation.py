"""The missing-modality experiment's shared starting point: the contrastively pretrained :class:`DualEncoder` (built,
or loaded from the cache), the tokenized emoji splits, and the outputs of each tower's frozen lower layers, computed
once per example for the complete inputs and the two placeholders (empty text, blank image) and reused by every
setting and method of :mod:`.experiment`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .dual_encoder import DualEncoder, build_dual_encoder, matched_lora_ranks, pixels, pretrain_contrastive
from .emoji import load_emoji_pairs
from .missing import blank_image

__all__ = ["ExperimentSettings", "Prepared", "Split", "prepare"]

# the settings that size the towers: the keywords of build_dual_encoder
_TOWER_SIZES = ("vision_width", "vision_layers", "vision_heads", "patch_size", "embed_dim")


@dataclass
class ExperimentSettings:
    """Everything that changes a result (the pretraining cache key is built from the backbone part).

    Args:
        text: Text tower: ``"minilm"`` (packaged offline MiniLM-L6) or a local BERT directory.
        vision_width: Hidden size of the ViT.
        vision_layers: Depth of the ViT.
        vision_heads: Attention heads of the ViT.
        patch_size: ViT patch size on the 32 x 32 emoji images.
        embed_dim: Joint-space width.
        max_length: Token limit of the names (all emoji names fit in 12 MiniLM tokens).
        pretrain_epochs: LiT contrastive epochs on the complete training pairs.
        pretrain_lr: Their AdamW learning rate.
        cache_dir: Where the pretrained backbone is cached (``None``: no cache).
        top_layers: Layers per tower that are adapted / prompted (the rest stays frozen and cached).
        r: Rank of LoRA and MoRA.
        alpha: Their scale numerator (scaling ``alpha / r``).
        prompt_length: Prompt tokens per prompted layer and missing pattern.
        epochs: Fine-tuning epochs per method.
        batch_size: Fine-tuning batch size.
        lr: AdamW learning rate of every method (docs/methods.md (MoRA): 1e-2, cosine, 10% warmup).
        train_limit: Use only the first ``train_limit`` training pairs (tests); ``None``: all.
        timing_batches: Timed rounds of the inference forward (the minimum is reported).
    """

    text: str = "minilm"
    vision_width: int = 192
    vision_layers: int = 4
    vision_heads: int = 4
    patch_size: int = 8
    embed_dim: int = 128
    max_length: int = 16
    pretrain_epochs: int = 30
    pretrain_lr: float = 1e-3
    cache_dir: str | None = ".cache/peft_ext"
    top_layers: int = 2
    r: int = 4
    alpha: float = 4.0
    prompt_length: int = 4
    epochs: int = 5
    batch_size: int = 64
    lr: float = 1e-2
    train_limit: int | None = None
    timing_batches: int = 20

    def tower_sizes(self) -> dict[str, Any]:
        """The towers' sizes, as the keywords of :func:`~.dual_encoder.build_dual_encoder`."""
        return {k: getattr(self, k) for k in _TOWER_SIZES}

    def backbone_key(self) -> dict[str, Any]:
        later = ("max_length", "pretrain_epochs", "pretrain_lr", "train_limit")
        return {"text": self.text, **self.tower_sizes(), **{k: getattr(self, k) for k in later}}


@dataclass
class Split:
    ids: torch.Tensor  # (n, T) complete names
    mask: torch.Tensor
    px: torch.Tensor  # (n, 3, H, W) complete images
    y: torch.Tensor
    text_low: torch.Tensor  # (n, T, d_text) input of the first adapted text layer, complete names
    vision_low: torch.Tensor  # (n, P, d_vision) input of the first adapted vision layer, complete images


@dataclass
class Prepared:
    """The pretrained backbone, tokenized splits and cached lower-layer outputs; reused by every setting.

    ``validation`` is set by ``prepare(..., validation=True)``, which then also leaves it out of ``train``.
    """

    settings: ExperimentSettings
    model: DualEncoder
    train: Split
    test: Split
    num_classes: int
    empty: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids, mask, text_low of the empty string (1, T...)
    blank: tuple[torch.Tensor, torch.Tensor]  # px, vision_low of the blank image
    pretrain_log: dict[str, float] = field(default_factory=dict)
    validation: Split | None = None

    @functools.cached_property
    def matched_ranks(self) -> dict[str, int]:
        """The ranks of the ``lora_matched`` method (:func:`~.dual_encoder.matched_lora_ranks`), computed once."""
        s = self.settings
        return matched_lora_ranks(self.model, s.r, s.alpha, s.top_layers)

    @property
    def text_start(self) -> int:
        return len(self.model.text_layers) - self.settings.top_layers

    @property
    def vision_start(self) -> int:
        return len(self.model.vision_layers) - self.settings.top_layers


def _lower(model: DualEncoder, ids: torch.Tensor, mask: torch.Tensor, px: torch.Tensor, top: int):
    # outputs of the frozen lower layers = inputs of the first adapted layer of each tower
    t_start, v_start = len(model.text_layers) - top, len(model.vision_layers) - top
    text, vision = [], []
    with torch.no_grad():
        for i in range(0, len(ids), 256):
            emb = model.text_embeddings(ids[i : i + 256])
            text.append(model.text_hidden(emb, mask[i : i + 256], end=t_start))
        for i in range(0, len(px), 256):
            vision.append(model.vision_hidden(model.vision_embeddings(px[i : i + 256]), end=v_start))
    return torch.cat(text), torch.cat(vision)


def prepare(settings: ExperimentSettings, echo: Callable[[str], Any] = print, *, validation: bool = False) -> Prepared:
    """Build and pretrain (or load from the cache) the dual encoder, tokenize the splits, cache the lower layers.

    Args:
        settings: The experiment's settings.
        echo: Where progress lines go.
        validation: Also prepare the emoji validation split and hold it out of the training pairs (of the
            backbone's pretraining too, which then gets its own cache entry), so that :func:`run_method` can score
            on it. ``False``: train on the whole train split.
    """
    model, tokenizer = build_dual_encoder(settings.text, seed=0, **settings.tower_sizes())
    for tower, layers in (("text", model.text_layers), ("vision", model.vision_layers)):
        if not 1 <= settings.top_layers <= len(layers):
            raise ValueError(f"`top_layers` must be in [1, {len(layers)}] (the {tower} tower's depth)")

    def tokenize(texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = tokenizer(
            list(texts), padding="max_length", max_length=settings.max_length, truncation=True, return_tensors="pt"
        )
        return enc["input_ids"], enc["attention_mask"]

    splits = {}
    train_pairs = load_emoji_pairs("train", hold_out_validation=validation)
    if settings.train_limit is not None:
        train_pairs = train_pairs.subset(np.arange(min(settings.train_limit, len(train_pairs))))
    named = [("train", train_pairs), ("test", load_emoji_pairs("test"))]
    if validation:
        named.append(("validation", load_emoji_pairs("validation")))
    for name, pairs in named:
        ids, mask = tokenize(pairs.names)
        splits[name] = (ids, mask, pixels(pairs.images), torch.from_numpy(pairs.group).long())
    ids, mask, px, _ = splits["train"]
    log = pretrain_contrastive(
        model,
        ids,
        mask,
        px,
        settings.pretrain_epochs,
        lr=settings.pretrain_lr,
        cache_dir=settings.cache_dir,
        # without validation the key is the backbone settings alone, the same for every such run
        cache_key={**settings.backbone_key(), **({"hold_out_validation": True} if validation else {})},
        echo=echo,
    )
    model.requires_grad_(False)
    built = {}
    for name, (ids, mask, px, y) in splits.items():
        text_low, vision_low = _lower(model, ids, mask, px, settings.top_layers)
        built[name] = Split(ids, mask, px, y, text_low, vision_low)
    empty_ids, empty_mask = tokenize([""])
    blank_px = pixels(blank_image((1, *train_pairs.images.shape[1:])))
    empty_low, blank_low = _lower(model, empty_ids, empty_mask, blank_px, settings.top_layers)
    return Prepared(
        settings=settings,
        model=model,
        train=built["train"],
        test=built["test"],
        num_classes=len(train_pairs.group_names),
        empty=(empty_ids, empty_mask, empty_low),
        blank=(blank_px, blank_low),
        pretrain_log=log,
        validation=built.get("validation"),
    )
