"""The ``job: missing_modality`` run config of ``peft-ext run``: fine-tune several methods on the emoji pairs under a
grid of missing-modality settings (:mod:`peft_ext.multimodal.experiment`) and write ``results.json`` and
``results.md`` after every grid cell; ``--resume`` runs only the cells an interrupted run did not finish.

Validated like the continual-learning configs (:mod:`peft_ext.continual.config`): unknown keys fail with a
did-you-mean, wrong types and impossible values name the key; the CLI exits with status 2.
"""

from __future__ import annotations

import json
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..continual import config as continual_config
from ..continual.config_schema import ConfigError, build_section, check_local_model_path, unknown_key, unknown_value
from ..fileperm import atomic_write
from ..multimodal import experiment
from ..multimodal.experiment import METHODS, ExperimentSettings
from ..multimodal.methods import job_methods
from ..multimodal.missing import MISSING_TYPES
from .errors import JobFailed, one_line
from .resume import config_hash, earlier_results

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
        save_adapters: Not offered by this job (it trains one model per grid point and seed); only ``false``.
    """

    dir: str = "runs/mora_emoji"
    save_adapters: bool = False

    def validate(self) -> None:
        super().validate()
        if self.save_adapters:
            raise ValueError("`save_adapters`: the missing_modality job saves no trained models; remove the key")


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
    offered = list(job_methods())  # the shipped methods and any registered since
    if not isinstance(methods, list) or not methods:
        raise ConfigError(f"`methods` must be a non-empty list of {offered}, got {methods!r}")
    for i, method in enumerate(methods):
        if method not in offered:
            raise unknown_value(f"methods[{i}]", method, offered)
    if len(set(methods)) != len(methods):
        raise ConfigError(f"`methods` lists a method twice: {methods}")
    return MissingModalityConfig(name=name, methods=list(methods), **built)


def _save(
    out: Path,
    meta: dict[str, Any],
    rows: list[dict[str, Any]],
    failures: list[dict[str, Any]],
    infer_ms: dict[str, float] | None = None,
) -> None:
    # results.json and results.md replaced atomically: an interruption leaves the previous complete pair.
    payload = {"meta": meta, "results": rows, **({"failed": failures} if failures else {})}
    md = [f"# {meta['name']}", "", experiment.markdown_table(rows, infer_ms), ""]
    if failures:
        md += ["## failed", ""] + [f"- {f['label']}: {f['error']}" for f in failures] + [""]
    atomic_write(out / "results.json", lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=2)))
    atomic_write(out / "results.md", lambda tmp: Path(tmp).write_text("\n".join(md)))


def run_missing_modality_job(
    config: MissingModalityConfig, echo: Callable[[str], Any] = print, debug: bool = False, resume: bool = False
) -> list[dict]:
    """Pretrain (or load) the backbone, run the grid, print the table, write ``results.json`` / ``results.md``.

    Both files are rewritten after every grid cell (spec x method x seed), so they always hold every cell finished
    so far; the inference timings are added at the end. A cell that raises is recorded (under ``failed`` in the
    results) and the next one runs.

    Args:
        config: The validated config.
        echo: Where progress lines go.
        debug: Print the traceback of a failed cell (stderr).
        resume: Keep the cells an earlier run of the same config finished (its ``results.json`` in ``output.dir``)
            and run only the others (:mod:`peft_ext.jobs.resume`). The pretrained backbone comes from its cache
            (``model.cache_dir``); without one it is pretrained again, seeded, to the same weights.

    Raises:
        JobFailed: After every cell ran, when at least one failed.
        ConfigError: ``resume`` with no results, or results of a different config, in ``output.dir``.
    """
    start = time.perf_counter()
    fingerprint = config_hash(config)
    done = earlier_results(config.output.dir, fingerprint) if resume else []
    settings = ExperimentSettings(**asdict(config.model))
    echo(f"[peft-ext] {config.name}: emoji pairs, missing-modality fine-tuning, methods {', '.join(config.methods)}")
    if done:
        echo(f"[peft-ext] resuming: {len(done)} grid cells finished in the run being resumed")
    prep = experiment.prepare(settings, echo=echo)
    specs = experiment.grid_specs(config.grid.rates, config.grid.kinds)
    meta = {
        "name": config.name,
        "settings": asdict(config.model),
        "grid": asdict(config.grid),
        "pretrain": prep.pretrain_log,
        "inference_ms_per_64": {},
        "train_examples": len(prep.train.y),
        "test_examples": len(prep.test.y),
        "wall_seconds": 0.0,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "config_hash": fingerprint,
    }
    out = Path(config.output.dir)
    failures: list[dict[str, Any]] = []

    def save(rows: list[dict[str, Any]], infer_ms: dict[str, float] | None = None) -> None:
        meta["wall_seconds"] = round(time.perf_counter() - start, 1)
        _save(out, meta, rows, failures, infer_ms)

    def failed(cell: dict[str, Any], err: Exception) -> None:
        if debug:
            traceback.print_exc()
        label = f"{cell['method']} (rate {cell['rate']:g} {cell['kind']}, seed {cell['seed']})"
        failures.append({**cell, "label": label, "error": one_line(err)})
        echo(f"[peft-ext] {label} failed: {one_line(err)}")

    rows = experiment.run_grid(
        prep, specs, config.methods, config.grid.seeds, echo=echo, done=done, on_row=save, on_error=failed
    )
    # the timings need a method that builds: only those with a finished cell are timed
    timed = [m for m in config.methods if any(r["method"] == m for r in rows)]
    infer_ms = experiment.time_inference(prep, timed, specs[-1]) if timed else {}
    meta["inference_ms_per_64"] = infer_ms
    save(rows, infer_ms)
    wall = time.perf_counter() - start
    echo(f"\n[peft-ext] test split under the same missing spec as training; wall time {wall:.0f} s\n")
    echo(experiment.markdown_table(rows, infer_ms))
    echo(f"\n[peft-ext] wrote {out / 'results.json'}, {out / 'results.md'}")
    if failures:
        raise JobFailed(failures, config.output.dir)
    return rows
