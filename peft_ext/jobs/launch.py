"""A continual job under ``torchrun`` / ``accelerate launch``: joining the process group, the launcher's FSDP2
choice, and the number of processes a resumed run must keep.

Launched with ``WORLD_SIZE`` > 1 in the environment, every process runs the job and :func:`job_processes` joins them
into a process group: each method trains data-parallel (:func:`~peft_ext.continual.runner.train_examples`), rank 0
alone prints and writes, and the others wait for it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..continual.config import ConfigError, RunConfig
from ..continual.sharding import sharding_from_launcher
from ..distributed import world_size

__all__ = ["check_world_size", "job_processes", "launcher_sharding"]


@contextmanager
def job_processes(config: Any) -> Iterator[None]:
    """Join the process group that ``torchrun`` / ``accelerate launch`` describe in the environment (``WORLD_SIZE``,
    ``RANK``, ``MASTER_ADDR``, ...) for the block, and leave it after; nothing happens for one process or when a
    group is already initialized (a script that calls the job itself).

    The backend is gloo on CPUs; with CUDA, each process takes the GPU of its ``LOCAL_RANK`` and CUDA tensors go
    through NCCL while CPU tensors (flags, random states) still go through gloo.

    Args:
        config: The job's config (a continual one: the other jobs run on one process).

    Raises:
        ConfigError: Several processes for a job other than ``continual``, or a ``train.device`` that names one GPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or (dist.is_available() and dist.is_initialized()):
        yield
        return
    from .kinds import JOB_KINDS, job_kind_of

    if not job_kind_of(config).data_parallel:
        parallel = [f"`job: {name}`" for name, kind in JOB_KINDS.items() if kind.data_parallel]
        raise ConfigError(
            f"this job runs on one process, but WORLD_SIZE={world}: only {' and '.join(parallel)} runs data-parallel "
            "under torchrun / accelerate launch; start it with plain `peft-ext run`"
        )
    if config.train.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(
            f"`train.device` {config.train.device!r} would put all {world} processes on one GPU; use 'auto' or 'cuda' "
            "(each process takes the GPU of its LOCAL_RANK) or 'cpu'"
        )
    backend = "gloo"
    if config.train.device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend)
    try:
        yield
    finally:
        dist.destroy_process_group()


def launcher_sharding(config: RunConfig) -> RunConfig:
    """``config`` with ``train.sharding: fsdp2`` when ``accelerate launch`` runs the job with an FSDP2 config.

    Raises:
        ConfigError: The accelerate config asks for FSDP1.
    """
    try:
        by_launcher = sharding_from_launcher()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if by_launcher is None or config.train.sharding == by_launcher:
        return config
    return dataclasses.replace(config, train=dataclasses.replace(config.train, sharding=by_launcher))


def check_world_size(out_dir: str) -> None:
    """Refuse to resume, on a different number of processes, a run whose ``results.json`` names another.

    Each process trains on its share of every batch, so the rounding (and, with dropout, the random draws) depend on
    the number of processes: a resumed run equals the uninterrupted one only on the same number.

    Raises:
        ConfigError: The stored ``world_size`` (1 when absent: runs from before it was stored) differs.
    """
    try:
        stored = json.loads((Path(out_dir) / "results.json").read_text())["meta"].get("world_size", 1)
    except (OSError, ValueError, KeyError, AttributeError):
        return  # finished_results already said what is wrong with the file
    if stored != world_size():
        launch = "plain `peft-ext run`" if stored == 1 else f"`torchrun --nproc_per_node {stored} -m peft_ext run`"
        raise ConfigError(
            f"--resume: the run in {out_dir!r} was made on {stored} process(es), this one has {world_size()}; a "
            f"resumed run must use the same number to equal an uninterrupted one: resume it with {launch} (or start "
            "over with --overwrite)"
        )
