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
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .dual_encoder import DualEncoder, cosine_with_warmup
from .methods import MISSING_MODALITY_METHODS, get_missing_modality_method, job_methods
from .metrics import accuracy, auroc, f1_macro
from .missing import MissingSpec, missing_masks
from .preparation import ExperimentSettings, Prepared, Split, prepare
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
class _Inputs:
    """One split under one missing draw: full inputs (for timing) and cached lower-layer outputs (for training)."""

    ids: torch.Tensor
    mask: torch.Tensor
    px: torch.Tensor
    text_low: torch.Tensor
    vision_low: torch.Tensor
    pattern: torch.Tensor
    y: torch.Tensor


def _apply(prep: Prepared, split: Split, spec: MissingSpec, seed: int) -> _Inputs:
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
