"""Job kinds: what a config's top-level ``job`` key names, each an entry that owns its config class, how a config of
it is read, what is checked before any training, whether it runs data-parallel, and how it runs.

``peft-ext run``, ``peft-ext check`` and the launcher ask the kind of a config (:func:`job_kind_of`) instead of
testing its class or name. The shipped kinds are ``continual`` (the default; :mod:`peft_ext.jobs.continual`) and
``missing_modality`` (:mod:`peft_ext.jobs.multimodal`), registered by :mod:`.shipped_kinds` when the package is
imported; :func:`register_job_kind` adds another. This module imports no job, so every job module may ask it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..continual.config import unknown_value

__all__ = ["DEFAULT_JOB", "JOB_KINDS", "JobKind", "get_job_kind", "job_kind_of", "register_job_kind"]


@dataclass(frozen=True)
class JobKind:
    """One kind of job.

    Args:
        name: The ``job`` value that picks it.
        config_cls: The class of its validated configs.
        from_dict: Builds and validates a config from the YAML mapping (without the ``job`` key).
        run: ``run(config, *, progress, debug, resume)``: runs the job, returns its results.
        preflight: ``preflight(config)``: checks what is knowable before training (beyond the output folder, which
            every kind checks), returns what the check built (a continual job's task sequence) or ``None``.
        data_parallel: Runs on several processes under ``torchrun`` / ``accelerate launch``.
    """

    name: str
    config_cls: type
    from_dict: Callable[[Any], Any]
    run: Callable[..., Any]
    preflight: Callable[[Any], Any] | None = None
    data_parallel: bool = False


#: The registered kinds by name, in registration order.
JOB_KINDS: dict[str, JobKind] = {}
#: The kind of a config without a ``job`` key.
DEFAULT_JOB = "continual"


def register_job_kind(kind: JobKind) -> JobKind:
    """Make ``kind`` available as ``job: <kind.name>``; returns it."""
    if kind.name in JOB_KINDS and JOB_KINDS[kind.name] != kind:
        raise ValueError(f"a job kind named {kind.name!r} is already registered")
    JOB_KINDS[kind.name] = kind
    return kind


def get_job_kind(name: Any) -> JobKind:
    """The kind ``job: name`` picks.

    Raises:
        ConfigError: An unknown name, with the nearest kind and the list.
    """
    if name not in JOB_KINDS:
        raise unknown_value("job", name, list(JOB_KINDS))
    return JOB_KINDS[name]


def job_kind_of(config: Any) -> JobKind:
    """The kind whose config class ``config`` is an instance of.

    Raises:
        TypeError: A config of no registered kind.
    """
    for kind in JOB_KINDS.values():
        if isinstance(config, kind.config_cls):
            return kind
    raise TypeError(f"{type(config).__name__} is the config of no registered job kind ({', '.join(JOB_KINDS)})")
