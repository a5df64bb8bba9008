"""The hyperparameter checks of :class:`~peft_ext.optim.riemannion.Riemannion`'s param groups."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_group", "check_momentum_split"]


def check_group(group: dict[str, Any], index: int) -> None:
    """Raise ``ValueError`` naming param group ``index``'s first invalid hyperparameter and what would be valid: the
    manifold group's (``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``rtol``) or the auxiliary AdamW's."""

    def bad(key: str, valid: str) -> ValueError:
        return ValueError(f"param group {index}: `{key}` must be {valid}, got {group[key]!r}")

    if not (isinstance(group["lr"], (int, float)) and group["lr"] >= 0 and math.isfinite(group["lr"])):
        raise bad("lr", "a finite number >= 0")
    if not 0 <= group["weight_decay"] < math.inf:
        raise bad("weight_decay", "a finite number >= 0")
    if group["manifold"]:
        if not 0 <= group["momentum"] < 1:
            raise bad("momentum", "in [0, 1)")
        if group["nesterov"] and group["momentum"] == 0:
            raise bad("nesterov", "False when momentum is 0 (Nesterov needs momentum)")
        if group["rtol"] is not None and not 0 <= group["rtol"] < 1:
            raise bad("rtol", "None or in [0, 1)")
    else:
        betas = group["betas"]
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise bad("betas", "a pair of numbers in [0, 1)")
        if not group["eps"] > 0:
            raise bad("eps", "> 0")


def check_momentum_split(group: dict[str, Any], world: int, has_momentum: bool) -> None:
    """Under FSDP2 each of ``world`` processes keeps the momentum of the adapters it owns (every ``world``-th): a state
    saved over another number of processes holds other adapters' momentum. Raise ``ValueError`` (before the step
    changes anything) when the group's momentum was split over another count (a whole one, saved by one process or
    under DDP, serves any), then record ``world`` in the group (saved with the state dict)."""
    saved = group.get("momentum_processes", world)
    if has_momentum and saved > 1 and saved != world:
        raise ValueError(
            f"this Riemannion state was saved with its momentum split over {saved} process(es) (each keeps its own "
            f"adapters'), and this run has {world}: resume it on {saved} process(es), or start the optimizer afresh"
        )
    group["momentum_processes"] = world
