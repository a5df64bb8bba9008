"""The one markdown table writer of the benchmarks, and the cell formats several tables share.

Every table a benchmark prints goes through :func:`markdown_table`, so run_all.py finds them all the same way (a run
of lines starting with ``|``) and they read alike::

    print(markdown_table(["method", "acc", "time"], [["ours", "51.0", "1.2 s"]]))
    | method | acc | time |
    |---|---:|---:|
    | ours | 51.0 | 1.2 s |
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence

__all__ = ["fmt_bytes", "fmt_mib", "fmt_s", "markdown_table", "mean_sd"]

_RULE = {"l": "---", "r": "---:"}


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> str:
    """A markdown table: the header, the alignment rule, one line per row (cells are ``str()``-ed).

    Args:
        header: The column titles.
        rows: The rows, each with one cell per column.
        align: One letter per column, ``l`` (left) or ``r`` (right); default: the first column left, the others
            right (names first, figures after).
    """
    align = "l" + "r" * (len(header) - 1) if align is None else align
    if len(align) != len(header) or set(align) - set(_RULE):
        raise ValueError(f"align needs one of 'l' / 'r' per column ({len(header)}), got {align!r}")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(_RULE[a] for a in align) + "|"]
    for row in rows:
        cells = [str(cell) for cell in row]
        if len(cells) != len(header):
            raise ValueError(f"a row of {len(cells)} cells under {len(header)} columns: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean_sd(values: Sequence[float], scale: float = 100.0, digits: int = 1, mean: Callable = statistics.mean) -> str:
    """``"m ± sd"`` of ``values`` times ``scale`` (one value: just the value; none: ``—``); ``mean`` computes m."""
    if not values:
        return "—"
    centre = mean(values) * scale
    if len(values) == 1:
        return f"{centre:.{digits}f}"
    return f"{centre:.{digits}f} ± {statistics.stdev(values) * scale:.{digits}f}"


def fmt_s(seconds: float) -> str:
    """Milliseconds below a second (``12.3 ms``), seconds above (``1.23 s``)."""
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_bytes(n: float) -> str:
    """KiB below a MiB (``12.3 KiB``), MiB above (``1.23 MiB``)."""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def fmt_mib(n: float) -> str:
    """MiB with one decimal, no unit (a column whose title names it)."""
    return f"{n / 2**20:.1f}"
