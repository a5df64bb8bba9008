"""Full fine-tuning with a choice of optimizer, so optimizers are compared by the same runner on the same tasks.

``full_ft`` trains every parameter of the backbone and the head. ``optimizer`` picks torch's AdamW, GaLore's
``GaLoreAdamW`` (the ``galore-torch`` package) or :class:`~peft_ext.optim.DCTAdamW`. Both low-rank optimizers project
the same matrices (2-D weights of the ``target_modules``, as selected by
:func:`~peft_ext.optim.dct_adamw.matches_target`) at the same ``rank``; every other parameter gets AdamW inside the
same optimizer, so the comparison isolates the projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from ...optim.dct_adamw import DCTAdamW, matches_target
from .base import ContinualMethod, MethodOptions, register_continual_method

if TYPE_CHECKING:
    from ..context import RunContext

OPTIMIZER_CHOICES = ("adamw", "galore_adamw", "dct_adamw")
#: Each optimizer's own default refresh interval, used when ``update_proj_gap`` is left unset: GaLore's README
#: recommends 200 (pre-training; 500 for GLUE), the DCT-AdamW paper refreshes every step.
DEFAULT_PROJ_GAP = {"galore_adamw": 200, "dct_adamw": 1}
#: Matrices with a dimension at least this large (embeddings, LM heads) are never projected, by either optimizer.
MAX_SHAPE = 32_000


@dataclass
class FullFineTuneOptions(MethodOptions):
    """Options of ``full_ft``.

    Args:
        optimizer: ``adamw`` (torch), ``galore_adamw`` (galore-torch, needs ``pip install galore-torch``) or
            ``dct_adamw``.
        rank: Projection rank of ``galore_adamw`` and ``dct_adamw`` (ignored by ``adamw``).
        update_proj_gap: Steps between subspace refreshes; unset: the optimizer's own default (GaLore 200, DCT 1).
        scale: Multiplier on the projected matrices' update, for both low-rank optimizers (GaLore's ``scale``; the
            same argument of :class:`~peft_ext.optim.DCTAdamW`). GaLore's README: 0.25 for pre-training, 4 for GLUE
            fine-tuning at rank 4-8. Ignored by ``adamw``.
        target_modules: Modules whose 2-D weights are projected, matched as whole dotted name components
            (MiniLM/BERT: ``query``, ``key``, ``value``, ``dense``). The rest get AdamW.
        betas: Adam's ``(beta1, beta2)`` for every optimizer.
        eps: Adam's epsilon for every optimizer (GaLore's own default is 1e-6; one value keeps runs comparable).
        error_feedback: DCT-AdamW only: keep the projection residual and add it to the next gradient.
        rotate_moments: DCT-AdamW only: carry moments over when the selected columns change.
        moments_8bit: DCT-AdamW only: 8-bit blockwise-quantized moments.
        dct_method: DCT-AdamW only: ``auto``, ``matmul`` or ``fft``.
    """

    optimizer: Literal["adamw", "galore_adamw", "dct_adamw"] = "adamw"
    rank: int = 8
    update_proj_gap: int | None = None
    scale: float = 1.0
    target_modules: list[str] = field(default_factory=lambda: ["query", "key", "value", "dense"])
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    error_feedback: bool = False
    rotate_moments: bool = True
    moments_8bit: bool = False
    dct_method: Literal["auto", "matmul", "fft"] = "auto"

    def validate(self) -> None:
        super().validate()
        if self.optimizer not in OPTIMIZER_CHOICES:
            raise ValueError(f"`optimizer` must be one of {OPTIMIZER_CHOICES}, got {self.optimizer!r}")
        if self.rank < 1:
            raise ValueError(f"`rank` must be a positive integer, got {self.rank}")
        if self.update_proj_gap is not None and self.update_proj_gap < 1:
            raise ValueError(f"`update_proj_gap` must be a positive integer (or unset), got {self.update_proj_gap}")
        if not self.scale > 0:
            raise ValueError(f"`scale` must be > 0, got {self.scale}")
        if not self.target_modules:
            raise ValueError("`target_modules` must name at least one module, got an empty list")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"`betas` must be two numbers in [0, 1), got {self.betas}")
        if not self.eps >= 0:
            raise ValueError(f"`eps` must be >= 0, got {self.eps}")
        if self.dct_method not in ("auto", "matmul", "fft"):
            raise ValueError(f"`dct_method` must be one of ['auto', 'matmul', 'fft'], got {self.dct_method!r}")


def named_trainable(model: nn.Module, params: list[nn.Parameter]) -> list[tuple[str, nn.Parameter]]:
    """``params`` paired with their names in ``model``, in the given order."""
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [tuple(p.shape) for p in params if id(p) not in names]
    if missing:
        raise ValueError(f"{len(missing)} trainable parameters (shapes {missing[:3]}) are not parameters of the model")
    return [(names[id(p)], p) for p in params]


def is_projected(name: str, p: torch.Tensor, target_modules: list[str]) -> bool:
    """Whether ``full_ft`` projects parameter ``name``: a 2-D weight below :data:`MAX_SHAPE` in ``target_modules``."""
    module = name.rsplit(".", 1)[0]
    return p.ndim == 2 and max(p.shape) < MAX_SHAPE and matches_target(module, target_modules)


@register_continual_method
class FullFineTune(ContinualMethod):
    """Full fine-tuning with AdamW, GaLore-AdamW or DCT-AdamW (compare optimizers on the same tasks)."""

    name = "full_ft"
    options_cls = FullFineTuneOptions

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        return base_model.requires_grad_(True)

    def make_optimizer(self, model: nn.Module, params: list[nn.Parameter], ctx: RunContext) -> torch.optim.Optimizer:
        opts: FullFineTuneOptions = self.options  # type: ignore[assignment]
        betas = (float(opts.betas[0]), float(opts.betas[1]))
        common = {"lr": opts.lr, "betas": betas, "eps": opts.eps, "weight_decay": opts.weight_decay}
        if opts.optimizer == "adamw":
            return torch.optim.AdamW(params, **common)
        named = named_trainable(model, params)
        gap = opts.update_proj_gap or DEFAULT_PROJ_GAP[opts.optimizer]
        if opts.optimizer == "dct_adamw":
            return DCTAdamW(
                named,
                rank=opts.rank,
                update_proj_gap=gap,
                scale=opts.scale,
                target_modules=list(opts.target_modules),
                max_shape=MAX_SHAPE,
                error_feedback=opts.error_feedback,
                rotate_moments=opts.rotate_moments,
                moments_8bit=opts.moments_8bit,
                dct_method=opts.dct_method,
                **common,
            )
        try:
            from galore_torch import GaLoreAdamW
        except ImportError as err:
            raise ImportError(
                "optimizer 'galore_adamw' needs the galore-torch package: `pip install galore-torch` "
                "(or `pip install 'peft-ext[dev]'`)"
            ) from err
        projected = [p for n, p in named if is_projected(n, p, opts.target_modules)]
        rest = [p for n, p in named if not is_projected(n, p, opts.target_modules)]
        groups = [{"params": rest}] if rest else []
        if projected:
            groups.append(
                {
                    "params": projected,
                    "rank": opts.rank,
                    "update_proj_gap": gap,
                    "scale": opts.scale,
                    "proj_type": "std",
                }
            )
        return GaLoreAdamW(groups, no_deprecation_warning=True, **common)
