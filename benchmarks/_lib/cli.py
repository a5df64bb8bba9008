"""The options every benchmark shares, built once: ``--quick``, ``--json``, ``--threads`` and ``--runs``.

Each script asks for the ones it has and adds its own::

    parser = benchmark_parser(__doc__, quick="smoke run: 4 classes, 2 seeds", runs=True)
    int_options(parser, epochs=6, batch_size=16)    # --epochs 6, --batch-size 16
    args = parse(parser, argv, quick={"epochs": 1})     # --quick sets these values
    torch.set_num_threads(args.threads)
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["THREADS_HELP", "benchmark_parser", "int_options", "parse"]

THREADS_HELP = (
    "torch threads (default {default}: on a shared 2-core machine OpenMP threads that wait for a busy core make "
    "two-thread timings vary several-fold between runs, while one-thread ratios are stable)"
)


def benchmark_parser(
    doc: str | None,
    *,
    quick: str | None = None,
    json: bool | str = False,
    threads: int | None = None,
    runs: bool = False,
) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` described by the first paragraph of ``doc`` (the script's docstring), with the shared
    options the script has.

    Args:
        doc: The script's docstring.
        quick: Help of ``--quick`` (the smoke run); ``None``: no ``--quick``.
        json: Add ``--json PATH`` ("also write the results here"; a string: its help instead).
        threads: Add ``--threads N`` with this default.
        runs: Add ``--runs PATH``, the run cache file (:class:`benchmarks._lib.cache.RunCache`).
    """
    parser = argparse.ArgumentParser(description=(doc or "").strip().split("\n\n")[0])
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    if json:
        text = json if isinstance(json, str) else "also write the results here"
        parser.add_argument("--json", type=Path, default=None, help=text)
    if threads is not None:
        parser.add_argument("--threads", type=int, default=threads, help=THREADS_HELP.format(default=threads))
    if runs:
        parser.add_argument(
            "--runs", type=Path, default=None, help="save every finished run here and reuse the ones already saved"
        )
    return parser


def int_options(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """Add one integer option per keyword, named after it with dashes (``train_per_class=40``: ``--train-per-class``,
    default 40): the sizes and counts every benchmark takes without further help text."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def parse(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, quick: Mapping[str, Any] | None = None
) -> argparse.Namespace:
    """Parse ``argv`` (``None``: the command line); with ``--quick``, the values of ``quick`` replace the options'."""
    args = parser.parse_args(argv)
    if getattr(args, "quick", False):
        for name, value in (quick or {}).items():
            if not hasattr(args, name):
                raise AttributeError(f"--quick sets {name!r}, which is not an option of this script")
            setattr(args, name, value)
    return args
