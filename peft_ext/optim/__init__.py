"""Optimizers shipped by peft-ext. ``OPTIMIZERS`` maps a config name to the optimizer class."""

from __future__ import annotations

from torch.optim import Optimizer

from .dct_adamw import DCTAdamW, SubspaceAdamW
from .riemannion import Riemannion, RiemannLoRA, create_riemannion_optimizer

__all__ = [
    "OPTIMIZERS",
    "DCTAdamW",
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
