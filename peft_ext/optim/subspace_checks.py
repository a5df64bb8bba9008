"""The option checks of :class:`~peft_ext.optim.SubspaceAdamW` (and its preset :class:`~peft_ext.optim.DCTAdamW`):
the optimizer's own hyperparameters, target selection, dtypes and sharding layouts of a param group, and how a group's
basis and update rule are resolved from names, objects and options (:mod:`.components`).

Everything here runs before any state exists (construction and ``add_param_group``), so bad input raises with the
option's name and what is valid, and nothing changes. ``owner`` is the optimizer's class name, for messages.
"""

from __future__ import annotations

import difflib
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..distributed import check_row_sharded, is_dtensor
from ..precision import check_dtypes
from .components import KINDS, REGISTRY, Component, component_class, component_of, unknown_options_message
from .dct import SIDES, projection_side
from .nonfinite import NONFINITE_POLICIES, caller_stacklevel
from .subspace_state import QUANT_BLOCKSIZES

__all__ = [
    "OPTIMIZER_OPTIONS",
    "check_group",
    "check_lr",
    "matches_target",
    "param_name",
    "parts_from_options",
    "planned_rank",
    "resolve_group",
    "restore_group",
    "side_of",
    "unmatched_targets",
]

#: The options :class:`~peft_ext.optim.SubspaceAdamW` itself owns; a group's basis and update rule add theirs.
OPTIMIZER_OPTIONS = (
    "lr",
    "rank",
    "update_proj_gap",
    "betas",
    "eps",
    "weight_decay",
    "scale",
    "target_modules",
    "max_shape",
    "side",
    "rotate_moments",
    "moments_8bit",
    "quant_blocksize",
    "min_8bit_size",
    "sync_indices",
    "nonfinite",
)

#: Options that apply to the whole optimizer: kept in every group (so a copy or a pickle keeps them), equal in all.
WHOLE_OPTIMIZER = ("sync_indices", "nonfinite")


def _part_options(kinds: Sequence[str] = KINDS) -> set[str]:
    """Every option some registered part of ``kinds`` declares."""
    return {key for kind in kinds for cls in REGISTRY[kind].values() for key in cls.option_defaults()}


def _refusing(classes: Mapping[str, type[Component]], key: str) -> type[Component]:
    """The part of ``classes`` that a message about ``key`` should name: the one with a reason, else its kind's."""
    with_reason = [cls for cls in classes.values() if key in cls.why_not]
    if with_reason:
        return with_reason[0]
    return classes["basis"] if key in _part_options(("basis",)) else classes["update"]


def matches_target(module_name: str, target_modules: str | Sequence[str] | None) -> bool:
    """Whether ``module_name`` is selected by ``target_modules``.

    ``None`` selects everything. A string is a regular expression that must match the whole module name (as in
    PEFT). A list selects a module when one of its entries is a run of whole dotted components of the name:
    ``"query"`` matches ``encoder.layer.0.attention.self.query`` and, under PEFT, that module's
    ``query.lora_A.default``, but not ``query_proj``.
    """
    if target_modules is None:
        return True
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module_name) is not None
    padded = f".{module_name}."
    return any(f".{t}." in padded for t in target_modules)


def unmatched_targets(param_groups: Sequence[dict[str, Any]], owner: str = "SubspaceAdamW") -> str | None:
    """A warning's text when some group's ``target_modules`` selects none of its named parameters, else ``None``.

    Such a group trains every parameter with plain AdamW, which is valid (so not an error) but almost always a typo.

    Args:
        param_groups: The optimizer's param groups (checked by :func:`check_group`).
        owner: The optimizer's class name, for the message.
    """
    missed, available = [], []
    for number, group in enumerate(param_groups):
        targets, names = group["target_modules"], group.get("param_names")
        if targets is None or not names:
            continue
        modules = [name.rsplit(".", 1)[0] if "." in name else name for name in names]
        if not any(matches_target(module, targets) for module in modules):
            missed.append(f"{targets!r} (group {number})")
            matrices = [m for m, p in zip(modules, group["params"]) if p.ndim == 2]
            available += [m for m in dict.fromkeys(matrices or modules) if m not in available]
    if not missed:
        return None
    shown = ", ".join(repr(m) for m in available[:5]) + (", ..." if len(available) > 5 else "")
    return (
        f"{owner}: `target_modules` {'; '.join(missed)} matches no parameter, so every parameter there gets plain "
        f"AdamW (no projection, no memory saving); the modules holding matrices are e.g. {shown} (a list entry "
        "matches whole dotted components of a module's name, a string must match the whole name as a regex)"
    )


def param_name(group: dict[str, Any], index: int) -> str | None:
    """The name of parameter ``index`` of ``group``, when the parameters came with names."""
    names = group.get("param_names")
    return names[index] if names is not None else None


def side_of(group: dict[str, Any], p: torch.Tensor) -> str:
    """The side of ``p`` that ``group`` compresses: its ``side``, or for ``"auto"`` the smaller dimension (always
    ``"right"`` for a DTensor, FSDP2's row shard, so each process projects its own rows)."""
    if group["side"] != "auto":
        return group["side"]
    return "right" if is_dtensor(p) else projection_side(p.shape)


def planned_rank(group: dict[str, Any], index: int, p: torch.Tensor) -> tuple[int | None, int]:
    """``(rank, requested)``: the rank parameter ``index`` of ``group`` is projected to (None: plain AdamW, as for
    vectors, matrices with a dimension ``>= max_shape`` and those outside ``target_modules``) and the group's rank."""
    if p.ndim != 2 or max(p.shape) >= group["max_shape"]:
        return None, group["rank"]
    name = param_name(group, index)
    module = name.rsplit(".", 1)[0] if name is not None and "." in name else (name or "")
    if not matches_target(module, group["target_modules"]):
        return None, group["rank"]
    n = p.shape[1] if side_of(group, p) == "right" else p.shape[0]
    return min(group["rank"], n), group["rank"]


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value}")
    return value


def check_lr(lr: Any, owner: str) -> None:
    """Raise ``ValueError`` for a learning rate that is not a finite number >= 0, with torch's optimizers' wording
    where they have one ("Invalid learning rate", "lr as a Tensor is not supported")."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        raise ValueError(
            f"lr as a Tensor is not supported by {owner} (its step computes on the host with Python floats); pass "
            f"float(lr), got {lr!r}"
        )
    _check_number("lr", "learning rate", lr)


def _check_number(key: str, label: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"Invalid {label}: {value!r}; `{key}` must be a finite number >= 0")


def _check_betas(betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"`betas` must be a pair of numbers in [0, 1), got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor):
            raise ValueError(f"betas as Tensors are not supported; `betas` must be a pair of floats, got {betas!r}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(
                f"Invalid beta parameter at index {i}: {beta!r}; `betas` must be a pair of numbers in [0, 1)"
            )


def check_group(group: dict[str, Any], owner: str = "SubspaceAdamW") -> None:
    """Raise ``ValueError`` / ``TypeError`` naming the first invalid option of the optimizer's own in a param
    ``group`` (its basis and update rule validated themselves when :func:`resolve_group` built them)."""
    check_lr(group["lr"], owner)
    _check_number("eps", "epsilon value", group["eps"])
    _check_number("weight_decay", "weight_decay value", group["weight_decay"])
    _check_number("scale", "scale value", group["scale"])
    _check_betas(group["betas"])
    positive_int("rank", group["rank"])
    positive_int("update_proj_gap", group["update_proj_gap"])
    positive_int("max_shape", group["max_shape"])
    positive_int("min_8bit_size", group["min_8bit_size"])
    if group["side"] not in ("auto", *SIDES):
        raise ValueError(f"`side` must be 'auto', 'left' or 'right', got {group['side']!r}")
    if group["quant_blocksize"] not in QUANT_BLOCKSIZES:
        raise ValueError(f"`quant_blocksize` must be one of {QUANT_BLOCKSIZES}, got {group['quant_blocksize']!r}")
    for key in ("rotate_moments", "moments_8bit"):
        if not isinstance(group[key], bool):
            raise TypeError(f"`{key}` must be True or False, got {group[key]!r}")
    if group["nonfinite"] not in NONFINITE_POLICIES:
        raise ValueError(f"`nonfinite` must be one of {NONFINITE_POLICIES}, got {group['nonfinite']!r}")
    if group["sync_indices"] not in (None, True, False):
        raise TypeError(f"`sync_indices` must be None, True or False, got {group['sync_indices']!r}")
    targets = group["target_modules"]
    if targets is not None:
        if isinstance(targets, str):
            try:
                re.compile(targets)
            except re.error as err:
                raise ValueError(f"`target_modules` {targets!r} is not a valid regular expression: {err}") from None
        elif not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) and t for t in targets):
            raise TypeError(f"`target_modules` must be None, a regex string or a list of names, got {targets!r}")
        elif not targets:
            raise ValueError("`target_modules` is an empty list; use None to project every eligible matrix")
        if "param_names" not in group:
            raise TypeError(
                "`target_modules` selects parameters by name, but the parameters came without names: pass "
                "`model.named_parameters()` (or param groups of (name, parameter) pairs), not `model.parameters()`"
            )
    check_dtypes(zip(group.get("param_names") or range(len(group["params"])), group["params"]), owner)
    names = group.get("param_names") or [f"parameter {i}" for i in range(len(group["params"]))]
    # FSDP2 row shards are projected where they live (side "right"); column shards and ZeRO-3 partitions are not
    label = component_class("basis", group["basis"]).label
    check_row_sharded(zip(names, group["params"]), owner, f"the row-local {label} projection")
    if group.get("side") == "left":
        for name, p in zip(names, group["params"]):
            if p.ndim == 2 and is_dtensor(p) and any(pl.is_shard(0) for pl in p.placements):
                raise ValueError(
                    f"{owner}: side='left' transforms over the rows of `{name}` (shape {tuple(p.shape)}), which "
                    "FSDP2 splits across processes; use side='auto' or 'right' (each process projects its own rows)"
                )


# --- a group's basis and update rule ----------------------------------------------------------------------------


def deprecated_projection(options: dict[str, Any], basis: Any) -> Any:
    """The basis that ``options`` (constructor keywords or a param group, changed in place) ask for: ``projection``,
    the basis's name before ``basis`` existed (used in released docs), is taken out and wins, with a
    ``DeprecationWarning``; else ``basis``. One rule for the constructor and for param groups."""
    if "projection" not in options:
        return basis
    warnings.warn(
        "`projection=` is deprecated; pass `basis=` (the same names: 'dct', 'coordinates', 'power')",
        DeprecationWarning,
        stacklevel=caller_stacklevel(),
    )
    return options.pop("projection")


def parts_from_options(basis: Any, update: Any, options: dict[str, Any], owner: str) -> tuple[Component, Component]:
    """The basis and update rule of a constructor call: objects as given, names built with the keyword ``options``
    that their classes declare (each option goes to the part that declares it; the basis first).

    ``projection=`` is the deprecated name of ``basis=`` (:func:`deprecated_projection`).

    Raises:
        TypeError: For a keyword neither part declares (naming who does, or the closest valid keyword).
    """
    options = dict(options)
    basis = deprecated_projection(options, basis)
    chosen: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
    classes = {"basis": basis, "update": update}
    for kind, value in classes.items():
        cls = type(value) if isinstance(value, Component) else component_class(kind, value)
        classes[kind] = cls
        for key in cls.option_defaults():
            if key in options:
                chosen[kind][key] = options.pop(key)
    for key in options:
        if key in _part_options():
            raise TypeError(f"{owner}: {unknown_options_message(_refusing(classes, key), [key])}")
        valid = [*OPTIMIZER_OPTIONS, *KINDS, *(k for c in classes.values() for k in c.option_defaults())]
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{owner} got an unexpected keyword argument {key!r}{hint}")
    return component_of("basis", basis, chosen["basis"]), component_of("update", update, chosen["update"])


def resolve_group(group: Mapping[str, Any], defaults: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """A user's param ``group`` with its basis and update rule resolved to names and complete options.

    A group may name another basis or update rule than the optimizer's (or give an object); options it does not set
    come from the optimizer's when the part is the same, else from the part's defaults.

    Raises:
        TypeError: For an option of some registered part that this group's parts do not declare.
    """
    group = dict(group)
    if "projection" in group:
        group["basis"] = deprecated_projection(group, group.get("basis"))
    declared: set[str] = set()
    for kind in KINDS:
        value = group.get(kind, defaults[kind])
        cls = type(value) if isinstance(value, Component) else component_class(kind, value)
        own = {key: group.pop(key) for key in cls.option_defaults() if key in group}
        if not isinstance(value, Component) and value == defaults[kind]:
            own = {**{key: defaults[key] for key in cls.option_defaults() if key in defaults}, **own}
        part = component_of(kind, value, own)
        group[kind] = part.name
        group.update(part.options())
        declared |= set(part.option_defaults())
    foreign = [key for key in group if key in _part_options() - declared]
    if foreign:
        classes = {kind: component_class(kind, group[kind]) for kind in KINDS}
        raise TypeError(f"{owner}: {unknown_options_message(_refusing(classes, foreign[0]), foreign[:1])}")
    for key in WHOLE_OPTIMIZER:
        if key in group and group[key] != defaults[key]:
            raise ValueError(
                f"`{key}` applies to the whole optimizer; pass it to the constructor, not in a param group "
                f"(group has {group[key]!r}, the optimizer {defaults[key]!r})"
            )
    return group


def drop_foreign_options(group: dict[str, Any]) -> None:
    """Remove from ``group`` the part options its basis and update rule do not declare (inherited from defaults)."""
    declared = {key for kind in KINDS for key in component_class(kind, group[kind]).option_defaults()}
    for key in _part_options() - declared:
        group.pop(key, None)


def restore_group(group: dict[str, Any], defaults: Mapping[str, Any]) -> None:
    """Bring a loaded param group to the current layout, in place.

    A group saved with ``projection`` (the basis's former key) gets ``basis`` (``DeprecationWarning``); keys added
    since it was saved take the optimizer's values (as torch's own optimizers do in ``__setstate__``); options that
    were kept for every part then but that its basis and update rule do not declare are dropped.
    """
    if "projection" in group:
        warnings.warn(
            "this optimizer state was saved with the param-group key `projection`; it is read as `basis`. Save it "
            "again to store the current key",
            DeprecationWarning,
            stacklevel=caller_stacklevel(),
        )
        group.setdefault("basis", group.pop("projection"))
    ours = {*OPTIMIZER_OPTIONS, *KINDS} | _part_options()  # torch's __setstate__ adds its own keys to defaults
    for key, value in defaults.items():
        if key in ours:
            group.setdefault(key, value)
    drop_foreign_options(group)
