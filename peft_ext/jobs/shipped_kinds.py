"""The job kinds peft-ext ships, registered when :mod:`peft_ext.jobs` is imported (:mod:`.kinds` holds the
registry and imports no job, so the jobs' own modules can ask it)."""

from __future__ import annotations

from typing import Any

from ..continual.config import RunConfig, config_from_dict
from .kinds import JobKind, register_job_kind
from .multimodal import MissingModalityConfig, missing_modality_config_from_dict
from .preflight import preflight_continual


def _run_continual(config: RunConfig, *, progress: bool, debug: bool, resume: bool) -> Any:
    from .continual import run_job

    if not progress:
        config.train.progress = False
    return run_job(config, debug=debug, resume=resume)


def _run_missing_modality(config: MissingModalityConfig, *, progress: bool, debug: bool, resume: bool) -> Any:
    from .multimodal import run_missing_modality_job

    return run_missing_modality_job(config, debug=debug, resume=resume)


register_job_kind(
    JobKind("continual", RunConfig, config_from_dict, _run_continual, preflight_continual, data_parallel=True)
)
register_job_kind(
    JobKind("missing_modality", MissingModalityConfig, missing_modality_config_from_dict, _run_missing_modality)
)
