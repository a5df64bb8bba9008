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
    best, line, _ = default_method(path, saved)
    return path / "adapters" / best, line


def default_method(path: Union[str, Path], saved: Optional[list[str]] = None) -> tuple[str, str, Optional[str]]:
    """The saved method ``peft-ext predict`` uses for a job's folder when none is named, the line saying so, and the
    split it was chosen on (``"validation"``, ``"test"``, or ``None`` when no score decided it): the
    continual method (an upper bound, ``joint``, left out) with the best final accuracy on the sequence's
    **validation** split when every candidate was scored on one (so the test split stays a fair estimate of the
    chosen method), else on the test split (a job without a validation split; the line says so), else the first
    saved.

    Args:
        path: The job's output folder (holding ``adapters/``).
        saved: Its saved labels (default: read from the folder); at least one.
    """
    path = Path(path)
    saved = saved_methods(path) if saved is None else saved
    metas = {label: json.loads((path / "adapters" / label / MODEL_FILE).read_text()) for label in saved}
    candidates = {
        label: meta for label, meta in metas.items() if not method_capability(meta.get("method", ""), "is_upper_bound")
    }
    scored = [
        (split, {label: float(meta[key]) for label, meta in candidates.items() if meta.get(key) is not None})
        for key, split in (("final_val_acc", "validation"), ("final_acc", "test"))
    ]
    complete = [(split, scores) for split, scores in scored if scores and len(scores) == len(candidates)]
    if not complete:
        return saved[0], f"predicting with {saved[0]} (pass --method to pick one of {saved})", None
    split, scores = complete[0]
    best = max(scores, key=scores.get)
    line = (
        f"predicting with {best} (final accuracy {100 * scores[best]:.1f} % on the {split} split, the best of the "
        f"{len(scores)} continual methods saved"
    )
    if split == "test":
        line += "; chosen on the test split, as the job had no validation split: its test figure is optimistic"
    else:
        test = candidates[best].get("final_acc")
        line += "" if test is None else f"; {100 * float(test):.1f} % on the test split"
    return best, line + f"; --method picks another of {saved})", split
