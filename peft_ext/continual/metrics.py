"""Continual-learning metrics on an accuracy matrix.

``R[i][j]`` is the accuracy on task ``j`` after training task ``i`` (0-based, ``T`` tasks). Only ``j <= i`` is
defined; entries above the diagonal are ignored (they may be NaN). All accuracies are fractions in [0, 1].
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

Matrix = Sequence[Sequence[float]]


def _check(R: Matrix) -> int:
    T = len(R)
    if T == 0:
        raise ValueError("the accuracy matrix is empty")
    for i, row in enumerate(R):
        if len(row) != T:
            raise ValueError(f"the accuracy matrix must be square ({T} x {T}); row {i} has {len(row)} entries")
        for j in range(i + 1):
            if not math.isfinite(row[j]):
                raise ValueError(
                    f"R[{i}][{j}] must be a finite accuracy (task {j} was trained by step {i}), got {row[j]}"
                )
    return T


def final_average_accuracy(R: Matrix) -> float:
    """A_T = (1/T) * sum_j R[T-1][j]: mean accuracy over all tasks after the last one."""
    T = _check(R)
    return sum(R[T - 1]) / T


def average_incremental_accuracy(R: Matrix) -> float:
    """(1/T) * sum_i A_i with A_i = (1/(i+1)) * sum_{j<=i} R[i][j]: the mean of the running average accuracies."""
    T = _check(R)
    return sum(sum(R[i][: i + 1]) / (i + 1) for i in range(T)) / T


def backward_transfer(R: Matrix) -> float:
    """BWT = (1/(T-1)) * sum_{j<T-1} (R[T-1][j] - R[j][j]); negative means forgetting. 0.0 for one task."""
    T = _check(R)
    if T == 1:
        return 0.0
    return sum(R[T - 1][j] - R[j][j] for j in range(T - 1)) / (T - 1)


def forgetting(R: Matrix) -> float:
    """F = (1/(T-1)) * sum_{j<T-1} (max_{j<=k<T-1} R[k][j] - R[T-1][j]) (Chaudhry et al. 2018). 0.0 for one task.

    Unlike BWT it compares with the best accuracy a task ever had, not the one right after training it.
    """
    T = _check(R)
    if T == 1:
        return 0.0
    return sum(max(R[k][j] for k in range(j, T - 1)) - R[T - 1][j] for j in range(T - 1)) / (T - 1)


def learning_accuracy(R: Matrix) -> float:
    """(1/T) * sum_i R[i][i]: the mean accuracy on each task right after learning it (plasticity: how well a method
    learns new tasks, whatever it forgets later)."""
    T = _check(R)
    return sum(R[i][i] for i in range(T)) / T


def summarize(R: Matrix) -> dict[str, float]:
    """All metrics in one dict (keys: final_acc, learning_acc, avg_incremental_acc, bwt, forgetting)."""
    return {
        "final_acc": final_average_accuracy(R),
        "learning_acc": learning_accuracy(R),
        "avg_incremental_acc": average_incremental_accuracy(R),
        "bwt": backward_transfer(R),
        "forgetting": forgetting(R),
    }


# Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with ``df`` degrees of freedom (``df >= 1``)."""
    if df < 1:
        raise ValueError(f"a t-interval needs at least 2 paired values (df >= 1), got df={df}")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959964  # past 30 degrees of freedom the Cornish-Fisher expansion is within 1e-4 of the exact value
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def verdict(low: float, high: float) -> str:
    """How a paired difference with the 95 % interval ``[low, high]`` reads: ``"beats"`` when the whole interval is
    above 0, ``"trails"`` when it is below, else ``"ties"``."""
    return "beats" if low > 0 else "trails" if high < 0 else "ties"


def paired_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """Mean of ``a[i] - b[i]`` and its 95 % t-interval ``(mean, low, high)`` (pairs share a seed / data draw)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same seeds: {len(a)} vs {len(b)}")
    diffs = [x - y for x, y in zip(a, b)]
    mean = statistics.mean(diffs)
    if len(diffs) < 2:
        return mean, -math.inf, math.inf
    half = t_quantile(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, mean - half, mean + half
