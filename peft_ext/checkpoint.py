"""Adapter checkpoints that a crash cannot half-write, and a check that names what is wrong with a bad one.

``model.save_pretrained(path)`` (PEFT) writes its files in place: a process killed mid-save leaves a directory whose
``adapter_model.safetensors`` is truncated, and the next ``PeftModel.from_pretrained`` fails with a safetensors header
error that names neither the file nor the cause. :func:`save_pretrained_atomic` writes into a temporary sibling
directory and renames it into place, so ``path`` holds either the previous checkpoint or the complete new one.
:func:`verify_checkpoint` reads a checkpoint directory without building a model and raises a ``ValueError`` that
names the file and what is wrong (missing, unreadable config, unknown adapter type, truncated or corrupt weights,
tensors that do not match the config: another adapter type's names, a rank or pool size other than the config's).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from .fileperm import follow_umask

__all__ = [
    "check_tensors_against_base",
    "check_tensors_against_config",
    "loading_hint",
    "meta_base_models",
    "save_pretrained_atomic",
    "verify_checkpoint",
]

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


def verify_checkpoint(path: str | os.PathLike, base_model: nn.Module | str | None = None) -> dict[str, str]:
    """Check a PEFT adapter checkpoint directory without loading a model; raise a ``ValueError`` naming the problem.

    Checks, for the directory and each adapter sub-directory: ``adapter_config.json`` exists and is a JSON object
    whose ``peft_type`` is registered with PEFT (import ``peft_ext`` first for its types), and the weights file exists
    and is readable to its end (a truncated or corrupt safetensors file is reported with its size), and the saved
    tensors match the config (:func:`check_tensors_against_config`: names of the config's adapter type, ranks and
    pool sizes as the config states). With ``base_model`` every saved tensor's name and shape is also compared with
    what ``get_peft_model`` makes of that base under the config, built on the meta device
    (:func:`check_tensors_against_base`): widths the base fixes are checked too.

    Args:
        path: The directory ``save_pretrained`` wrote.
        base_model: The base model, or its local folder / hub id (read with ``local_files_only``), or ``None``.

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
            shapes = _safetensors_shapes(weights)
        else:
            shapes = _torch_shapes(weights)
        check_tensors_against_config(config, shapes, weights)
        if base_model is not None:
            check_tensors_against_base(config, shapes, weights, base_model)
        found[str(folder)] = peft_type
    return found


def loading_hint(peft_types: Iterable[str]) -> str | None:
    """What a process must do to load adapters of these types, if any of them is peft-ext's; else ``None``.

    PEFT finds an adapter type's config and model classes in tables that ``import peft_ext`` fills. A process that
    calls ``PeftModel.from_pretrained`` without that import sees only PEFT's own types and fails with a bare
    ``KeyError: 'SPLITLORA'`` (the type name), which does not say what is missing.

    Args:
        peft_types: ``peft_type`` values, e.g. the values :func:`verify_checkpoint` returns.
    """
    from .registry import registered_peft_types

    ours = sorted({str(t) for t in peft_types} & {str(m.value) for m in registered_peft_types().values()})
    if not ours:
        return None
    return (
        f"{', '.join(ours)} is a peft-ext adapter type: run `import peft_ext` before `PeftModel.from_pretrained(...)` "
        f"in the process that loads it (without the import PEFT raises KeyError: {ours[0]!r})"
    )


#: PEFT's own LoRA, whose config declares nothing: (tensor name, dimension, config field). peft-ext's adapter types
#: declare theirs as their config class's ``saved_sizes`` (only sizes the config fixes for the adapter's whole life).
PEFT_SAVED_SIZES: dict[str, tuple[tuple[str, int, str], ...]] = {"LORA": (("lora_A", 0, "r"), ("lora_B", 1, "r"))}


def saved_sizes(peft_type: str) -> tuple[tuple[str, int, str], ...]:
    """``(tensor name, dimension, config field)`` of ``peft_type``: its registered config class's ``saved_sizes``,
    or :data:`PEFT_SAVED_SIZES` for PEFT's own types (empty for a type that fixes none)."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    configs = {str(getattr(t, "value", t)): c for t, c in PEFT_TYPE_TO_CONFIG_MAPPING.items()}
    declared = getattr(configs.get(peft_type), "saved_sizes", None)
    return tuple(declared) if declared is not None else PEFT_SAVED_SIZES.get(peft_type, ())


def check_tensors_against_config(
    config: dict[str, Any], shapes: dict[str, tuple[int, ...]], weights: str | os.PathLike
) -> None:
    """Check saved tensor names and sizes against an adapter config; raise a ``ValueError`` naming the mismatch.

    Without building a model: every tensor named after an adapter type (its PEFT prefix, e.g. ``splitlora_``) must
    belong to the config's ``peft_type``, at least one must, and the dimensions the config fixes (ranks, pool sizes;
    :func:`saved_sizes`) must equal the config's values. Catches a config whose ``peft_type`` or ``r`` was edited or
    that belongs to other weights.

    Args:
        config: The parsed ``adapter_config.json``.
        shapes: ``{tensor name: shape}`` as saved.
        weights: The weights file, for the message.
    """
    from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING

    peft_type = str(config["peft_type"])
    prefixes = {str(getattr(t, "value", t)): p for t, p in PEFT_TYPE_TO_PREFIX_MAPPING.items()}
    own = prefixes.get(peft_type)
    owners: dict[str, list[str]] = {}  # prefix -> adapter types (LoRA and AdaLoRA share "lora_")
    for t, p in sorted(prefixes.items()):
        owners.setdefault(p, []).append(t)
    # Longest prefix first, so that e.g. "lora_" never claims a tensor of a type whose prefix ends in "lora_".
    by_length = sorted(owners, key=len, reverse=True)
    sizes = saved_sizes(peft_type)
    matched = 0
    for key, shape in sorted(shapes.items()):
        parts = key.split(".")
        owner = next(((p, part) for part in parts for p in by_length if part.startswith(p)), None)
        if owner is None:
            continue  # modules_to_save copies and other non-adapter tensors
        prefix, part = owner
        if own is not None and prefix != own and not part.startswith(own):
            raise ValueError(
                f"{weights}: tensor {key!r} is a {' or '.join(owners[prefix])} tensor (name starts with {prefix!r}), "
                f"but the config says "
                f"peft_type {peft_type!r} (tensors named {own!r}...): the config does not belong to these weights"
            )
        matched += 1
        for name, dim, field in sizes:
            value = config.get(field)
            if name not in parts or not isinstance(value, int) or len(shape) <= abs(dim) - (dim < 0):
                continue
            if peft_type == "LORA" and (config.get("rank_pattern") or config.get("target_parameters")):
                continue  # per-module ranks, or expert parameters with r per expert: not fixed by `r` alone
            if shape[dim] != value:
                expected = list(shape)
                expected[dim] = value
                raise ValueError(
                    f"{weights}: tensor {key!r} has shape {tuple(shape)}, but the config's {field}={value} gives "
                    f"{tuple(expected)}: the weights were saved with a different {field} than the config states"
                )
    if own is not None and shapes and matched == 0:
        raise ValueError(
            f"{weights} holds no tensor named {own!r}... although the config says peft_type {peft_type!r}: "
            "the config does not belong to these weights"
        )


# PEFT task types -> the transformers Auto class whose model PEFT wraps for them.
_TASK_AUTO_CLASSES = {
    "CAUSAL_LM": "AutoModelForCausalLM",
    "SEQ_CLS": "AutoModelForSequenceClassification",
    "TOKEN_CLS": "AutoModelForTokenClassification",
    "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM",
    "QUESTION_ANS": "AutoModelForQuestionAnswering",
}


def meta_base_models(
    base_model: nn.Module | str,
    task_type: str | None = None,
    base_class: str | None = None,
    num_labels: int | None = None,
) -> list[nn.Module]:
    """The structures a base model may have had under the adapter, on the meta device (no weights read or allocated).

    A ``transformers`` model gives one: its own class on its config. A folder or cached hub id (config read with
    ``local_files_only``) gives the classes a user may have loaded it with, most likely first: the class the adapter
    was made on (``base_class``, PEFT's ``auto_mapping``), the class it was saved from (``architectures``), the Auto
    class of PEFT's ``task_type``, and the bare ``AutoModel``.

    Args:
        base_model: A ``transformers`` model, or a local folder / cached hub id.
        task_type: PEFT's ``task_type`` of the adapter, if any.
        base_class: The ``transformers`` class the adapter was made on (``auto_mapping["base_model_class"]``).
        num_labels: The label count of a classification head the adapter saved (its rows), if any.

    Raises:
        ValueError: ``base_model`` is neither, or its config cannot be read here.
    """
    import torch
    import transformers

    if isinstance(base_model, nn.Module):
        config = getattr(base_model, "config", None)
        if config is None or not hasattr(type(base_model), "config_class"):
            raise ValueError(
                f"base_model is a {type(base_model).__name__}, not a transformers model: pass its folder or hub id"
            )
        with torch.device("meta"):
            return [type(base_model)(config)]
    try:
        config = transformers.AutoConfig.from_pretrained(str(base_model), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"the base model {str(base_model)!r} is not available here ({err})") from None
    if num_labels:
        config.num_labels = num_labels
    names = [
        base_class,
        *(getattr(config, "architectures", None) or [])[:1],
        _TASK_AUTO_CLASSES.get(str(task_type)),
        "AutoModel",
    ]
    models = []
    for name in dict.fromkeys(n for n in names if n and hasattr(transformers, n)):
        cls = getattr(transformers, name)
        with torch.device("meta"):
            models.append(cls.from_config(config) if name.startswith("Auto") else cls(config))
    return models


def check_tensors_against_base(
    config: dict[str, Any], shapes: dict[str, tuple[int, ...]], weights: str | os.PathLike, base_model: nn.Module | str
) -> None:
    """Compare saved tensors with what the config makes of ``base_model``: the same names, the same shapes.

    The adapter is built with ``get_peft_model`` on a meta copy of the base (:func:`meta_base_models`; for a folder,
    the first of its candidate classes whose tensor names match), so widths that only the base fixes (a LoRA
    ``A``'s input width, a layer the config targets that the weights lack) are checked without loading anything.

    Args:
        config: The parsed ``adapter_config.json``.
        shapes: ``{tensor name: shape}`` as saved.
        weights: The weights file, for the message.
        base_model: As for :func:`meta_base_models`.

    Raises:
        ValueError: A tensor is missing, unexpected, or has another shape; or the config cannot be built on the base.
    """
    from dataclasses import fields

    from peft import get_peft_model, get_peft_model_state_dict
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    config_cls = PEFT_TYPE_TO_CONFIG_MAPPING[config["peft_type"]]
    known = {f.name for f in fields(config_cls)}
    candidates = []
    auto = config.get("auto_mapping") or {}
    # a classification head saved with the adapter (modules_to_save) fixes the label count of the class it was made on
    heads = [v for k, v in shapes.items() if k.endswith(("classifier.weight", "score.weight")) and len(v) == 2]
    num_labels = heads[0][0] if heads else None
    for model in meta_base_models(base_model, config.get("task_type"), auto.get("base_model_class"), num_labels):
        peft_config = config_cls(**{k: v for k, v in config.items() if k in known})
        try:
            state = get_peft_model_state_dict(get_peft_model(model, peft_config))
        except (ValueError, TypeError, RuntimeError) as err:
            candidates.append(err)
            continue
        expected = {k: tuple(v.shape) for k, v in state.items()}
        if set(expected) == set(shapes):
            candidates = [expected]
            break
        candidates.append(expected)
    found = next((c for c in candidates if isinstance(c, dict)), None)
    if found is None:
        raise ValueError(f"{weights}: the config cannot be applied to the base model ({candidates[0]})")
    expected = found
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(k for k in set(expected) & set(shapes) if expected[k] != shapes[k])
    if missing or unexpected:
        raise ValueError(
            f"{weights}: the tensors do not match what the config makes of the base model: "
            f"{len(missing)} missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})"
        )
    if wrong:
        key = wrong[0]
        raise ValueError(
            f"{weights}: tensor {key!r} has shape {shapes[key]}, but the config on the base model gives "
            f"{expected[key]} ({len(wrong)} tensors differ): the weights belong to another base model or config"
        )


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {k: tuple(info["shape"]) for k, info in header.items() if k != "__metadata__"}


def _torch_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    import torch

    try:
        state = torch.load(path, map_location="meta", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise ValueError(f"{path} is not a readable PyTorch state dict ({err}); it must be written again") from err
    return {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")}


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
