"""The option checks of DCT-AdamW's family (:class:`~peft_ext.optim.SubspaceAdamW` and its presets): hyperparameters,
target selection, basis and update rule, dtypes and sharding layouts of a param group.

Everything here runs before any state exists (construction and ``add_param_group``), so bad input raises with the
option's name and what is valid, and nothing changes. ``owner`` is the optimizer's class name, for messages.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from ..distributed import check_row_sharded, is_dtensor
from ..precision import check_dtypes
from .bases import BASES
from .dct import DCT_METHODS, SIDES
from .dct_state import QUANT_BLOCKSIZES
from .nonfinite import NONFINITE_POLICIES, caller_stacklevel
from .update_rules import UPDATE_RULES

# NONFINITE_POLICIES and caller_stacklevel live in .nonfinite; re-exported here for modules that import them from here
__all__ = ["NONFINITE_POLICIES", "caller_stacklevel", "check_group", "matches_target", "unmatched_targets"]


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


def unmatched_targets(param_groups: Sequence[dict[str, Any]], owner: str = "DCTAdamW") -> str | None:
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


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value}")
    return value


def check_group(group: dict[str, Any], owner: str = "DCTAdamW") -> None:
    """Raise ``ValueError`` / ``TypeError`` naming the first invalid option of a DCT-AdamW-family param ``group``."""
    for key in ("lr", "eps", "weight_decay", "scale"):
        value = group[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"`{key}` must be a finite number >= 0, got {value!r}")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"`betas` must be a pair of numbers in [0, 1), got {betas!r}")
    positive_int("rank", group["rank"])
    positive_int("update_proj_gap", group["update_proj_gap"])
    positive_int("max_shape", group["max_shape"])
    positive_int("min_8bit_size", group["min_8bit_size"])
    if group.get("side", "auto") not in ("auto", *SIDES):
        raise ValueError(f"`side` must be 'auto', 'left' or 'right', got {group['side']!r}")
    if group["dct_method"] not in DCT_METHODS:
        raise ValueError(f"`dct_method` must be one of {DCT_METHODS}, got {group['dct_method']!r}")
    norm = group["selection_norm"]
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0:
        raise ValueError(f"`selection_norm` must be a positive number or math.inf (paper: 1), got {norm!r}")
    if group["quant_blocksize"] not in QUANT_BLOCKSIZES:
        raise ValueError(f"`quant_blocksize` must be one of {QUANT_BLOCKSIZES}, got {group['quant_blocksize']!r}")
    for key in ("rotate_moments", "column_bias_correction", "error_feedback", "moments_8bit", "error_feedback_8bit"):
        if not isinstance(group[key], bool):
            raise TypeError(f"`{key}` must be True or False, got {group[key]!r}")
    projection, update = group.get("projection", "dct"), group.get("update", "projected")
    if projection not in BASES:
        raise ValueError(f"`projection` must be one of {tuple(BASES)}, got {projection!r}")
    if update not in UPDATE_RULES:
        raise ValueError(f"`update` must be one of {tuple(UPDATE_RULES)}, got {update!r}")
    BASES[projection].check_options(group)
    UPDATE_RULES[update].check_options(group)
    limit = group.get("norm_growth_limit")
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit < 1
    ):
        raise ValueError(f"`norm_growth_limit` must be None or a finite number >= 1 (APOLLO: 1.01), got {limit!r}")
    if group["error_feedback_8bit"] and not group["error_feedback"]:
        raise ValueError("`error_feedback_8bit=True` needs `error_feedback=True` (there is no buffer to quantize)")
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
    check_row_sharded(zip(names, group["params"]), owner, f"the row-local {BASES[projection].label} projection")
    if group.get("side") == "left":
        for name, p in zip(names, group["params"]):
            if p.ndim == 2 and is_dtensor(p) and any(pl.is_shard(0) for pl in p.placements):
                raise ValueError(
                    f"{owner}: side='left' transforms over the rows of `{name}` (shape {tuple(p.shape)}), which "
                    "FSDP2 splits across processes; use side='auto' or 'right' (each process projects its own rows)"
                )
