"""Run a measurement on several gloo processes of this machine and collect what each returns (no torchrun needed)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["on_processes"]


def _process(rank: int, world: int, store: str, out: str, measure: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.save(measure(rank, world, *args), Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def on_processes(measure: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``measure(rank, world, *args)`` on ``world`` processes (one thread each, gloo, a file store in a temporary
    folder); returns each process's result, by rank. ``measure`` must be a module-level function (it is pickled)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_process, args=(world, str(Path(tmp) / "store"), tmp, measure, args), nprocs=world, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]
