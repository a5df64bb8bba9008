"""Optimizers shipped by peft-ext. ``OPTIMIZERS`` maps a config name to the optimizer class."""

from __future__ import annotations

from torch.optim import Optimizer

from .dct_adamw import DCTAdamW
from .nonfinite import NonFiniteGradientError
from .riemannion import Riemannion, RiemannLoRA, create_riemannion_optimizer
from .subspace_adamw import SubspaceAdamW

__all__ = [
    "OPTIMIZERS",
    "DCTAdamW",
    "NonFiniteGradientError",
    "RiemannLoRA",
    "Riemannion",
    "SubspaceAdamW",
    "create_riemannion_optimizer",
]

OPTIMIZERS: dict[str, type[Optimizer]] = {
    "dct_adamw": DCTAdamW,
    "riemannion": Riemannion,
    "riemannlora": RiemannLoRA,
    "subspace_adamw": SubspaceAdamW,
}
