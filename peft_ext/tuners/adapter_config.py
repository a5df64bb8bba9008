"""The config base of the linear-layer adapter types: the target-selection fields they all share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from peft.config import PeftConfig

from ..fingerprint import not_a_setting
from ._common import validate_target_selection

#: Written into every saved peft-ext adapter's ``adapter_config.json`` (the ``loading_note`` field), for whoever opens
#: the folder: PEFT alone cannot load these types.
LOADING_NOTE = (
    "a peft-ext adapter type: `pip install peft-ext` (installed, it registers its types whenever peft is imported); "
    "where that is off (PEFT_EXT_NO_AUTOLOAD=1, an editable install), `import peft_ext` before "
    "PeftModel.from_pretrained (without it PEFT raises KeyError with the type's name)"
)


def loading_note_field() -> Any:
    """The ``loading_note`` dataclass field every peft-ext config carries (the code never reads it)."""
    return not_a_setting(LOADING_NOTE, metadata={"help": "What loading this adapter needs; for readers, not read."})


@dataclass
class AdapterConfig(PeftConfig):
    """Config base of an adapter on ``nn.Linear`` targets: which modules to adapt and which to train besides.

    A tuner's config subclasses it, adds its own fields and, in its ``__post_init__``, calls
    ``super().__post_init__()`` (which applies :func:`validate_target_selection`) before setting ``peft_type``.

    Args:
        target_modules: Names (suffixes) or a regex of the ``nn.Linear`` modules to adapt; defaults to PEFT's LoRA
            targets when the model type is known.
        exclude_modules: Names or a regex of modules not to adapt.
        modules_to_save: Modules besides the adapters to train and save (e.g. a classification head).
        layers_to_transform: Layer indices to adapt (with ``layers_pattern``); only with a list ``target_modules``.
        layers_pattern: Name of the ``nn.ModuleList`` that ``layers_to_transform`` indexes.
        loading_note: What loading a saved adapter of this type needs, kept in ``adapter_config.json`` for whoever
            opens the folder (:data:`LOADING_NOTE`); the code never reads it.
    """

    target_modules: Optional[Union[list[str], str]] = field(
        default=None,
        metadata={"help": "Module names (suffixes) or a regex of the nn.Linear modules to adapt, e.g. ['q_proj']."},
    )
    exclude_modules: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Module names or a regex of modules not to adapt."}
    )
    modules_to_save: Optional[list[str]] = field(
        default=None, metadata={"help": "Modules besides the adapters to set trainable and save (e.g. a head)."}
    )
    layers_to_transform: Optional[Union[list[int], int]] = field(
        default=None, metadata={"help": "Layer indices to adapt (with layers_pattern)."}
    )
    layers_pattern: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Name of the nn.ModuleList that layers_to_transform indexes."}
    )
    loading_note: str = loading_note_field()

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_target_selection(self)
