"""Adapter checkpoints that a crash cannot half-write, and a check that names what is wrong with a bad one.

``model.save_pretrained(path)`` (PEFT) writes its files in place: a process killed mid-save leaves a directory whose
``adapter_model.safetensors`` is truncated, and the next ``PeftModel.from_pretrained`` fails with a safetensors header
error that names neither the file nor the cause. :func:`save_pretrained_atomic` writes into a temporary sibling
directory and renames it into place, so ``path`` holds either the previous checkpoint or the complete new one.
:func:`verify_checkpoint` reads a checkpoint directory without building a model and raises a ``ValueError`` that
names the file and what is wrong (missing, unreadable config, unknown adapter type, truncated or corrupt weights).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from torch import nn

from .fileperm import follow_umask

__all__ = ["save_pretrained_atomic", "verify_checkpoint"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")


def save_pretrained_atomic(model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> Path:
    """``model.save_pretrained(save_directory, **kwargs)``, but never leaving a half-written checkpoint behind.

    The checkpoint is written into a temporary directory next to ``save_directory`` and renamed into place; an
    existing checkpoint there is replaced only once the new one is complete (it is moved aside, the new one renamed
    in, then the old one deleted). If saving fails, ``save_directory`` is left as it was and the error propagates.

    Args:
        model: A ``PeftModel`` (anything with ``save_pretrained``).
        save_directory: Where the checkpoint goes.
        **kwargs: Passed to ``save_pretrained`` (e.g. ``selected_adapters``, ``safe_serialization``).

    Returns:
        The checkpoint directory.
    """
    target = Path(save_directory)
    if target.exists() and not target.is_dir():
        raise ValueError(f"`save_directory` {str(target)!r} is an existing file, not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, **kwargs)
        # mkdtemp made the directory 0700; give it (and all inside) the modes plain save_pretrained would.
        follow_umask(tmp, recursive=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return target


def _adapter_dirs(path: Path) -> list[Path]:
    """The checkpoint directory and, for several adapters, its named sub-directories (PEFT's layout)."""
    dirs = [path] if (path / CONFIG_NAME).is_file() else []
    dirs += sorted(p for p in path.iterdir() if p.is_dir() and (p / CONFIG_NAME).is_file())
    return dirs


def verify_checkpoint(path: str | os.PathLike) -> dict[str, str]:
    """Check a PEFT adapter checkpoint directory without loading a model; raise a ``ValueError`` naming the problem.

    Checks, for the directory and each adapter sub-directory: ``adapter_config.json`` exists and is a JSON object
    whose ``peft_type`` is registered with PEFT (import ``peft_ext`` first for its types), and the weights file exists
    and is readable to its end (a truncated or corrupt safetensors file is reported with its size).

    Args:
        path: The directory ``save_pretrained`` wrote.

    Returns:
        ``{adapter directory: peft_type}`` for every adapter found.
    """
    from peft.utils import PeftType

    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"adapter checkpoint {str(root)!r} does not exist or is not a directory")
    dirs = _adapter_dirs(root)
    if not dirs:
        raise ValueError(f"adapter checkpoint {str(root)!r} has no {CONFIG_NAME}: it is not a PEFT adapter directory")
    found = {}
    for folder in dirs:
        config_path = folder / CONFIG_NAME
        try:
            config = json.loads(config_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{config_path} is not readable JSON ({err}); the checkpoint is corrupt") from err
        if not isinstance(config, dict) or "peft_type" not in config:
            raise ValueError(f"{config_path} has no `peft_type`; it is not a PEFT adapter config")
        peft_type = config["peft_type"]
        if peft_type not in PeftType.__members__:
            raise ValueError(
                f"{config_path} names adapter type {peft_type!r}, which is not registered with PEFT in this process; "
                "known: " + ", ".join(sorted(PeftType.__members__)) + " (import peft_ext for peft-ext's types)"
            )
        weights = next((folder / n for n in WEIGHTS_NAMES if (folder / n).is_file()), None)
        if weights is None:
            raise ValueError(f"{folder} has no adapter weights ({' or '.join(WEIGHTS_NAMES)})")
        if weights.suffix == ".safetensors":
            _check_safetensors(weights)
        found[str(folder)] = peft_type
    return found


def _check_safetensors(path: Path) -> None:
    """Read the header and every tensor's extent; a truncated file fails with its size named."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len <= 0 or 8 + header_len > size:
                raise ValueError("header length runs past the end of the file")
            header = json.loads(f.read(header_len))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(
            f"{path} ({size:,} bytes) is not a complete safetensors file: {err}; it was probably cut short by an "
            "interrupted save (use peft_ext.save_pretrained_atomic) and must be written again"
        ) from err
    end = max((info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise ValueError(
            f"{path} is truncated: its tensors need {8 + header_len + end:,} bytes but the file has {size:,}; it was "
            "probably cut short by an interrupted save and must be written again"
        )
