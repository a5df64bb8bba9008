"""The run cache every benchmark keeps its finished runs in, so a killed or re-started job loses none of them.

One JSON file ``{"settings": {...}, "runs": {key: value}}``, rewritten atomically after every run. A job started
again with the same settings reuses every saved run and trains only the rest; a file written with other settings is
refused with one line naming the settings that differ, never mixed in::

    cache = RunCache("runs/bench-runs.json", {"epochs": 3, "batch_size": 32})
    study = tune_and_test(grids, cache.wrap(score), protocol)   # (method, lr, seed, split) runs saved and reused

    if (method, lr, seed) not in cache:                          # or by hand, any key
        cache.put((method, lr, seed), train(method, lr, seed))
    result = cache[(method, lr, seed)]
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["RunCache", "without", "write_json_atomic"]

Key = tuple[Any, ...] | str


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file and a rename: a job killed mid-write leaves the
    previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def without(runs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, list[dict[str, Any]]]:
    """``{name: [run, ...]}`` with ``key`` left out of every run (e.g. per-step times before a results file)."""
    return {name: [{k: v for k, v in r.items() if k != key} for r in rs] for name, rs in runs.items()}


def _normalized(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists, keys strings; ``inf`` and ``nan`` round-trip)."""
    return json.loads(json.dumps(value, default=str))


class RunCache:
    """Finished runs of a benchmark, each saved to a JSON file as it finishes.

    Runs are keyed by a tuple of JSON scalars (e.g. ``(method, lr, seed, split)``) or by a string; values must be
    JSON-serializable and are kept as JSON gives them back.

    Args:
        path: The file (``None``: keep runs in memory only).
        settings: Everything that changes a run's result besides its key (sizes, epochs, data); compared on load.
        resume: Reuse the runs the file holds (``False``: start empty; the file is replaced at the first run).
        merge: A key of ``settings`` holding one entry per method (or variant): an entry both sides have must be
            equal, an entry only one side has is kept, so one file serves runs of several method selections.
        index: Reads a file whose ``runs`` is a list of values (an older format): the key of each value.
        hint: What to do about a refused file, for its message.
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        settings: dict[str, Any],
        *,
        resume: bool = True,
        merge: str | None = None,
        index: Callable[[Any], Key] | None = None,
        hint: str = "pass another path or delete it",
    ) -> None:
        self.path = None if path is None else Path(path)
        self.settings = json.loads(json.dumps(settings, sort_keys=True, default=str))
        self.merge = merge
        self.runs: dict[str, Any] = {}
        self.reused = 0
        if resume and self.path is not None and self.path.exists():
            try:
                saved = json.loads(self.path.read_text())
                stored, runs = saved["settings"], saved["runs"]
                if isinstance(runs, list) and index is not None:
                    runs = {self._key(index(value)): value for value in runs}
                runs = dict(runs)
            except (ValueError, KeyError, TypeError) as err:
                raise SystemExit(f"{self.path} is not a run cache ({err}); {hint}") from None
            differ = self._differing(stored)
            if differ:
                raise SystemExit(
                    f"{self.path} holds runs made with other settings (differing: {', '.join(differ)}); {hint}"
                )
            if merge is not None:
                self.settings[merge] = {**stored.get(merge, {}), **self.settings.get(merge, {})}
            self.runs = runs

    def _differing(self, stored: dict[str, Any]) -> list[str]:
        mine = self.settings
        differ = sorted(k for k in set(stored) | set(mine) if k != self.merge and stored.get(k) != mine.get(k))
        if self.merge is not None:
            theirs, ours = stored.get(self.merge) or {}, mine.get(self.merge) or {}
            differ += [f"{self.merge}.{k}" for k in sorted(set(theirs) & set(ours)) if theirs[k] != ours[k]]
        return differ

    @staticmethod
    def _key(key: Key) -> str:
        return key if isinstance(key, str) else json.dumps(list(key))

    def __contains__(self, key: Key) -> bool:
        return self._key(key) in self.runs

    def __getitem__(self, key: Key) -> Any:
        return self.runs[self._key(key)]

    def __len__(self) -> int:
        return len(self.runs)

    def values(self) -> list[Any]:
        """Every saved value, in the order the runs were saved."""
        return list(self.runs.values())

    def get(self, key: Key) -> Any:
        """The saved value of ``key`` (counted as reused), or ``None``."""
        if self._key(key) not in self.runs:
            return None
        self.reused += 1
        return self.runs[self._key(key)]

    def pop(self, key: Key) -> Any:
        """Forget the run of ``key`` (it is trained again; the file changes at the next :meth:`put`)."""
        return self.runs.pop(self._key(key), None)

    def put(self, key: Key, value: Any) -> Any:
        """Record a finished run and rewrite the file atomically; returns the value as it is kept."""
        self.runs[self._key(key)] = _normalized(value)
        if self.path is not None:
            write_json_atomic(self.path, {"settings": self.settings, "runs": self.runs})
        return self.runs[self._key(key)]

    def wrap(
        self, score: Callable[[str, float, int, str], float | tuple[float, dict[str, Any]]]
    ) -> Callable[[str, float, int, str], tuple[float, dict[str, Any]]]:
        """``score`` for ``tune_and_test`` with every ``(method, lr, seed, split)`` run saved and reused."""

        def cached(method: str, lr: float, seed: int, split: str) -> tuple[float, dict[str, Any]]:
            key = (method, lr, seed, split)
            saved = self.get(key)
            if saved is None:
                out = score(method, lr, seed, split)
                value, extra = out if isinstance(out, tuple) else (out, {})
                saved = self.put(key, [value, extra])
            return saved[0], saved[1]

        return cached
