"""``peft-ext run --tune``: each method's learning rate chosen on a validation split inside the job.

Every method gets the same budget: one run per point of ``tune.lr_factors`` times its configured ``lr``, trained
from the same backbone and seed as the final run and scored by its final accuracy (exact match for instruction tasks)
on the tasks' validation examples; the first best point is then the method's ``lr`` for the run on the test split.
Two protocols (``tune.protocol``): ``sequence`` runs the whole sequence for each point and scores every task's
validation split (the common offline protocol: it uses tasks a continual learner has not met yet); ``first_task``
trains and scores the first task only (what a continual learner could do before the sequence goes on).

Each finished grid point is written to ``output.dir/tuning.json`` at once (rank 0; keyed by the config's
fingerprint), so ``--resume`` runs only the points an interrupted job did not finish.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..continual.config import ConfigError, MethodEntry, RunConfig, get_setting, with_setting
from ..continual.methods import get_continual_method
from ..continual.progress import write_json_atomic
from ..continual.runner import run_sequence
from ..data.tasks import TaskSequence
from ..distributed import on_rank_zero

__all__ = ["TUNING_FILE", "tune_methods", "tuned_options", "validation_sequence"]

TUNING_FILE = "tuning.json"


def validation_sequence(sequence: TaskSequence, protocol: str) -> TaskSequence:
    """The sequence a grid point runs: each task's validation examples as its test set (the first task only for
    ``protocol="first_task"``).

    Raises:
        ConfigError: A task without validation examples, naming how to get them.
    """
    empty = [t.name for t in sequence.tasks if not t.validation]
    if empty:
        raise ConfigError(
            f"--tune needs validation examples in every task; {empty[0]!r} has none: set `data.val_per_class` "
            "(WordNet) or `data.validation` / `data.validation_share` (your files)"
        )
    tasks = [dataclasses.replace(t, test=list(t.validation), validation=[]) for t in sequence.tasks]
    if protocol == "first_task":
        tasks = tasks[:1]
    meta = {**sequence.meta, "split": "validation", "tune_protocol": protocol}
    return dataclasses.replace(sequence, tasks=tasks, meta=meta)


def _grid(entry: MethodEntry, factors: list[float]) -> list[float]:
    return [float(f"{entry.options.lr * f:.4g}") for f in factors]


def tune_methods(
    config: RunConfig,
    entries: list[MethodEntry],
    sequence: TaskSequence,
    base: Any,
    collate: Any,
    fingerprint: str,
    echo: Callable[[str], Any],
) -> dict[str, dict[str, Any]]:
    """Run the grid of every method in ``entries`` on the validation sequence; return, per method label, the
    protocol, each learning rate's validation score and the chosen learning rate (the first best).

    Args:
        config: The job's config (``tune``, ``train``, ``output.dir``).
        entries: The methods to tune.
        sequence: The job's task sequence (tokenized as the methods see it).
        base: The backbone every run copies.
        collate: The job's collate function.
        fingerprint: The config's fingerprint (a ``tuning.json`` of another config is not reused).
        echo: Where progress lines go.
    """
    tune = config.tune
    val = validation_sequence(sequence, tune.protocol)
    path = Path(config.output.dir) / TUNING_FILE
    cache: dict[str, Any] = {}
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("config_hash") == fingerprint:
            cache = saved.get("scores", {})
    train = dataclasses.replace(config.train, progress=False)
    tuned: dict[str, dict[str, Any]] = {}
    described = "the whole sequence" if tune.protocol == "sequence" else "the first task"

    def score(label: str, key: str, method: Any) -> float:
        """The validation score of one grid point, trained once (and written at once) or read from the cache."""
        scores: dict[str, float] = cache.setdefault(label, {})
        if key not in scores:
            scores[key] = run_sequence(val, method, base, collate, train).metrics["final_acc"]
            saved = {"config_hash": fingerprint, "protocol": tune.protocol, "scores": cache}
            on_rank_zero(lambda: write_json_atomic(saved, path))
        return scores[key]

    for entry in entries:
        method_cls = get_continual_method(entry.name)
        label = method_cls(entry.options).label
        lrs = _grid(entry, tune.lr_factors)
        grid = {lr: score(label, f"{lr:g}", method_cls(dataclasses.replace(entry.options, lr=lr))) for lr in lrs}
        chosen = max(grid, key=lambda lr: (grid[lr], -lrs.index(lr)))
        tuned[label] = {"protocol": tune.protocol, "validation": {f"{k:g}": v for k, v in grid.items()}, "lr": chosen}
        cells = ", ".join(f"{k:g}: {100 * v:.1f}" for k, v in grid.items())
        echo(f"  {label}: lr {chosen:g} chosen on validation ({described}; lr: val acc % {{{cells}}})")
        edge = grid_edge(chosen, lrs)
        if edge:
            tuned[label]["edge"] = edge
            echo(f"  {label}: {edge_advice(edge, tune.lr_factors)}")
        setting = tune.settings.get(label, tune.settings.get(entry.name))
        if setting:
            tuned[label]["setting"] = _tune_setting(entry, setting, chosen, grid[chosen], label, score, echo)
    return tuned


def grid_edge(chosen: float, grid: list[float]) -> str | None:
    """``"low"`` / ``"high"`` when ``chosen`` is the grid's smallest / largest point (of at least 2), else ``None``."""
    if len(grid) < 2:
        return None
    return "low" if chosen == min(grid) else "high" if chosen == max(grid) else None


def edge_advice(edge: str, factors: list[float]) -> str:
    """What a choice at the ``edge`` of the grid means, and the fix."""
    further = "lower" if edge == "low" else "higher"
    wider = [min(factors) / 3.16, *factors] if edge == "low" else [*factors, max(factors) * 3.16]
    listed = ",".join(f"{f:.3g}" for f in sorted(wider))
    return (
        f"the chosen lr is the {edge} edge of the grid, so a {further} one may score better: widen the grid "
        f"(e.g. --set tune.lr_factors=[{listed}])"
    )


def _tune_setting(
    entry: MethodEntry,
    setting: dict[str, list[Any]],
    lr: float,
    at_configured: float,
    label: str,
    score: Callable[[str, str, Any], float],
    echo: Callable[[str], Any],
) -> dict[str, Any]:
    """Each value of the method's one tuned setting at the chosen ``lr`` (the configured value's score is the lr
    grid's); returns ``{"key", "validation": {value: score}, "value"}`` with the first best value in the listed
    order, the configured value first on a tie."""
    ((key, values),) = setting.items()
    base = dataclasses.replace(entry.options, lr=lr)
    configured = get_setting(base, key)
    grid = {json.dumps(configured): at_configured}
    for value in values:
        if value != configured:
            name = json.dumps(value)
            method = get_continual_method(entry.name)(with_setting(base, key, value))
            grid[name] = score(f"{label}|{key}", f"{name}@{lr:g}", method)
    order = list(grid)
    chosen = max(order, key=lambda v: (grid[v], -order.index(v)))  # the first best; the configured value first
    cells = ", ".join(f"{v}: {100 * s:.1f}" for v, s in grid.items())
    echo(f"  {label}: {key} {chosen} chosen at lr {lr:g} (configured {order[0]}; val acc % {{{cells}}})")
    return {"key": key, "validation": grid, "value": json.loads(chosen)}


def tuned_options(entry: MethodEntry, tuned: dict[str, Any]) -> Any:
    """``entry``'s options with what tuning chose: its ``lr`` and, when one was tuned, its method setting."""
    options = dataclasses.replace(entry.options, lr=tuned["lr"])
    setting = tuned.get("setting")
    return with_setting(options, setting["key"], setting["value"]) if setting else options
