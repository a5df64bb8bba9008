"""``peft-ext run --resume`` / ``--overwrite``: the config's fingerprint stored with the results, the finished
work read back, and an earlier run's files never replaced by accident.

A continual job writes ``results.json`` after every method and a snapshot after every task
(:func:`peft_ext.jobs.continual.run_job`, :mod:`peft_ext.continual.progress`), so an interrupted job has every
finished method and task on disk. Each method starts from the same seeded copy of the backbone and a resumed method
restores the model, the method's state and the random generators of its last finished task, so the resumed job ends
with the report of an uninterrupted run (timings aside). A missing-modality job writes ``results.json`` after every
grid cell (:func:`peft_ext.jobs.multimodal.run_missing_modality_job`) and a resumed one runs only the missing cells,
each of which seeds everything it draws. :func:`earlier_results` reads the finished work of either back.

A job refuses an ``output.dir`` that holds an earlier run unless told what to do with it (:func:`claim_output_dir`):
``--resume`` continues it, ``--overwrite`` moves its files into ``output.dir/replaced-<time>/`` and starts over.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..continual.config import ConfigError, RunConfig
from ..continual.engine import MethodResult
from ..fingerprint import fingerprint

__all__ = ["EARLIER_RUN_FILES", "claim_output_dir", "config_hash", "earlier_results", "finished_results"]

# What marks an output dir as holding a run: the report, the snapshots of unfinished methods, the tuning grid.
EARLIER_RUN_FILES = ("results.json", "results.md", "accuracy_matrix.png", "progress", "tuning.json")


def config_hash(config: Any) -> str:
    """A fingerprint of everything that changes a job's results (the whole validated config dataclass of any job), 16
    hex digits. What a setting that changes no result, or one added after runs were fingerprinted, leaves out is
    declared by its own field (:mod:`peft_ext.fingerprint`)."""
    return fingerprint(config)


def earlier_results(out_dir: str, fingerprint: str) -> list[dict[str, Any]]:
    """The result rows an earlier run of the same config wrote to ``out_dir/results.json`` (any job: each row as
    stored, one per finished method or grid cell).

    Args:
        out_dir: The config's ``output.dir``.
        fingerprint: The :func:`config_hash` of the config being resumed.

    Raises:
        ConfigError: Nothing to resume (no results in ``out_dir``), a file that is not a results file, or results
            made with a different config.
    """
    path = Path(out_dir) / "results.json"
    if not path.is_file():
        raise ConfigError(f"--resume: nothing to resume in `output.dir` {out_dir!r} (no results.json)")
    try:
        payload = json.loads(path.read_text())
        stored = payload["meta"].get("config_hash")
        rows = payload["results"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise TypeError("`results` is not a list of mappings")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"--resume: {str(path)!r} is not a results file of peft-ext ({err})") from None
    if stored != fingerprint:
        raise ConfigError(
            f"--resume: the results in {out_dir!r} were made with a different config (hash {stored} vs "
            f"{fingerprint}); start over with --overwrite instead of --resume (the earlier run is moved aside, not "
            "deleted), or give another `output.dir`"
        )
    return rows


def finished_results(config: RunConfig, fingerprint: str) -> list[MethodResult]:
    """The methods an earlier run of the same continual config finished, read from its ``results.json``
    (:func:`earlier_results`).

    Args:
        config: The config being resumed.
        fingerprint: Its :func:`config_hash`.

    Raises:
        ConfigError: As :func:`earlier_results`, or rows that are not a continual job's results.
    """
    rows = earlier_results(config.output.dir, fingerprint)
    try:
        return [MethodResult(**r) for r in rows]
    except TypeError as err:
        path = str(Path(config.output.dir) / "results.json")
        raise ConfigError(f"--resume: {path!r} is not a results file of a continual job ({err})") from None


def claim_output_dir(out_dir: str, resume: bool, overwrite: bool) -> None:
    """Make ``out_dir`` ready for a job, never losing an earlier run's files.

    Args:
        out_dir: The config's ``output.dir``.
        resume: ``--resume``: the earlier run is continued (checked later against the config's fingerprint).
        overwrite: ``--overwrite``: the earlier run's files are moved into ``out_dir/replaced-<UTC time>/``.

    Raises:
        ConfigError: ``out_dir`` holds an earlier run and neither flag was given, or both were.
    """
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other: continue the earlier run, or start over")
    out = Path(out_dir)
    earlier = [out / name for name in EARLIER_RUN_FILES if (out / name).exists()]
    if resume or not earlier:
        return
    if not overwrite:
        raise ConfigError(
            f"`output.dir` {out_dir!r} holds an earlier run ({', '.join(p.name for p in earlier)}); continue it with "
            "--resume, start over with --overwrite (its files are moved aside, not deleted), or give another "
            "`output.dir`"
        )
    aside = out / time.strftime("replaced-%Y%m%d-%H%M%S", time.gmtime())
    while aside.exists():  # two overwrites within a second
        aside = aside.with_name(aside.name + "-1")
    aside.mkdir()
    for path in earlier:
        path.rename(aside / path.name)
