"""Missing-modality fine-tuning on the emoji pairs: MoRA against LoRA on both towers, a frozen backbone with a linear
head, and missing-aware prompts (MMP), all on the same contrastively pretrained :class:`DualEncoder`.

Shared by ``benchmarks/mora_missing_modality.py`` and the ``job: missing_modality`` configs of ``peft-ext run``.

Every method keeps the backbone frozen below the top ``top_layers`` layers of each tower (the layers MoRA and LoRA
adapt and the prompts enter), so the outputs of the lower layers are computed once per example, for the complete
inputs and for the two placeholders (empty text, blank image), and reused by every setting and method. The backbone
runs in eval mode (no dropout) throughout; the classification head sees the concatenated joint-space embeddings of
both towers.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from .dual_encoder import (
    DualEncoder,
    build_dual_encoder,
    cosine_with_warmup,
    matched_lora_ranks,
    pixels,
    pretrain_contrastive,
)
from .emoji import load_emoji_pairs
from .methods import MISSING_MODALITY_METHODS, get_missing_modality_method, job_methods
from .metrics import accuracy, auroc, f1_macro
from .missing import MissingSpec, blank_image, missing_masks
from .prompts import missing_pattern
from .report import LABELS, cell_key, grid_specs, markdown_table

__all__ = [
    "ALL_METHODS",
    "LABELS",
    "METHODS",
    "ExperimentSettings",
    "Prepared",
    "cell_key",
    "grid_specs",
    "markdown_table",
    "prepare",
    "run_method",
    "run_grid",
    "time_inference",
]

# The job's choices; ALL_METHODS adds the benchmark-only ones (LoRA at MoRA's trainable-parameter count).
METHODS = job_methods()
ALL_METHODS = tuple(MISSING_MODALITY_METHODS)


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

    def backbone_key(self) -> dict[str, Any]:
        keys = ("text", "vision_width", "vision_layers", "vision_heads", "patch_size", "embed_dim", "max_length")
        keys += ("pretrain_epochs", "pretrain_lr", "train_limit")
        return {k: getattr(self, k) for k in keys}


@dataclass
class _Split:
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
    train: _Split
    test: _Split
    num_classes: int
    empty: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids, mask, text_low of the empty string (1, T...)
    blank: tuple[torch.Tensor, torch.Tensor]  # px, vision_low of the blank image
    pretrain_log: dict[str, float] = field(default_factory=dict)
    validation: _Split | None = None

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
            on it. ``False``: train on the whole train split, as before.
    """
    model, tokenizer = build_dual_encoder(
        settings.text,
        vision_width=settings.vision_width,
        vision_layers=settings.vision_layers,
        vision_heads=settings.vision_heads,
        patch_size=settings.patch_size,
        embed_dim=settings.embed_dim,
        seed=0,
    )
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
        # the key of a run without validation is unchanged, so its cached backbone stays valid
        cache_key={**settings.backbone_key(), **({"hold_out_validation": True} if validation else {})},
        echo=echo,
    )
    model.requires_grad_(False)
    built = {}
    for name, (ids, mask, px, y) in splits.items():
        text_low, vision_low = _lower(model, ids, mask, px, settings.top_layers)
        built[name] = _Split(ids, mask, px, y, text_low, vision_low)
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


@dataclass
class _Inputs:
    """One split under one missing draw: full inputs (for timing) and cached lower-layer outputs (for training)."""

    ids: torch.Tensor
    mask: torch.Tensor
    px: torch.Tensor
    text_low: torch.Tensor
    vision_low: torch.Tensor
    pattern: torch.Tensor
    y: torch.Tensor


def _apply(prep: Prepared, split: _Split, spec: MissingSpec, seed: int) -> _Inputs:
    masks = missing_masks(len(split.y), spec, seed=seed)
    text, image = torch.from_numpy(masks.text), torch.from_numpy(masks.image)
    empty_ids, empty_mask, empty_low = prep.empty
    blank_px, blank_low = prep.blank
    ids, mask, text_low = split.ids.clone(), split.mask.clone(), split.text_low.clone()
    ids[text], mask[text], text_low[text] = empty_ids, empty_mask, empty_low
    px, vision_low = split.px.clone(), split.vision_low.clone()
    px[image], vision_low[image] = blank_px, blank_low
    return _Inputs(ids, mask, px, text_low, vision_low, missing_pattern(masks.text, masks.image), split.y)


class _Method(nn.Module):
    """A backbone (possibly wrapped by PEFT), optional prompts, and the head; the top layers run on cached inputs."""

    def __init__(self, prep: Prepared, method: str, seed: int) -> None:
        super().__init__()
        self.spec = get_missing_modality_method(method)
        torch.manual_seed(seed)
        backbone = copy.deepcopy(prep.model)
        built = self.spec.build(prep, backbone, seed)
        self.backbone = built.backbone
        self.text_prompts, self.vision_prompts = built.text_prompts, built.vision_prompts
        self.head = nn.Linear(2 * backbone.embed_dim, prep.num_classes)
        self.method = method

    @property
    def dual(self) -> DualEncoder:
        return self.backbone.base_model.model if hasattr(self.backbone, "base_model") else self.backbone

    def top(self, text_low, mask, vision_low, pattern, t_start: int, v_start: int) -> torch.Tensor:
        dual = self.dual
        text = dual.text_hidden(text_low, mask, t_start, self.text_prompts, pattern)
        image = dual.vision_hidden(vision_low, v_start, self.vision_prompts, pattern)
        return self.head(torch.cat([dual.pool_text(text, mask), dual.pool_vision(image)], dim=1))

    def full(self, ids, mask, px, pattern) -> torch.Tensor:
        text, image = self.dual(ids, mask, px, self.text_prompts, self.vision_prompts, pattern)
        return self.head(torch.cat([text, image], dim=1))


def _trim(mask: torch.Tensor) -> int:
    return int(mask.sum(1).max())


def run_method(
    prep: Prepared, method: str, spec: MissingSpec, seed: int = 0, *, lr: float | None = None, split: str = "test"
) -> dict[str, float]:
    """Fine-tune one method under one missing spec (train draw seed 0, test draw seed 1, validation draw seed 2) and
    evaluate on the test (or validation) split under the same spec.

    Args:
        prep: From :func:`prepare` (with ``validation=True`` for ``split="validation"``).
        method: A name from :data:`ALL_METHODS`.
        spec: The missing rate and type.
        seed: Initialization and batch-order seed.
        lr: AdamW learning rate; ``None``: ``prep.settings.lr``.
        split: ``"test"`` or ``"validation"``.

    Returns:
        ``acc``, ``f1``, ``auroc``, ``params`` (trainable), ``train_s``. Inference time: :func:`time_inference`.
    """
    s = prep.settings
    if split not in ("test", "validation"):
        raise ValueError(f"`split` must be 'test' or 'validation', got {split!r}")
    if split == "validation" and prep.validation is None:
        raise ValueError("split='validation' needs a validation split: prepare(settings, validation=True)")
    if lr is not None and not lr > 0:
        raise ValueError(f"`lr` must be positive, got {lr}")
    train = _apply(prep, prep.train, spec, seed=0)
    test = _apply(prep, prep.test, spec, seed=1) if split == "test" else _apply(prep, prep.validation, spec, seed=2)
    model = _Method(prep, method, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    t0, v0 = prep.text_start, prep.vision_start
    start = time.perf_counter()
    if model.spec.frozen_backbone:
        # the backbone is frozen end to end: its features are computed once
        with torch.no_grad():
            feats = torch.cat(
                [torch.cat(_features(model, train, b, t0, v0), dim=1) for b in torch.arange(len(train.y)).split(256)]
            )
    steps = s.epochs * math.ceil(len(train.y) / s.batch_size)
    optimizer = torch.optim.AdamW(params, lr=s.lr if lr is None else lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(steps))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(s.epochs):
        for b in torch.randperm(len(train.y), generator=gen).split(s.batch_size):
            if model.spec.frozen_backbone:
                logits = model.head(feats[b])
            else:
                t = _trim(train.mask[b])
                logits = model.top(
                    train.text_low[b, :t], train.mask[b, :t], train.vision_low[b], train.pattern[b], t0, v0
                )
            loss = nn.functional.cross_entropy(logits, train.y[b])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
    train_s = time.perf_counter() - start
    model.eval()
    if model.spec.merges:
        model.backbone = model.backbone.merge_and_unload()  # no inference overhead: a plain DualEncoder again
    with torch.no_grad():
        logits = []
        for b in torch.arange(len(test.y)).split(256):
            t = _trim(test.mask[b])
            logits.append(
                model.top(test.text_low[b, :t], test.mask[b, :t], test.vision_low[b], test.pattern[b], t0, v0)
            )
        logits = torch.cat(logits)
    y, pred, prob = test.y.numpy(), logits.argmax(1).numpy(), logits.softmax(1).numpy()
    return {
        "acc": accuracy(y, pred),
        "f1": f1_macro(y, pred, num_classes=prep.num_classes),
        "auroc": auroc(y, prob),
        "params": n_params,
        "train_s": train_s,
    }


def _features(model: _Method, split: _Inputs, b: torch.Tensor, t0: int, v0: int) -> tuple[torch.Tensor, torch.Tensor]:
    dual = model.dual
    t = _trim(split.mask[b])
    text = dual.text_hidden(split.text_low[b, :t], split.mask[b, :t], t0)
    image = dual.vision_hidden(split.vision_low[b], v0)
    return dual.pool_text(text, split.mask[b, :t]), dual.pool_vision(image)


def time_inference(
    prep: Prepared, methods: Sequence[str], spec: MissingSpec, repeats: int | None = None
) -> dict[str, float]:
    """Milliseconds of a full forward (token ids and pixels through both towers, all layers, and the head) of the
    first 64 test examples under ``spec``, per method, LoRA / MoRA merged into the backbone.

    The cost does not depend on the trained values, so freshly initialized methods are timed. The methods are timed
    round-robin and each reports its fastest round: on a shared CPU, the minimum is the least disturbed by other
    processes, and interleaving exposes every method to the same load.
    """
    test = _apply(prep, prep.test, spec, seed=1)
    b = torch.arange(min(64, len(test.y)))
    t = _trim(test.mask[b])
    args = (test.ids[b, :t], test.mask[b, :t], test.px[b], test.pattern[b])
    models = {}
    for method in methods:
        model = _Method(prep, method, seed=0).eval()
        if model.spec.merges:
            model.backbone = model.backbone.merge_and_unload()
        models[method] = model
    best = dict.fromkeys(methods, float("inf"))
    with torch.no_grad():
        for model in models.values():
            model.full(*args)  # warm-up
        for _ in range(repeats or prep.settings.timing_batches):
            for method, model in models.items():
                start = time.perf_counter()
                model.full(*args)
                best[method] = min(best[method], time.perf_counter() - start)
    return {method: 1000 * seconds for method, seconds in best.items()}


def run_grid(
    prep: Prepared,
    specs: Sequence[MissingSpec],
    methods: Sequence[str] = METHODS,
    seeds: Sequence[int] = (0,),
    echo: Callable[[str], Any] = print,
    done: Sequence[dict[str, Any]] = (),
    on_row: Callable[[list[dict[str, Any]]], Any] | None = None,
    on_error: Callable[[dict[str, Any], Exception], Any] | None = None,
) -> list[dict[str, Any]]:
    """Run every method on every spec and seed; one row per (spec, method, seed), in that order.

    Each cell's result depends only on its own spec, method and seed (:func:`run_method` seeds everything it
    draws), so cells can be skipped or rerun in any process.

    Args:
        prep: From :func:`prepare`.
        specs: The missing settings (:func:`grid_specs`).
        methods: Names from :data:`METHODS`.
        seeds: Fine-tuning seeds.
        echo: Where progress lines go.
        done: Rows an earlier run finished (matched by :func:`cell_key`): kept in their place, not run again.
        on_row: Called with the rows so far after each cell that ran, finished or failed (e.g. to write them).
        on_error: Called with the cell (``rate``, ``kind``, ``method``, ``seed``) and the error when a cell
            raises; the grid goes on without its row. ``None``: the error propagates.
    """
    earlier = {cell_key(r["rate"], r["kind"], r["method"], r["seed"]): r for r in done}
    rows = []
    for spec in specs:
        for method in methods:
            for seed in seeds:
                cell = {"rate": spec.rate, "kind": spec.kind, "method": method, "seed": seed}
                row = earlier.get(cell_key(**cell))
                if row is not None:
                    rows.append(row)
                    echo(f"  rate {spec.rate} {spec.kind:<5} {method:<12} seed {seed}: finished in an earlier run")
                    continue
                try:
                    result = run_method(prep, method, spec, seed)
                except Exception as err:  # the caller records it; the other cells still run
                    if on_error is None:
                        raise
                    on_error(cell, err)
                else:
                    rows.append({**cell, **result})
                    echo(
                        f"  rate {spec.rate} {spec.kind:<5} {method:<12} seed {seed}: acc {result['acc']:.3f} "
                        f"f1 {result['f1']:.3f} auroc {result['auroc']:.3f} ({result['train_s']:.0f} s)"
                    )
                if on_row is not None:
                    on_row(rows)
    return rows
