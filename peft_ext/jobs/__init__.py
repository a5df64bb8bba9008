"""Job entry points of ``peft-ext run``: read a config, pick its job, run it.

A config's top-level ``job`` key picks the job: ``continual`` (the default; :mod:`peft_ext.jobs.continual`) or
``missing_modality`` (:mod:`peft_ext.jobs.multimodal`, e.g. ``configs/mora_emoji.yaml``). This package sits above
:mod:`peft_ext.continual` and :mod:`peft_ext.multimodal`; nothing below imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from ..continual.config import RunConfig, read_config
from . import shipped_kinds  # noqa: F401  (registers the shipped job kinds)
from .errors import JobFailed
from .kinds import DEFAULT_JOB, JOB_KINDS, get_job_kind, job_kind_of
from .multimodal import MissingModalityConfig
from .preflight import check_finite
from .resume import claim_output_dir

__all__ = ["JOBS", "JobFailed", "load_job_config", "run_job_config", "select_methods"]

#: The job kinds' names (:mod:`.kinds`: each owns its config, checks and run).
JOBS = tuple(JOB_KINDS)


def resolve_data_paths(data: Any, folder: Path) -> None:
    """Make the relative ``data.train`` / ``test`` / ``validation`` paths of a ``dataset: files`` config relative to
    the config file's ``folder`` (where a shipped config's data lives), when the file is there; a hub id or a path
    found nowhere is left as written (the reader then names it)."""
    section = data.get("data") if isinstance(data, dict) else None
    if not isinstance(section, dict) or section.get("dataset") not in ("files", "instructions"):
        return

    def resolve(value: Any) -> Any:
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if not isinstance(value, str) or Path(value).expanduser().is_absolute():
            return value
        there = folder / value
        return str(there) if there.exists() else value

    for key in ("train", "test", "validation", "tasks"):
        if key in section:
            section[key] = resolve(section[key])


def select_methods(data: Any, only: list[str]) -> None:
    """Keep, in a config's raw mapping, only the methods named in ``only`` (in the config's order, each with its own
    settings). A continual method is named by its ``label`` or, without one, its ``name``; every method of that name
    is kept when several share it (e.g. ``riemannion`` with two inits).

    Raises:
        ConfigError: A name that is not among the config's methods (with the names that are), or an empty list.
    """
    from ..continual.config import ConfigError

    methods = data.get("methods") if isinstance(data, dict) else None
    if not isinstance(methods, list) or not methods:
        return  # validation reports the missing `methods` list itself
    wanted = [name.strip() for name in only if name.strip()]
    if not wanted:
        raise ConfigError("--only needs at least one method name, e.g. --only seq_lora,splitlora")

    def names(entry: Any) -> set[str]:
        if isinstance(entry, dict):
            return {str(v) for v in (entry.get("label"), entry.get("name")) if v is not None}
        return {str(entry)}

    known = [n for entry in methods for n in sorted(names(entry))]
    unknown = [name for name in wanted if name not in known]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"--only: {unknown[0]!r} is not a method of this config{hint}; its methods: {known}")
    data["methods"] = [entry for entry in methods if names(entry) & set(wanted)]


def load_job_config(
    path: str, overrides: list[str] | None = None, only: list[str] | None = None
) -> Union[RunConfig, MissingModalityConfig]:
    """Read, override and validate a config of any job.

    Args:
        path: The YAML file.
        overrides: ``key.path=value`` overrides (see :func:`peft_ext.continual.config.apply_overrides`).
        only: Run only these methods (:func:`select_methods`; ``--only``), after the overrides.

    Returns:
        A :class:`~peft_ext.continual.config.RunConfig` (``job: continual``, the default) or a
        :class:`~peft_ext.jobs.multimodal.MissingModalityConfig` (``job: missing_modality``).
    """
    data = read_config(path, overrides)
    resolve_data_paths(data, Path(path).parent)
    if only is not None:
        select_methods(data, only)
    check_finite(data)
    job = data.pop("job", DEFAULT_JOB) if isinstance(data, dict) else DEFAULT_JOB
    return get_job_kind(job).from_dict(data)


def run_job_config(
    config: Union[RunConfig, MissingModalityConfig],
    progress: bool = True,
    debug: bool = False,
    resume: bool = False,
    overwrite: bool = False,
) -> Any:
    """Run the job ``config`` describes; return its results.

    Args:
        config: A config from :func:`load_job_config`.
        progress: Show progress bars (continual jobs).
        debug: Print the traceback of a failed method or grid cell.
        resume: Continue an interrupted job from the work it finished (``--resume``).
        overwrite: Start over in an ``output.dir`` that holds an earlier run, moving its files aside (``--overwrite``).

    Raises:
        JobFailed: Some methods failed (the others' results are on disk).
        ConfigError: ``output.dir`` holds an earlier run and neither ``resume`` nor ``overwrite`` says what to do.
    """
    kind = job_kind_of(config)
    claim_output_dir(config.output.dir, resume, overwrite)
    return kind.run(config, progress=progress, debug=debug, resume=resume)
