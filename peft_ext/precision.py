"""Half precision: which dtypes peft-ext computes in, and which it refuses.

Adapters and models may be float32, bfloat16 or float16 (float64 works too: the fp32 rules apply). Two rules hold
everywhere:

- Decompositions (QR, SVD, eigh, Cholesky, randomized SVD) run in float32 when their input is half precision and
  their results are cast back: CPU kernels for them do not exist in half precision, and where CUDA ones do, half
  precision loses the orthogonality the methods rely on. :func:`compute_dtype` is that rule.
- State that accumulates over many steps (optimizer moments, statistics, prototypes) is kept in float32 or wider
  whatever the parameter's dtype; each module's docstring says which of its state this is.

This module depends on torch alone, so every part of peft-ext can use it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["HALF_DTYPES", "SUPPORTED_DTYPES", "check_dtypes", "compute_dtype", "is_half"]

#: The half-precision floating dtypes.
HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
#: The dtypes adapters and peft-ext's optimizers compute in (float8 and complex dtypes have no kernels for their
#: matmuls and decompositions, and integer tensors cannot be trained).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def is_half(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is bfloat16 or float16.

    Args:
        dtype: The dtype.
    """
    return dtype in HALF_DTYPES


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a decomposition of a ``dtype`` tensor runs in: float32 for half precision, else ``dtype`` itself.

    Args:
        dtype: The input's dtype.
    """
    return torch.float32 if dtype in HALF_DTYPES else dtype


def check_dtypes(params: Iterable[tuple[str | int, torch.Tensor]], owner: str) -> None:
    """Raise ``TypeError`` naming the first parameter whose dtype is not in :data:`SUPPORTED_DTYPES`.

    Called before anything is changed (a forward, a merge, an optimizer's construction), so a refused model is left
    as it was.

    Args:
        params: ``(name, tensor)`` pairs; an int name is the parameter's position in its group (unnamed parameters).
        owner: The adapter type or optimizer, for the message.
    """
    for name, p in params:
        if p.dtype not in SUPPORTED_DTYPES:
            where = f"parameter {name} of its group" if isinstance(name, int) else f"parameter {name!r}"
            valid = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise TypeError(
                f"{owner}: {where} has dtype {p.dtype}; {owner} works with floating-point tensors of dtype {valid}. "
                "Cast it (or the model) to one of them, e.g. model.to(torch.bfloat16)"
            )
