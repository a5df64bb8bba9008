"""What the task-cycle methods of every adapter type with a cycle share (docs/task_cycle.md)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["resolve_cycle_adapter"]


def resolve_cycle_adapter(tuner: Any, adapter_name: Optional[str], config_cls: type, kind: str) -> str:
    """The adapter a task-cycle method acts on: ``adapter_name``, or the single active adapter when it is ``None``.

    Args:
        tuner: The PEFT tuner (``BaseTuner``) with ``active_adapters`` and ``peft_config``.
        adapter_name: The adapter named by the caller, or ``None``.
        config_cls: The config class the adapter must have.
        kind: The adapter type's name for messages (e.g. ``"PCLR"``).

    Raises:
        ValueError: If several adapters are active and none is named, or no adapter has that name.
        TypeError: If the adapter is of another type.
    """
    if adapter_name is None:
        if len(tuner.active_adapters) != 1:
            raise ValueError(
                f"{len(tuner.active_adapters)} adapters are active ({tuner.active_adapters}); pass `adapter_name`."
            )
        adapter_name = tuner.active_adapters[0]
    if adapter_name not in tuner.peft_config:
        raise ValueError(f"no adapter named {adapter_name!r}; adapters: {sorted(tuner.peft_config)}")
    if not isinstance(tuner.peft_config[adapter_name], config_cls):
        raise TypeError(f"adapter {adapter_name!r} is not a {kind} adapter")
    return adapter_name
