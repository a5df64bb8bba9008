"""Full fine-tuning with a choice of optimizer, so optimizers are compared by the same runner on the same tasks.

``full_ft`` trains every parameter of the backbone and the head with the optimizer its ``optimizer:`` section names
(any registered one that steps plain parameters: ``adamw``, ``galore_adamw``, ``dct_adamw``, ``subspace_adamw``;
:mod:`peft_ext.optim.choices`), with that optimizer's own options and defaults::

    - name: full_ft
      lr: 1.0e-4
      optimizer: {name: dct_adamw, rank: 8, scale: 4.0, target_modules: [query, key, value, dense]}

The low-rank optimizers project the 2-D weights of their ``target_modules`` (every 2-D weight below ``max_shape``
when unset) and give every other parameter AdamW inside the same optimizer, so a comparison isolates the projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ...optim.choices import OptimizerRequest, named_trainable, optimizer_spec
from .base import ContinualMethod, MethodOptions, register_continual_method

if TYPE_CHECKING:
    from ..context import RunContext

__all__ = ["FullFineTune", "FullFineTuneOptions", "named_trainable"]


@dataclass
class FullFineTuneOptions(MethodOptions):
    """Options of ``full_ft``.

    Args:
        optimizer: The optimizer: a registered name (``adamw``, ``galore_adamw``, ``dct_adamw``,
            ``subspace_adamw``) or a mapping with its ``name`` and options (``{name: dct_adamw, rank: 8}``), each
            option validated by the optimizer itself. ``lr`` and ``weight_decay`` are the method's.
    """

    #: What the method hands its optimizer: every parameter, by name.
    optimizer_steps: ClassVar[tuple[str, ...]] = ("parameters",)
    #: Old flat options, now keys of the ``optimizer`` section.
    legacy_optimizer_keys: ClassVar[dict[str, str]] = {
        key: key
        for key in (
            "rank",
            "update_proj_gap",
            "scale",
            "target_modules",
            "betas",
            "eps",
            "error_feedback",
            "rotate_moments",
            "moments_8bit",
            "dct_method",
        )
    }

    optimizer: str | dict[str, Any] = "adamw"


@register_continual_method
class FullFineTune(ContinualMethod):
    """Full fine-tuning with any registered optimizer that steps parameters (compare optimizers on the same tasks)."""

    name = "full_ft"
    options_cls = FullFineTuneOptions

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        return base_model.requires_grad_(True)

    def make_optimizer(self, model: nn.Module, params: list[nn.Parameter], ctx: RunContext) -> torch.optim.Optimizer:
        opts: FullFineTuneOptions = self.options  # type: ignore[assignment]
        choice, options = optimizer_spec(opts.optimizer)
        request = OptimizerRequest(model, named_trainable(model, params), opts.lr, opts.weight_decay)
        return choice.build(request, options)
