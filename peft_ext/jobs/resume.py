"""``peft-ext run --resume``: the config's fingerprint stored with the results, and the finished methods read back.

A continual job writes ``results.json`` after every method (:func:`peft_ext.jobs.continual.run_job`), so an
interrupted job has every finished method on disk. Each method starts from the same seeded copy of the backbone
(:meth:`~peft_ext.continual.engine.ContinualEngine.build`), so skipping the finished ones leaves the others' numbers
unchanged: the resumed job ends with the report of an uninterrupted run (timings aside). A method interrupted midway
starts again from its first task.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from ..continual.config import ConfigError, RunConfig
from ..continual.engine import MethodResult

__all__ = ["config_hash", "finished_results"]


def _plain(value: Any) -> Any:
    # json.dumps fallback: sets (PEFT configs turn target_modules into a set) in a stable order, anything else as text.
    return sorted(map(str, value)) if isinstance(value, (set, frozenset)) else str(value)


def config_hash(config: RunConfig) -> str:
    """A fingerprint of everything that changes a job's results (the whole validated config except whether progress
    bars show), 16 hex digits."""
    data = dataclasses.asdict(config)
    data["train"].pop("progress", None)
    text = json.dumps(data, sort_keys=True, default=_plain)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def finished_results(config: RunConfig, fingerprint: str) -> list[MethodResult]:
    """The methods an earlier run of the same config finished, read from its ``results.json``.

    Args:
        config: The config being resumed.
        fingerprint: Its :func:`config_hash`.

    Raises:
        ConfigError: Nothing to resume (no results in ``output.dir``), or the results there were made with a
            different config.
    """
    path = Path(config.output.dir) / "results.json"
    if not path.is_file():
        raise ConfigError(f"--resume: nothing to resume in `output.dir` {config.output.dir!r} (no results.json)")
    try:
        payload = json.loads(path.read_text())
        stored = payload["meta"].get("config_hash")
        results = [MethodResult(**r) for r in payload["results"]]
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--resume: {str(path)!r} is not a results file of peft-ext ({err})") from None
    if stored != fingerprint:
        raise ConfigError(
            f"--resume: the results in {config.output.dir!r} were made with a different config (hash {stored} vs "
            f"{fingerprint}); run without --resume to start over, or give another `output.dir`"
        )
    return results
