"""Optimizers shipped by peft-ext. ``OPTIMIZERS`` maps a config name to the optimizer class; ``REGISTRY`` holds
SubspaceAdamW's bases and update rules by kind and name."""

from __future__ import annotations

from torch.optim import Optimizer

from .bases import CoordinateBasis, DCTBasis, PowerBasis, SubspaceBasis
from .components import REGISTRY, register
from .dct_adamw import DCTAdamW
from .nonfinite import NonFiniteGradientError
from .riemannion import Riemannion, RiemannLoRA, create_riemannion_optimizer
from .subspace_adamw import SubspaceAdamW
from .update_rules import ChannelUpdate, ProjectedUpdate, UpdateRule

__all__ = [
    "OPTIMIZERS",
    "REGISTRY",
    "ChannelUpdate",
    "CoordinateBasis",
    "DCTAdamW",
    "DCTBasis",
    "NonFiniteGradientError",
    "PowerBasis",
    "ProjectedUpdate",
    "RiemannLoRA",
    "Riemannion",
    "SubspaceAdamW",
    "SubspaceBasis",
    "UpdateRule",
    "create_riemannion_optimizer",
    "register",
]

OPTIMIZERS: dict[str, type[Optimizer]] = {
    "dct_adamw": DCTAdamW,
    "riemannion": Riemannion,
    "riemannlora": RiemannLoRA,
    "subspace_adamw": SubspaceAdamW,
}
