"""The checks of :class:`~peft_ext.optim.riemannion.Riemannion`'s construction: how the user's param groups split
into manifold and AdamW groups, their hyperparameters, and whether the adapters are on the manifold."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from ..distributed import full_tensor
from ..precision import is_half
from .adapters import AdapterHandle

__all__ = ["check_group", "check_momentum_split", "check_points", "split_groups"]

_GROUP_KEYS = {"lr", "aux_lr", "momentum", "nesterov", "weight_decay", "aux_weight_decay", "orthogonalize", "betas"}
_GROUP_KEYS |= {"eps", "manifold", "params", "rtol"}


def check_group(group: dict[str, Any], index: int) -> None:
    """Raise ``ValueError`` naming param group ``index``'s first invalid hyperparameter and what would be valid: the
    manifold group's (``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``rtol``) or the auxiliary AdamW's."""

    def bad(key: str, valid: str) -> ValueError:
        return ValueError(f"param group {index}: `{key}` must be {valid}, got {group[key]!r}")

    if isinstance(group["lr"], Tensor):
        if group["lr"].numel() != 1:
            raise ValueError(f"param group {index}: Tensor lr must be 1-element, got shape {tuple(group['lr'].shape)}")
        raise ValueError(
            f"param group {index}: lr as a Tensor is not supported by Riemannion (its step computes on the host "
            f"with Python floats); pass float(lr), got {group['lr']!r}"
        )
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


def split_groups(
    params: Iterable[Any],
    adapters: Sequence[AdapterHandle],
    describe: Callable[[Tensor], str],
    aux_lr: Optional[float],
    aux_weight_decay: Optional[float],
    owner: str,
) -> list[dict[str, Any]]:
    """The optimizer's param groups from the user's: each split into a manifold group (the adapters' ``A``, ``B``,
    ``Z`` in it, adapter by adapter) and an AdamW group (the rest, with ``aux_lr`` / ``aux_weight_decay``).

    Raises:
        ValueError: On an empty list, unknown group keys, a ``"manifold"`` flag the group's parameters contradict, or
            an adapter whose ``A``, ``B`` and ``Z`` are not all in the group.
    """
    if isinstance(params, Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, or the model, but got "
            + torch.typename(params)
        )
    role: dict[int, tuple[int, str]] = {}
    for i, ref in enumerate(adapters):
        for part, p in (("A", ref.A), ("B", ref.B), ("Z", ref.Z)):
            role[id(p)] = (i, part)
    user_groups = list(params)
    if not user_groups:
        raise ValueError(f"{owner} got an empty parameter list")
    if not isinstance(user_groups[0], dict):
        user_groups = [{"params": user_groups}]
    groups = []
    for index, group in enumerate(user_groups):
        group = dict(group)
        unknown = set(group) - _GROUP_KEYS
        if unknown:
            raise ValueError(
                f"param group {index} has unknown keys {sorted(unknown)}; valid keys: {sorted(_GROUP_KEYS)}"
            )
        params_in = group.pop("params")
        params_in = [params_in] if isinstance(params_in, Tensor) else list(params_in)
        flag = group.pop("manifold", None)
        group_aux_lr = group.pop("aux_lr", aux_lr)
        group_aux_wd = group.pop("aux_weight_decay", aux_weight_decay)
        parts: dict[int, dict[str, Tensor]] = {}
        others = []
        for p in params_in:
            if id(p) in role:
                i, part = role[id(p)]
                parts.setdefault(i, {})[part] = p
            else:
                others.append(p)
        if flag is True and others:
            raise ValueError(
                f"param group {index} is marked manifold=True but {len(others)} of its parameters are not part of "
                f"a Riemannion adapter (first: {describe(others[0])}); only riemannion_A/B/Z parameters of "
                "RiemannionLayer modules of the model are valid there"
            )
        if flag is False and parts:
            raise ValueError(
                f"param group {index} is marked manifold=False but holds Riemannion adapter parameters "
                f"({adapters[min(parts)]}); they can only be updated on the manifold"
            )
        for i, found in parts.items():
            missing = sorted({"A", "B", "Z"} - found.keys())
            if missing:
                raise ValueError(
                    f"param group {index} holds riemannion_{'/'.join(sorted(found))} of {adapters[i]} but "
                    f"not riemannion_{'/'.join(missing)}: A, B and Z of an adapter are updated together and must "
                    "be in the same group"
                )
        if parts:
            ordered = [parts[i][part] for i in sorted(parts) for part in ("A", "B", "Z")]
            groups.append({**group, "params": ordered, "manifold": True})
        if others:
            aux = {**group, "params": others, "manifold": False}
            if group_aux_lr is not None:
                aux["lr"] = group_aux_lr
            if group_aux_wd is not None:
                aux["weight_decay"] = group_aux_wd
            groups.append(aux)
    return groups


@torch.no_grad()
def check_points(param_groups: Sequence[dict[str, Any]], describe: Callable[[Tensor], object]) -> None:
    """Raise ``ValueError`` for an adapter that is off the manifold: ``A`` not orthonormal (to the precision of its
    dtype) or ``Z`` nonzero, as another optimizer would leave it. ``describe(A)`` names the adapter."""
    for group in param_groups:
        if not group["manifold"]:
            continue
        for A, Z in zip(group["params"][0::3], group["params"][2::3]):
            ref = describe(A)
            A, Z = full_tensor(A), full_tensor(Z)
            gram = A.double().mT @ A.double()
            err = (gram - torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)).abs().max().item()
            # rounding an orthonormal A to half precision moves A^T A by at most eps(dtype) (+ eps^2 / 4)
            tol = 2 * torch.finfo(A.dtype).eps if is_half(A.dtype) else 1e-4
            if err > tol:
                raise ValueError(
                    f"{ref}: riemannion_A is not orthonormal (max |A^T A - I| = {err:.1e} > {tol}); it was "
                    "changed outside the Riemannion optimizer, so the adapter is off the manifold"
                )
            if Z.any():
                raise ValueError(
                    f"{ref}: riemannion_Z is a gradient probe and must stay zero; it was changed outside the "
                    "Riemannion optimizer (e.g. by AdamW)"
                )
