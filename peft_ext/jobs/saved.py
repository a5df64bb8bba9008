"""Which saved method a path names: a method's folder, a job's output folder, or a continual config (its
``output.dir``); what ``peft-ext predict CONFIG_OR_FOLDER FILE`` loads."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional, Union

from ..continual.methods import method_capability
from ..continual.trained import MODEL_FILE, saved_methods
from . import load_job_config

__all__ = ["default_method", "trained_folder"]


def trained_folder(source: Union[str, Path], method: Optional[str] = None) -> tuple[Path, Optional[str]]:
    """The saved method's folder that ``source`` names, and a line saying which one was picked (or ``None``).

    ``source`` is a method's folder, a job's output folder (holding ``adapters/``), or a continual config (its
    ``output.dir``). In a job's folder ``method`` picks the label; by default the continual method with the best
    final accuracy in the job's ``results.json`` (an upper bound, ``joint``, left out).

    Raises:
        ValueError: Nothing saved there, or no saved method ``method`` (naming the saved ones).
    """
    path = Path(source)
    if (path / MODEL_FILE).is_file():
        if method is not None:
            raise ValueError(f"{str(path)!r} is one method's folder; --method picks a method in a job's folder")
        return path, None
    if path.is_file():
        with warnings.catch_warnings():  # the config's advice (a missing lr) is for running it, not for predicting
            warnings.simplefilter("ignore")
            config = load_job_config(str(path))
        output = getattr(getattr(config, "output", None), "dir", None)
        if output is None:
            raise ValueError(f"{str(path)!r} is not a continual job's config")
        path = Path(output)
    saved = saved_methods(path)
    if not saved:
        raise ValueError(
            f"no trained models under {str(path / 'adapters')!r}: run the job first (peft-ext run), with "
            "output.save_adapters left true"
        )
    if method is not None:
        if method not in saved:
            raise ValueError(f"no saved method {method!r} under {str(path / 'adapters')!r}; saved: {saved}")
        return path / "adapters" / method, None
    best, line = default_method(path, saved)
    return path / "adapters" / best, line


def default_method(path: Union[str, Path], saved: Optional[list[str]] = None) -> tuple[str, str]:
    """The saved method ``peft-ext predict`` uses for a job's folder when none is named: the continual method with
    the best final accuracy (an upper bound, ``joint``, left out), else the first saved; and the line saying so.

    Args:
        path: The job's output folder (holding ``adapters/``).
        saved: Its saved labels (default: read from the folder); at least one.
    """
    path = Path(path)
    saved = saved_methods(path) if saved is None else saved
    scores = {}
    for label in saved:
        meta = json.loads((path / "adapters" / label / MODEL_FILE).read_text())
        if not method_capability(meta.get("method", ""), "is_upper_bound") and meta.get("final_acc") is not None:
            scores[label] = float(meta["final_acc"])
    if not scores:
        return saved[0], f"predicting with {saved[0]} (pass --method to pick one of {saved})"
    best = max(scores, key=scores.get)
    return best, (
        f"predicting with {best} (final accuracy {100 * scores[best]:.1f} %, the best of the {len(scores)} continual "
        f"methods saved; --method picks another of {saved})"
    )
