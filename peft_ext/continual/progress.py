"""End-of-task snapshots: what a continual run needs to continue after its last finished task, exactly.

A snapshot holds the model's state dict, the run's state beside the model (the method's and the feature heads':
:meth:`~peft_ext.continual.ContinualEngine.state_dict`; generators stored as their state tensor, so
``torch.load(weights_only=True)`` reads it back) and, for drivers whose random streams run on across tasks, the
random generators' states. :class:`TaskProgress` keeps the latest snapshot and the run's :class:`RunRecord` in a
folder, for :func:`~peft_ext.continual.run_sequence` (``peft-ext run`` gives every method one); the Trainer driver
(:mod:`peft_ext.integrations.continual_trainer`) keeps one snapshot per task in its own layout with the same helpers.

Every file is written through a temporary and renamed into place, the record last: a record never points at a
snapshot that is missing or half written.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..fileperm import atomic_write
from .engine import RunRecord

__all__ = [
    "TaskProgress",
    "load_model_state",
    "random_state",
    "save_atomic",
    "set_random_state",
    "write_json_atomic",
]


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` without ever leaving a half-written ``path``."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def write_json_atomic(obj: Any, path: Path) -> None:
    """``obj`` as JSON in ``path``, written atomically."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=1)))


def random_state() -> dict[str, Any]:
    """The states of torch's CPU (and CUDA) generators and Python's ``random``, as ``weights_only``-loadable data."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_random_state(state: dict[str, Any]) -> None:
    """Restore what :func:`random_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state)``, first resizing buffers whose shape grew during the sequence.

    SplitLoRA's folded factors gain rows with every task; a freshly built model has the first task's shapes.

    Raises:
        ValueError: If a parameter's shape differs, or keys are missing or unexpected (the method changed the
            model's structure after ``build`` in a way its ``between_tasks`` does not undo).
    """
    current = model.state_dict()
    for key, value in state.items():
        if key not in current or current[key].shape == value.shape:
            continue
        prefix, _, leaf = key.rpartition(".")
        module = model.get_submodule(prefix)
        if leaf not in module._buffers:
            raise ValueError(
                f"cannot restore {key!r}: the parameter has shape {tuple(current[key].shape)} in the rebuilt model "
                f"but {tuple(value.shape)} in the checkpoint"
            )
        module._buffers[leaf] = torch.zeros(value.shape, dtype=current[key].dtype, device=current[key].device)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            "the saved model state does not fit the model that method.build() makes (a method that re-wraps the "
            f"model per task cannot be resumed by this driver): {err}"
        ) from None


class TaskProgress:
    """The latest end-of-task snapshot of one method's run, and its record, in ``directory``.

    Layout: ``state.json`` (the run's identity and :class:`RunRecord`) and ``task-{i}.pt`` (model state, method
    state and random generators after task ``i`` was trained, folded and evaluated). Only the latest snapshot is
    kept; the folder is the caller's to delete once the method's result is stored elsewhere.

    Args:
        directory: The folder (created on the first save).
        identity: What must match for a resume (method, label, sequence, a config fingerprint, ...); JSON-friendly.
    """

    STATE = "state.json"

    def __init__(self, directory: str | Path, identity: dict[str, Any]) -> None:
        self.directory = Path(directory)
        self.identity = dict(identity)

    def _snapshot(self, completed: int) -> Path:
        return self.directory / f"task-{completed - 1}.pt"

    def record(self, num_tasks: int) -> RunRecord:
        """The saved record, or an empty one when nothing was saved.

        Raises:
            ValueError: The folder holds the progress of another run (its identity differs).
        """
        path = self.directory / self.STATE
        if not path.is_file():
            return RunRecord.empty(num_tasks)
        saved = json.loads(path.read_text())
        differs = {k: (saved.get(k), v) for k, v in self.identity.items() if saved.get(k) != v}
        if differs:
            raise ValueError(f"{path} belongs to another run; (saved, now) differ in {differs}")
        return RunRecord.from_dict(saved)

    def restore(self, model: nn.Module, record: RunRecord) -> Optional[dict[str, Any]]:
        """Load the snapshot of ``record``'s last finished task into a freshly built ``model``, restore the random
        generators, and return the run's saved state (:meth:`ContinualEngine.state_dict`, for
        :meth:`ContinualEngine.load_state_dict`); ``None`` (nothing loaded) for an empty record."""
        if not record.completed:
            return None
        snapshot = torch.load(self._snapshot(record.completed), weights_only=True)
        load_model_state(model, snapshot["model"])
        set_random_state(snapshot["random"])
        return snapshot["method_state"]

    def save(self, model: nn.Module | dict[str, torch.Tensor], run_state: dict[str, Any], record: RunRecord) -> None:
        """Write the snapshot after ``record``'s last finished task, then the record; drop the older snapshot.

        ``model`` is the model, or its state dict with whole tensors (an FSDP2 model's, gathered from the shards by
        :func:`~peft_ext.continual.sharding.whole_state_dict`); ``run_state`` is :meth:`ContinualEngine.state_dict`,
        already data ``torch.load(weights_only=True)`` reads (the method encodes its generators)."""
        state = model if isinstance(model, dict) else model.state_dict()
        snapshot = {
            "model": {k: v.detach().cpu() for k, v in state.items()},
            "method_state": run_state,
            "random": random_state(),
        }
        save_atomic(snapshot, self._snapshot(record.completed))
        write_json_atomic({**self.identity, **asdict(record)}, self.directory / self.STATE)
        previous: Optional[Path] = self._snapshot(record.completed - 1) if record.completed > 1 else None
        if previous is not None and previous.exists():
            previous.unlink()
