"""The protocol every benchmark follows: choose on validation, report test over seeds, judge targets by intervals.

One learning-rate grid per method (log-spaced, the same number of points and the same training budget for every
method), scored on the validation split; the best validation point is then run on the test split over several seeds
(each seed a different data draw where the benchmark has one), reported as mean +- sd together with the paired
difference to the main peer and its 95 % t-interval. A target counts as met only when the interval clears it.

Usage from a benchmark script (run as ``python -m benchmarks.NAME``)::

    from benchmarks._lib.protocol import Protocol, tune_and_test

    protocol = Protocol(tune_seeds=(0,), test_seeds=(0, 1, 2, 3, 4))
    study = tune_and_test(grids, score, protocol)       # score(method, lr, seed, split) -> accuracy in [0, 1]
    print(study.table(baseline="lora_adamw"))
    print(study.verdict("riemannion_loi", "lora_adamw", at_least=0.01, name="Riemannion + LOI vs LoRA + AdamW"))
    study.plot_lr_curves("docs/figures/lr_robustness.png")
    json.dump(study.to_dict(), ...)                       # the grid's results are kept

Which seeds tune is part of the protocol (``tune_seeds``), and :meth:`Study.describe` prints it with the table.
Finished runs are kept by :class:`benchmarks._lib.cache.RunCache` (``cache.wrap(score)``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from peft_ext.continual.metrics import paired_interval, t_quantile  # the package's statistics, re-exported

from .tables import markdown_table, mean_sd

__all__ = [
    "Protocol",
    "Study",
    "log_grid",
    "lr_range_width",
    "paired_interval",
    "plot_lr_panels",
    "t_quantile",
    "tune_and_test",
    "single_task_train",
]


def single_task_train(epochs: int, batch_size: int, seed: int, **more: Any) -> Any:
    """The one-task protocol's training settings (a ``TrainConfig``): every logit trained, a linear schedule with 10 %
    warm-up, on the CPU, no progress bar; ``more`` adds or overrides fields."""
    from peft_ext.continual import TrainConfig

    fixed = {"train_logit_mask": "all", "lr_schedule": "linear", "warmup_ratio": 0.1, "device": "cpu"}
    return TrainConfig(epochs=epochs, batch_size=batch_size, seed=seed, **{**fixed, "progress": False, **more})


def log_grid(center: float, points: int = 3, factor: float = math.sqrt(10)) -> list[float]:
    """``points`` learning rates spaced by ``factor`` around ``center`` (odd ``points``: ``center`` is the middle).

    Args:
        center: The middle of the grid.
        points: How many values (at least 3 for the protocol).
        factor: Ratio of neighbouring values (default half a decade).
    """
    if points < 1 or not center > 0 or not factor > 1:
        raise ValueError(f"need points >= 1, center > 0 and factor > 1, got {points}, {center}, {factor}")
    first = -(points - 1) / 2
    return [float(f"{center * factor ** (first + i):.3g}") for i in range(points)]


def lr_range_width(curve: dict[float, float], within: float = 0.01) -> float:
    """How wide, in decades, the contiguous run of grid points within ``within`` of the best score is.

    Args:
        curve: ``{lr: mean validation score}``.
        within: Tolerance in score units (0.01 = 1 point of accuracy).

    Returns:
        ``log10(max lr / min lr)`` over the run that contains the best point; 0 when only the best point qualifies.
    """
    lrs = sorted(curve)
    best = max(range(len(lrs)), key=lambda i: curve[lrs[i]])
    lo = hi = best
    while lo > 0 and curve[lrs[lo - 1]] >= curve[lrs[best]] - within:
        lo -= 1
    while hi < len(lrs) - 1 and curve[lrs[hi + 1]] >= curve[lrs[best]] - within:
        hi += 1
    return math.log10(lrs[hi] / lrs[lo])


@dataclass(frozen=True)
class Protocol:
    """Which seeds choose the learning rate and which report.

    Args:
        tune_seeds: Seeds whose validation scores are averaged to pick each method's learning rate.
        test_seeds: Seeds of the reported test figures (at least 5 for the protocol; fewer in ``--quick`` runs).
        extend_edges: How many points a method's grid may grow by where its best validation score lies at an end
            of the grid: one step (the ratio of the end point to its neighbour) further out each time, until the best
            point is inside. The same rule for every method; 0 keeps the grids as given.
    """

    tune_seeds: tuple[int, ...] = (0,)
    test_seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    extend_edges: int = 0

    def __post_init__(self) -> None:
        if self.extend_edges < 0:
            raise ValueError(f"extend_edges must be >= 0, got {self.extend_edges}")

    def describe(self) -> str:
        grown = f" (a grid grows by up to {self.extend_edges} point(s) past an end that scores best)"
        return (
            f"learning rate chosen per method on the validation split (mean over seed(s) {list(self.tune_seeds)})"
            f"{grown if self.extend_edges else ''}, then test over seeds {list(self.test_seeds)}"
        )


def beyond_edge(points: Sequence[float], best: float) -> float | None:
    """The learning rate one grid step past ``best`` where it is an end of ``points`` (sorted, at least 2), rounded to
    two significant digits; ``None`` where ``best`` lies inside."""
    if len(points) < 2 or best not in (points[0], points[-1]):
        return None
    neighbour = points[1] if best == points[0] else points[-2]
    return float(f"{best * best / neighbour:.2g}")


@dataclass
class Study:
    """The grid's validation scores, the chosen learning rates and the test scores of every method.

    Args:
        protocol: The seeds used.
        validation: ``{method: {lr: [score per tune seed]}}``.
        chosen: ``{method: lr}``.
        test: ``{method: [score per test seed]}`` (the order of ``protocol.test_seeds``).
        extras: ``{method: [per-seed dicts the score function returned besides the score]}``.
    """

    protocol: Protocol
    validation: dict[str, dict[float, list[float]]] = field(default_factory=dict)
    chosen: dict[str, float] = field(default_factory=dict)
    test: dict[str, list[float]] = field(default_factory=dict)
    extras: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def subset(self, methods: Sequence[str]) -> Study:
        """The part of the study about ``methods`` (e.g. one rank's table), in the study's order."""
        keep = [m for m in self.chosen if m in methods]
        return Study(
            self.protocol,
            {m: self.validation[m] for m in keep},
            {m: self.chosen[m] for m in keep},
            {m: self.test[m] for m in keep},
            {m: self.extras[m] for m in keep},
        )

    def curve(self, method: str) -> dict[float, float]:
        """``{lr: mean validation score}`` of ``method``."""
        return {lr: statistics.mean(v) for lr, v in self.validation[method].items()}

    def table(self, baseline: str | None = None) -> str:
        """Markdown: chosen lr, validation score there, test mean ± sd, lr-range width, difference to ``baseline``."""
        head = ["method", "lr grid", "chosen lr", "val acc", "test acc (mean ± sd)", "lr range within 1 pt"]
        if baseline:
            head.append(f"vs {baseline} (95 % CI)")
        rows = []
        for method, lr in self.chosen.items():
            curve = self.curve(method)
            grid = " / ".join(f"{x:g}" for x in sorted(curve))
            cells = [method, grid, f"{lr:g}", f"{100 * curve[lr]:.1f}", mean_sd(self.test.get(method, []))]
            cells.append(f"{lr_range_width(curve):.1f} decades")
            if baseline:
                if method == baseline or baseline not in self.test:
                    cells.append("—")
                else:
                    mean, lo, hi = paired_interval(self.test[method], self.test[baseline])
                    cells.append(f"{100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]")
            rows.append(cells)
        return markdown_table(head, rows, align="ll" + "r" * (len(head) - 2))

    def verdict(self, method: str, baseline: str, at_least: float, name: str) -> str:
        """``target: ...: met`` only when the 95 % interval's lower end of ``method - baseline`` is ``>= at_least``."""
        mean, lo, hi = paired_interval(self.test[method], self.test[baseline])
        met = lo >= at_least
        return (
            f"target: {name}: {100 * mean:+.1f} points, 95 % CI [{100 * lo:+.1f}, {100 * hi:+.1f}] over "
            f"{len(self.test[method])} seeds (lower end >= {100 * at_least:+.1f}): {'met' if met else 'NOT met'}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly (learning rates as strings where they are keys)."""
        return {
            "protocol": {"tune_seeds": list(self.protocol.tune_seeds), "test_seeds": list(self.protocol.test_seeds)},
            "validation": {m: {f"{lr:g}": v for lr, v in grid.items()} for m, grid in self.validation.items()},
            "chosen": self.chosen,
            "test": self.test,
            "extras": self.extras,
        }

    def plot_lr_curves(self, path: str, title: str = "") -> str:
        """Validation accuracy against learning rate, one curve per method with a ± sd band (over tune seeds)."""
        return plot_lr_panels({title: self}, path)


def plot_lr_panels(panels: dict[str, Study], path: str, width: float = 6.4) -> str:
    """Validation accuracy against learning rate, one axes per study side by side (``{panel title: study}``), one
    curve per method.

    The band is ± one sd over the tune seeds; with a single tune seed there is no band (the markers are the runs).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * len(panels), 4.2))
    for i, (title, study) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for method, grid in study.validation.items():
            lrs = sorted(grid)
            means = [100 * statistics.mean(grid[lr]) for lr in lrs]
            sds = [100 * statistics.stdev(grid[lr]) if len(grid[lr]) > 1 else 0.0 for lr in lrs]
            (line,) = ax.plot(lrs, means, marker="o", label=method)
            ax.fill_between(
                lrs, [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)], alpha=0.15,
                color=line.get_color(),
            )  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("validation accuracy (%)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        if title:
            ax.set_title(title, fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def tune_and_test(
    grids: dict[str, Sequence[float]],
    score: Callable[[str, float, int, str], float | tuple[float, dict[str, Any]]],
    protocol: Protocol,
    echo: Callable[[str], Any] = print,
) -> Study:
    """Run the protocol: every grid point on the validation split over ``protocol.tune_seeds``, then each method's
    best point (first maximum of the mean validation score) on the test split over ``protocol.test_seeds``.

    Args:
        grids: ``{method: learning rates}``; every method should get the same number of points.
        score: ``score(method, lr, seed, split)`` with ``split`` in ``("validation", "test")``: trains from scratch
            with that seed and returns the accuracy on the split (in ``[0, 1]``), or ``(accuracy, extras)``.
        protocol: The seeds.
        echo: Progress lines.
    """
    sizes = {len(g) for g in grids.values()}
    if len(sizes) > 1:
        raise ValueError(f"every method needs the same number of grid points (same budget), got {sizes}")
    study = Study(protocol)

    def run(method: str, lr: float, seed: int, split: str) -> tuple[float, dict[str, Any]]:
        out = score(method, lr, seed, split)
        value, extra = out if isinstance(out, tuple) else (out, {})
        echo(f"  {split:<10} {method:<20} lr {lr:<8g} seed {seed}: {100 * value:.1f}")
        return value, extra

    for method, grid in grids.items():
        points = sorted(grid)
        study.validation[method] = {
            lr: [run(method, lr, s, "validation")[0] for s in protocol.tune_seeds] for lr in points
        }
        for _ in range(protocol.extend_edges):
            curve = study.curve(method)
            new = beyond_edge(points, max(points, key=lambda lr: curve[lr]))
            if new is None:
                break
            study.validation[method][new] = [run(method, new, s, "validation")[0] for s in protocol.tune_seeds]
            points = sorted([*points, new])
        curve = study.curve(method)
        study.chosen[method] = max(points, key=lambda lr: curve[lr])  # first maximum: max keeps the first on ties
    for method, lr in study.chosen.items():
        runs = [run(method, lr, s, "test") for s in protocol.test_seeds]
        study.test[method] = [v for v, _ in runs]
        study.extras[method] = [e for _, e in runs]
    return study
