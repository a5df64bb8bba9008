"""``lora_opt``: PEFT's LoRA with a choice of optimizer and initialization, the peers Riemannion is compared with:
``optimizer: adamw``, ``riemannian_precond`` (PEFT's ``create_riemannian_optimizer``: scaled GD / RPrecAdamW),
``muon`` (``torch.optim.Muon`` on the LoRA factors), and ``init: lora_ga`` (PEFT's LoRA-GA). The head trains with
AdamW at ``head_lr`` (default ``lr``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from .base import ContinualMethod, LoraOptions, head_module_name, register_continual_method
from .riemannion import calibration_batches

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext

__all__ = ["LoraOpt", "LoraOptOptions", "StepTogether"]


@dataclass
class LoraOptOptions(LoraOptions):
    """Options of ``lora_opt``.

    Args:
        optimizer: ``adamw``, ``riemannian_precond`` (PEFT's ``create_riemannian_optimizer`` wrapping AdamW) or
            ``muon`` (``torch.optim.Muon`` on the 2-D LoRA factors, lr matched to AdamW's RMS).
        init: ``default`` (PEFT's LoRA init, B = 0) or ``lora_ga`` (PEFT's LoRA-GA, on the first task's data).
        head_lr: AdamW learning rate of the head (default ``lr``).
        precond_reg: Damping of PEFT's Riemannian preconditioner.
        init_batches: Batches LoRA-GA estimates the gradient on.
    """

    method_owned: ClassVar[tuple[str, ...]] = ("modules_to_save", "init_lora_weights", "lora_ga_config")

    optimizer: Literal["adamw", "riemannian_precond", "muon"] = "adamw"
    init: Literal["default", "lora_ga"] = "default"
    head_lr: float | None = None
    precond_reg: float = 1e-2
    init_batches: int = 4

    def validate(self) -> None:
        super().validate()
        if self.optimizer not in ("adamw", "riemannian_precond", "muon"):
            raise ValueError(f"`optimizer` must be adamw, riemannian_precond or muon, got {self.optimizer!r}")
        if self.init not in ("default", "lora_ga"):
            raise ValueError(f"`init` must be 'default' or 'lora_ga', got {self.init!r}")
        if self.head_lr is not None and not self.head_lr > 0:
            raise ValueError(f"`head_lr` must be > 0 (or unset), got {self.head_lr}")
        if not self.precond_reg >= 0:
            raise ValueError(f"`precond_reg` must be >= 0, got {self.precond_reg}")
        if self.init_batches < 1:
            raise ValueError(f"`init_batches` must be a positive integer, got {self.init_batches}")


class StepTogether(torch.optim.Optimizer):
    """Several optimizers stepped as one (their param groups are shared, so one LR scheduler drives them all).

    Args:
        optimizers: The optimizers, over disjoint parameters.
    """

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        super().__init__(params, {})
        self.optimizers = optimizers
        self.param_groups = [group for opt in optimizers for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


@register_continual_method
class LoraOpt(ContinualMethod):
    """PEFT's LoRA with AdamW, PEFT's Riemannian preconditioner, Muon on the factors, or the LoRA-GA init."""

    name = "lora_opt"
    options_cls = LoraOptOptions

    def _config(self, base_model: nn.Module):
        from peft import LoraGAConfig

        lora_ga = self.options.init == "lora_ga"
        extra = {"init_lora_weights": "lora_ga", "lora_ga_config": LoraGAConfig()} if lora_ga else {}
        return self.options.adapter_config(modules_to_save=[head_module_name(base_model)], **extra)

    @property
    def needs_whole_parameters(self) -> str | None:
        if self.options.optimizer == "riemannian_precond":
            return "PEFT's Riemannian preconditioner computes with whole factors"
        return None

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        from peft import get_peft_model

        if self.options.init == "lora_ga":
            return base_model  # wrapped in before_task, once the first task's data is known
        return get_peft_model(base_model, self._config(base_model))

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        from peft import get_peft_model, preprocess_loraga

        if self.options.init != "lora_ga" or task_id != 0:
            return model
        config = self._config(model)
        batches = calibration_batches(task, ctx, self.options.init_batches)

        def train_step() -> None:
            for batch in batches:
                ctx.task_loss(model, batch, task_id).backward()

        # LoRA-GA forms each target's full gradient and rewrites the base weights (W <- W - scaling * B A)
        preprocess_loraga(model, config, train_step)
        return get_peft_model(model, config).to(ctx.device)

    def make_optimizer(self, model: nn.Module, params: list[nn.Parameter], ctx: RunContext) -> torch.optim.Optimizer:
        opts = self.options
        head_lr = opts.head_lr if opts.head_lr is not None else opts.lr
        names = {id(p): n for n, p in model.named_parameters()}
        factor_ids = {id(p) for p in params if ".lora_A." in names[id(p)] or ".lora_B." in names[id(p)]}
        factors = [p for p in params if id(p) in factor_ids]
        others = [p for p in params if id(p) not in factor_ids]
        if opts.optimizer == "adamw":
            groups = [{"params": factors, "lr": opts.lr}, {"params": others, "lr": head_lr}]
            return torch.optim.AdamW(groups, weight_decay=opts.weight_decay)
        head = torch.optim.AdamW(others, lr=head_lr, weight_decay=opts.weight_decay)
        if opts.optimizer == "riemannian_precond":
            from peft.optimizers import create_riemannian_optimizer

            # PEFT's wrapper optimizes every trainable parameter at one lr; the head is hidden from it so that it
            # gets the same AdamW (head_lr) as in every other method. The preconditioner only touches LoRA pairs.
            for p in others:
                p.requires_grad_(False)
            try:
                precond = create_riemannian_optimizer(
                    model, torch.optim.AdamW, lr=opts.lr, reg=opts.precond_reg, weight_decay=opts.weight_decay
                )
            finally:
                for p in others:
                    p.requires_grad_(True)
            return StepTogether(precond, head)
        muon = torch.optim.Muon(factors, lr=opts.lr, weight_decay=opts.weight_decay, adjust_lr_fn="match_rms_adamw")
        return StepTogether(muon, head)
