"""Timing on a shared machine: calls timed side by side, round by round, and their ratios pair by pair.

Absolute times on a machine shared with other jobs are not comparable between runs, and not even between two loops
run one after the other. :class:`Interleaved` runs every call once per round (the first one rotating from round to
round, so none always runs on a cache the previous one warmed), and a ratio is taken within each round, then
summarized over the rounds with a 95 % interval::

    timer = Interleaved(["eager", "compiled"], warmup=1)
    for i in range(rounds):
        timer.round({"eager": lambda: step(eager), "compiled": lambda: step(compiled)})
    ratio = timer.ratio("compiled", "eager")   # .median of the per-round ratios, .geo_mean [.low, .high]
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .protocol import paired_interval

__all__ = ["Interleaved", "Ratio", "cpu_seconds", "median_time", "timed"]


@dataclass(frozen=True)
class Ratio:
    """The ratio of two timed calls, measured in the rounds that ran both.

    Args:
        per_round: ``a / b`` in each such round.
        of_medians: ``median(a) / median(b)`` over those rounds.
    """

    per_round: list[float]
    of_medians: float

    @property
    def median(self) -> float:
        """The median of the per-round ratios."""
        return statistics.median(self.per_round)

    @property
    def interval(self) -> tuple[float, float, float]:
        """Geometric mean of the per-round ratios and its 95 % t-interval (computed on their logarithms)."""
        logs = [math.log(x) for x in self.per_round]
        mean, lo, hi = paired_interval(logs, [0.0] * len(logs))
        return math.exp(mean), math.exp(lo), math.exp(hi)


class Interleaved:
    """Calls timed side by side: a round runs each call once, the order rotating by one label every round.

    Args:
        labels: The calls' names, in the order of the first round.
        warmup: Rounds run first and not recorded (caches, allocator, lazy state).
        rotate: Rotate the order every round (``False``: always ``labels``' order, for calls that feed each other).
        clock: Seconds now (``time.perf_counter``; tests pass a fake one).
    """

    def __init__(
        self,
        labels: Sequence[str],
        *,
        warmup: int = 0,
        rotate: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.labels = list(labels)
        self.warmup = warmup
        self.rotate = rotate
        self.clock = clock
        self.all_rounds: list[dict[str, float]] = []  # warm-up included, each round's times in the order they ran

    def order(self, round_: int) -> list[str]:
        """The labels in the order round ``round_`` (0 = the first, warm-up included) runs them."""
        k = round_ % len(self.labels) if self.rotate else 0
        return self.labels[k:] + self.labels[:k]

    def round(
        self,
        calls: Mapping[str, Callable[[], Any]],
        before: Callable[[str], Any] | None = None,
        after: Callable[[str], Any] | None = None,
    ) -> dict[str, Any]:
        """Run one round: each label of ``calls`` once (labels left out sit this round out), ``before(label)`` and
        ``after(label)`` around each call, off the clock; returns what the calls returned."""
        unknown = set(calls) - set(self.labels)
        if unknown:
            raise KeyError(f"labels not timed here: {sorted(unknown)}")
        times, results = {}, {}
        for label in self.order(len(self.all_rounds)):
            if label in calls:
                if before is not None:
                    before(label)
                start = self.clock()
                results[label] = calls[label]()
                times[label] = self.clock() - start
                if after is not None:
                    after(label)
        self.all_rounds.append(times)
        return results

    @property
    def rounds(self) -> list[dict[str, float]]:
        """The recorded rounds (after the warm-up)."""
        return self.all_rounds[self.warmup :]

    def times(self, label: str) -> list[float]:
        """``label``'s seconds in every recorded round it ran."""
        return [r[label] for r in self.rounds if label in r]

    def median(self, label: str) -> float:
        return statistics.median(self.times(label))

    def ratio(self, a: str, b: str) -> Ratio:
        """``a / b`` pair by pair (each round that ran both); see :class:`Ratio`."""
        pairs = [(r[a], r[b]) for r in self.rounds if a in r and b in r]
        if not pairs:
            raise ValueError(f"no recorded round ran both {a!r} and {b!r}")
        return Ratio(
            [x / y for x, y in pairs], statistics.median(x for x, _ in pairs) / statistics.median(y for _, y in pairs)
        )


def timed(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds one call of ``fn`` takes."""
    start = clock()
    fn()
    return clock() - start


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 0, sync: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones; ``sync`` (e.g. a CUDA
    synchronize) runs before the clock starts and before it stops."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads. On a shared machine wall time measures the neighbours
    too; CPU time divided by the threads in use estimates the wall time the run would take alone."""
    return time.process_time()
