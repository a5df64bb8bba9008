"""What continuing a SplitLoRA task sequence needs beyond inference, kept out of the adapter checkpoint.

The adapter checkpoint (``save_pretrained``) holds what the forward pass needs: the finished tasks' delta in factored
form (or dense once that is smaller), the current ``A`` and ``B`` and the count of finished tasks. The running input
statistics (the dense ``in x in`` covariance or the frequent-directions sketch, its error bound, the token count and
energy) and the primary count are needed only to split the next task; at width 2048 they are 37x the size of the
rest. :func:`save_sequence_state` writes them, on request, to ``splitlora_sequence_state.safetensors`` beside the
adapter; :func:`load_sequence_state` restores them, checked against the loaded adapter, so the sequence continues
exactly as if it had never stopped.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ...distributed import full_tensor, write_full_
from ...fileperm import atomic_write
from .layer import SplitLoRALayer

__all__ = [
    "SEQUENCE_BUFFER_NAMES",
    "SEQUENCE_STATE_FILE",
    "fill_missing_sequence_state",
    "is_sequence_key",
    "load_sequence_state",
    "missing_sequence_state",
    "save_sequence_state",
]

SEQUENCE_STATE_FILE = "splitlora_sequence_state.safetensors"
#: Per-adapter buffers that only continuing the sequence needs (never read by the forward pass).
SEQUENCE_BUFFER_NAMES: tuple[str, ...] = (
    "splitlora_cov",
    "splitlora_sketch",
    "splitlora_sketch_error",
    "splitlora_tokens",
    "splitlora_energy",
    "splitlora_primary",
)
_FORMAT = "1"


def is_sequence_key(key: str) -> bool:
    """Whether a state-dict key (``...<module>.<buffer>[.<adapter>]``) names a sequence-state buffer."""
    return any(part in SEQUENCE_BUFFER_NAMES for part in key.split("."))


def _module_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _layers(model: nn.Module, adapter_name: str) -> list[tuple[str, SplitLoRALayer]]:
    return [
        (_module_name(name), module)
        for name, module in model.named_modules()
        if isinstance(module, SplitLoRALayer) and adapter_name in module.splitlora_B
    ]


def _entries(layer: SplitLoRALayer, adapter_name: str) -> dict[str, torch.Tensor]:
    return {
        buffer: getattr(layer, buffer)[adapter_name]
        for buffer in SEQUENCE_BUFFER_NAMES
        if adapter_name in getattr(layer, buffer)
    }


def fill_missing_sequence_state(
    model: nn.Module, adapter_name: str, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Loading an adapter checkpoint without sequence state: give its buffers zeros (a fresh, not-yet-loaded state)
    instead of leaving them missing, so PEFT reports no missing keys and a stale state of an earlier adapter of the
    same name is not kept. ``begin_task`` / ``end_task`` then ask for :func:`load_sequence_state`."""
    for name, layer in _layers(model, adapter_name):
        for buffer, current in _entries(layer, adapter_name).items():
            key = f"{name}.{buffer}.{adapter_name}"
            if key not in state_dict:
                device = "cpu" if current.device.type == "meta" else current.device
                state_dict[key] = torch.zeros(current.shape, dtype=current.dtype, device=device)
    return state_dict


def missing_sequence_state(model: nn.Module, adapter_name: str) -> list[str]:
    """Modules that have finished tasks but no statistics: the adapter was loaded without its sequence state
    (``end_task`` never leaves a module with finished tasks and zero tokens)."""
    return [
        name
        for name, layer in _layers(model, adapter_name)
        if int(layer.splitlora_tasks[adapter_name]) > 0 and int(layer.splitlora_tokens[adapter_name]) == 0
    ]


def _path(save_directory: str | os.PathLike, adapter_name: str) -> Path:
    folder = Path(save_directory)
    return (folder if adapter_name == "default" else folder / adapter_name) / SEQUENCE_STATE_FILE


def save_sequence_state(model: nn.Module, adapter_name: str, save_directory: str | os.PathLike) -> Path:
    """Write the adapter's sequence state to ``save_directory`` (``<adapter name>/`` below it for an adapter other
    than ``default``, as ``save_pretrained`` does), atomically. Returns the file written."""
    layers = _layers(model, adapter_name)
    if not layers:
        raise ValueError(f"adapter {adapter_name!r} adapts no module: there is no sequence state to save")
    tensors = {}
    for name, layer in layers:
        tensors[f"{name}.splitlora_tasks"] = layer.splitlora_tasks[adapter_name]
        for buffer, value in _entries(layer, adapter_name).items():
            tensors[f"{name}.{buffer}"] = value
    # FSDP2 with sharded statistics: gathered whole (a collective: every process calls this, as for the weights)
    tensors = {key: full_tensor(value).detach().to("cpu").contiguous() for key, value in tensors.items()}
    path = _path(save_directory, adapter_name)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": _FORMAT, "adapter": adapter_name}))
    return path


def load_sequence_state(model: nn.Module, adapter_name: str, save_directory: str | os.PathLike) -> Path:
    """Restore the sequence state written by :func:`save_sequence_state` into the loaded adapter.

    All or nothing: every module's tensors are checked (present, same shape, same number of finished tasks as the
    adapter's weights) before any is copied. Returns the file read.
    """
    path = _path(save_directory, adapter_name)
    if not path.is_file():
        raise FileNotFoundError(
            f"no SplitLoRA sequence state at {path}: save it with model.save_sequence_state({str(save_directory)!r}) "
            "next to save_pretrained (the adapter checkpoint alone is enough for inference, not to continue)"
        )
    saved = load_file(str(path))
    copies = []
    for name, layer in _layers(model, adapter_name):
        tasks_key = f"{name}.splitlora_tasks"
        if tasks_key not in saved:
            raise ValueError(f"{path} has no sequence state for module {name!r}: it belongs to another model")
        tasks, expected = int(saved[tasks_key]), int(layer.splitlora_tasks[adapter_name])
        if tasks != expected:
            raise ValueError(
                f"{path} was saved after {tasks} finished task(s), but adapter {adapter_name!r} on {name!r} has "
                f"{expected}: load the sequence state saved together with this adapter checkpoint"
            )
        for buffer, current in _entries(layer, adapter_name).items():
            key = f"{name}.{buffer}"
            if key not in saved:
                raise ValueError(f"{path} has no {buffer!r} for module {name!r} (statistics kind changed?)")
            if tuple(saved[key].shape) != tuple(current.shape):
                raise ValueError(
                    f"{path}: {key} has shape {tuple(saved[key].shape)}, the adapter's has {tuple(current.shape)}"
                )
            copies.append((current, saved[key]))
    for current, value in copies:
        write_full_(current, value.to(current.device))  # a DTensor (sharded statistics) takes its own share
    return path
