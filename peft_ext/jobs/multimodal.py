"""The ``job: missing_modality`` run config of ``peft-ext run``: fine-tune several methods on the emoji pairs under a
grid of missing-modality settings (:mod:`peft_ext.multimodal.experiment`) and write ``results.json`` and
``results.md``.

Validated like the continual-learning configs (:mod:`peft_ext.continual.config`): unknown keys fail with a
did-you-mean, wrong types and impossible values name the key; the CLI exits with status 2.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..continual import config as continual_config
from ..continual.config import ConfigError, build_section, check_local_model_path, unknown_key, unknown_value
from ..multimodal import experiment
from ..multimodal.experiment import METHODS, ExperimentSettings
from ..multimodal.missing import MISSING_TYPES

__all__ = ["JOB_NAME", "MissingModalityConfig", "missing_modality_config_from_dict", "run_missing_modality_job"]

JOB_NAME = "missing_modality"


@dataclass
class ModelSection(ExperimentSettings):
    """The backbone and the fine-tuning settings: every field of :class:`ExperimentSettings`."""

    def validate(self) -> None:
        for key in ("vision_width", "vision_layers", "vision_heads", "patch_size", "embed_dim", "top_layers", "r"):
            if getattr(self, key) < 1:
                raise ValueError(f"`{key}` must be a positive integer, got {getattr(self, key)}")
        for key in ("prompt_length", "epochs", "batch_size", "timing_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"`{key}` must be a positive integer, got {getattr(self, key)}")
        if self.max_length < 2:
            raise ValueError(f"`max_length` must be >= 2, got {self.max_length}")
        if self.pretrain_epochs < 0:
            raise ValueError(f"`pretrain_epochs` must be >= 0, got {self.pretrain_epochs}")
        if not (self.lr > 0 and self.pretrain_lr > 0):
            raise ValueError(f"`lr` and `pretrain_lr` must be positive, got {self.lr} and {self.pretrain_lr}")
        if self.vision_width % self.vision_heads:
            raise ValueError(f"`vision_width` {self.vision_width} must be a multiple of `vision_heads`")
        if self.train_limit is not None and self.train_limit < 10:
            raise ValueError(f"`train_limit` must be null or >= 10, got {self.train_limit}")
        check_local_model_path("text", self.text)


@dataclass
class GridSection:
    """The missing-modality settings (rate 0 runs once, whatever the types).

    Args:
        rates: Missing rates in ``[0, 1]``.
        kinds: Missing types: ``text``, ``image``, ``both``.
        seeds: Fine-tuning seeds (the missing draws are fixed: train 0, test 1).
    """

    rates: list[float] = field(default_factory=lambda: [0.7])
    kinds: list[str] = field(default_factory=lambda: ["both"])
    seeds: list[int] = field(default_factory=lambda: [0])

    def validate(self) -> None:
        if not self.rates or any(not 0 <= r <= 1 for r in self.rates):
            raise ValueError(f"`rates` must be a non-empty list of numbers in [0, 1], got {self.rates}")
        if not self.kinds or any(k not in MISSING_TYPES for k in self.kinds):
            raise ValueError(f"`kinds` must be a non-empty list of {list(MISSING_TYPES)}, got {self.kinds}")
        if not self.seeds:
            raise ValueError("`seeds` must list at least one seed")


@dataclass
class OutputSection(continual_config.OutputSection):
    """Where results go: the continual run's output section with this job's default folder.

    Args:
        dir: Folder for results.json and results.md (created if missing).
    """

    dir: str = "runs/mora_emoji"


@dataclass
class MissingModalityConfig:
    """A whole missing-modality run: one backbone, a grid of settings, several methods."""

    name: str = "missing_modality"
    model: ModelSection = field(default_factory=ModelSection)
    grid: GridSection = field(default_factory=GridSection)
    output: OutputSection = field(default_factory=OutputSection)
    methods: list[str] = field(default_factory=lambda: list(METHODS))


def missing_modality_config_from_dict(data: Any) -> MissingModalityConfig:
    """Validate a parsed ``job: missing_modality`` document."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping at the top level, got {type(data).__name__}")
    sections = {"model": ModelSection, "grid": GridSection, "output": OutputSection}
    valid = ["job", "name", *sections, "methods"]
    for key in data:
        if key not in valid:
            raise unknown_key(str(key), "", valid)
    name = data.get("name", JOB_NAME)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"`name` must be a non-empty string, got {name!r}")
    built = {key: build_section(cls, data.get(key), f"{key}.") for key, cls in sections.items()}
    methods = data.get("methods", list(METHODS))
    if not isinstance(methods, list) or not methods:
        raise ConfigError(f"`methods` must be a non-empty list of {list(METHODS)}, got {methods!r}")
    for i, method in enumerate(methods):
        if method not in METHODS:
            raise unknown_value(f"methods[{i}]", method, list(METHODS))
    if len(set(methods)) != len(methods):
        raise ConfigError(f"`methods` lists a method twice: {methods}")
    return MissingModalityConfig(name=name, methods=list(methods), **built)


def run_missing_modality_job(config: MissingModalityConfig, echo: Callable[[str], Any] = print) -> list[dict]:
    """Pretrain (or load) the backbone, run the grid, print the table, write ``results.json`` / ``results.md``."""
    start = time.perf_counter()
    settings = ExperimentSettings(**asdict(config.model))
    echo(f"[peft-ext] {config.name}: emoji pairs, missing-modality fine-tuning, methods {', '.join(config.methods)}")
    prep = experiment.prepare(settings, echo=echo)
    specs = experiment.grid_specs(config.grid.rates, config.grid.kinds)
    rows = experiment.run_grid(prep, specs, config.methods, config.grid.seeds, echo=echo)
    infer_ms = experiment.time_inference(prep, config.methods, specs[-1])
    wall = time.perf_counter() - start
    table = experiment.markdown_table(rows, infer_ms)
    meta = {
        "name": config.name,
        "settings": asdict(config.model),
        "grid": asdict(config.grid),
        "pretrain": prep.pretrain_log,
        "inference_ms_per_64": infer_ms,
        "train_examples": len(prep.train.y),
        "test_examples": len(prep.test.y),
        "wall_seconds": round(wall, 1),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    out = Path(config.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    (out / "results.md").write_text(f"# {config.name}\n\n{table}\n")
    echo(f"\n[peft-ext] test split under the same missing spec as training; wall time {wall:.0f} s\n")
    echo(table)
    echo(f"\n[peft-ext] wrote {out / 'results.json'}, {out / 'results.md'}")
    return rows
