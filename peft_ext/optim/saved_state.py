"""Loading an optimizer's saved state without torch's dtype cast."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["restore_saved_dtypes"]


def restore_saved_dtypes(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Put back, in their saved dtype, the state tensors ``Optimizer.load_state_dict`` cast to their parameter's dtype.

    ``torch.optim.Optimizer.load_state_dict`` casts every floating-point state tensor to its parameter's dtype. State
    kept in another dtype on purpose (float32 moments of bfloat16 / float16 parameters, float32 absmax scales of
    8-bit codes) would come back rounded, and a resumed run would no longer continue exactly. Call it right after
    ``super().load_state_dict(state_dict)``.

    Args:
        optimizer: The optimizer that has just loaded ``state_dict``.
        state_dict: What its ``state_dict()`` returned (after ``torch.load(..., weights_only=True)`` too).
    """
    saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for pid, p in zip(saved_ids, params):
        for key, value in (state_dict["state"].get(pid) or {}).items():
            if isinstance(value, torch.Tensor) and optimizer.state[p][key].dtype != value.dtype:
                optimizer.state[p][key] = value.to(device=p.device, copy=True)
