"""Pieces every peft-ext tuner shares: which base layers a linear adapter can wrap, and routing PEFT's
``adapter_names`` (mixed-adapter batches) to the adapter layers."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Optional

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import resolve_quantization_backend
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn
from transformers.pytorch_utils import Conv1D

__all__ = [
    "check_adapter_names_args",
    "forward_adapter_names",
    "matches_targets",
    "require_linear_target",
    "require_positive_int",
    "validate_target_selection",
]


def matches_targets(name: str, targets: str | Iterable[str]) -> bool:
    """PEFT's rule for ``target_modules``: a string is a regular expression the whole module name must match; a list
    (or set) selects a name equal to an entry or ending with ``"." + entry``.

    Args:
        name: A module's name in the model.
        targets: The ``target_modules`` value.
    """
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def require_linear_target(target: nn.Module, current_key: str, method: str) -> None:
    """Raise a ``ValueError`` naming the module unless ``target`` is an ``nn.Linear``, a transformers ``Conv1D``
    (GPT-2's linear layer, weight stored ``in x out``) or a quantized linear layer.

    Args:
        target: The module ``target_modules`` matched (possibly already wrapped by an adapter layer).
        current_key: Its name in the model.
        method: The adapter type, for the message.
    """
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if isinstance(base, (nn.Linear, Conv1D)):
        return
    backend = resolve_quantization_backend(base)
    if backend is not None and backend.layer_type == "linear":
        return
    raise ValueError(
        f"{method} supports torch.nn.Linear, transformers' Conv1D and quantized linear layers (bitsandbytes "
        "Linear8bitLt / Linear4bit); "
        f"the target {current_key!r} is a {type(base).__name__}. Adjust `target_modules`."
    )


#: PEFT's wording of the mixed-batch conditions it defines (tools and tests match on it); ours adds the hint.
MERGED_ADAPTER_NAMES = (
    "Cannot pass `adapter_names` when there are merged adapters, please call `unmerge_adapter` first."
)


def _adapter_names_pre_forward_hook(
    module: nn.Module, args: tuple, kwargs: dict[str, Any], adapter_names: list[str]
) -> tuple[tuple, dict[str, Any]]:
    kwargs["adapter_names"] = adapter_names
    return args, kwargs


@contextmanager
def forward_adapter_names(
    tuner: nn.Module,
    adapter_names: Optional[list[str]],
    known: Callable[[], Iterable[str]],
    layer_types: tuple[type, ...],
    merged: Callable[[], bool] = lambda: False,
) -> Iterator[None]:
    """Hand PEFT's ``adapter_names`` (one adapter name per batch row) to every adapter layer for one forward pass.

    The body of a tuner's ``_enable_peft_forward_hooks``: refuses training mode, unknown names and merged adapters
    with a ``ValueError`` naming what is valid, then registers pre-forward hooks that pass the names as a keyword
    argument to each layer of ``layer_types`` and to ``modules_to_save`` copies, and removes them afterwards.

    Args:
        tuner: The tuner (a ``BaseTuner``).
        adapter_names: The names, or ``None`` (nothing to do).
        known: Returns the adapter names that exist.
        layer_types: The tuner's adapter layer classes.
        merged: Returns whether an adapter is merged (per-row adapters are then impossible).
    """
    if adapter_names is None:
        yield
        return
    if tuner.training:
        raise ValueError(
            "Cannot pass `adapter_names` when the model is in training mode. (`adapter_names` is for inference only; "
            "call model.eval() first)"
        )
    available = set(known())
    unknown = {name for name in adapter_names if name != "__base__"} - available
    if unknown:
        raise ValueError(
            f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unknown))} (known: {sorted(available)} "
            "and '__base__')"
        )
    if merged():
        raise ValueError(MERGED_ADAPTER_NAMES)
    hook = partial(_adapter_names_pre_forward_hook, adapter_names=list(adapter_names))
    handles = [
        module.register_forward_pre_hook(hook, with_kwargs=True)
        for module in tuner.modules()
        if isinstance(module, (*layer_types, AuxiliaryTrainingWrapper))
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def check_adapter_names_args(layer: BaseTunerLayer, x: torch.Tensor, adapter_names: Optional[list[str]]) -> None:
    """A layer's check of a mixed-adapter batch: one adapter name per input row, and nothing merged."""
    if adapter_names is None:
        return
    if len(x) != len(adapter_names):
        raise ValueError(
            "Length of `adapter_names` should be the same as the number of inputs, but got "
            f"{len(adapter_names)} and {len(x)} respectively. (One adapter name per input row.)"
        )
    if layer.merged:
        raise ValueError(MERGED_ADAPTER_NAMES)


def validate_target_selection(config: Any) -> None:
    """The checks every linear-layer adapter config shares: ``target_modules`` / ``exclude_modules`` lists become
    sets (PEFT's convention), and ``layers_to_transform`` / ``layers_pattern`` are used consistently.

    Call it from the config's ``__post_init__``; attributes the config lacks are skipped.

    Args:
        config: The adapter config (a ``PeftConfig`` dataclass).
    """
    for key in ("target_modules", "exclude_modules"):
        if isinstance(getattr(config, key, None), (list, tuple)):
            setattr(config, key, set(getattr(config, key)))
    target_modules = getattr(config, "target_modules", None)
    layers_to_transform = getattr(config, "layers_to_transform", None)
    layers_pattern = getattr(config, "layers_pattern", None)
    if isinstance(target_modules, str) and layers_to_transform is not None:
        raise ValueError("`layers_to_transform` cannot be used when `target_modules` is a regex string")
    if isinstance(target_modules, str) and layers_pattern is not None:
        raise ValueError("`layers_pattern` cannot be used when `target_modules` is a regex string")
    if layers_pattern and layers_to_transform is None:
        raise ValueError("`layers_pattern` needs `layers_to_transform`; set both or neither")


def require_positive_int(config: Any, *names: str) -> None:
    """Raise ``ValueError`` naming the field and its value unless each field ``names`` of ``config`` is an int >= 1.

    Args:
        config: The config.
        *names: Its fields to check.
    """
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
