"""A protocol's runs trained by several processes at once, with the numbers a single process would give.

CPU runs on one thread are deterministic, so a run trained in a worker process gives the same numbers as the same run
in the main one. ``tune_and_test`` asks for its runs one by one and chooses each method's learning rate from the
validation runs before asking for test runs; :func:`missing_runs` replays it against the runs already known to learn
which it needs next (the validation grid first, the chosen learning rates' test seeds once the grid is known), and
:func:`in_workers` trains a batch of them side by side, each result handed back (and saved) as it finishes::

    while todo := missing_runs(grids, protocol, known):
        in_workers(todo, train_one, jobs=2, threads=1, done=lambda key, value: cache.put(key, value))
    study = tune_and_test(grids, score_from_cache, protocol)   # every run known: the study a sequential job builds
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

import torch

from .protocol import Protocol, tune_and_test

__all__ = ["missing_runs", "in_workers"]

Key = tuple[str, float, int, str]  # (method, lr, seed, split), as tune_and_test asks for a run


def missing_runs(
    grids: dict[str, list[float]],
    protocol: Protocol,
    known: Callable[[Key], tuple[float, dict[str, Any]] | None],
) -> list[Key]:
    """The runs ``tune_and_test`` needs next that ``known`` (``(score, extras)`` of a run, ``None`` when not run yet)
    lacks: the missing validation runs, and test runs only of methods whose validation runs are all known (their
    chosen learning rate depends on them). Empty when every run the protocol needs is known."""
    pending: dict[Key, str] = {}

    def probe(method: str, lr: float, seed: int, split: str) -> tuple[float, dict[str, Any]]:
        key = (method, lr, seed, split)
        found = known(key)
        if found is not None:
            return found
        if split == "validation" or not any(k[0] == method and s == "validation" for k, s in pending.items()):
            pending.setdefault(key, split)
        return 0.0, {}  # a placeholder: what the replay chooses from it is never trained

    tune_and_test(grids, probe, protocol, echo=lambda line: None)
    # a point past a grid's end is chosen from placeholders while the grid's own points are pending: not yet needed
    unsure = {m for (m, lr, _, split) in pending if split == "validation" and lr in grids[m]}
    return [key for key in pending if not (key[0] in unsure and key[1] not in grids[key[0]])]


def _threaded(threads: int) -> None:
    torch.set_num_threads(threads)


def in_workers(
    units: Sequence[Any],
    call: Callable[..., Any],
    *,
    jobs: int,
    threads: int,
    done: Callable[[Any, Any], None],
) -> None:
    """``call(*unit)`` for every unit (a tuple) in ``jobs`` spawned processes of ``threads`` torch threads each;
    ``done(unit, result)`` runs in this process as each one finishes, so a finished run is saved before the next ends.
    ``call`` and the units must pickle (a module-level function, or a ``functools.partial`` of one). A run that
    raises stops the batch with its error once the runs already started have finished (their results kept)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_threaded, initargs=(threads,)) as pool:
        futures = {pool.submit(call, *unit): unit for unit in units}
        for future in as_completed(futures):
            done(futures[future], future.result())
