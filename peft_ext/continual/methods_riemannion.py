"""Riemannion and its peers as method plugins, so they are compared by the same runner on the same tasks.

- ``riemannion``: the Riemannion adapter (docs/methods.md (Riemannion)) trained by :class:`~peft_ext.optim.Riemannion`
  (``variant: muon``) or :class:`~peft_ext.optim.RiemannLoRA` (``variant: sgd``), started at a random point or at the
  LOI point (``init: loi``, computed on the first task's data before it is trained).
- ``lora_opt``: PEFT's LoRA with a choice of optimizer and initialization, the peers the paper compares against:
  ``optimizer: adamw``, ``riemannian_precond`` (PEFT's ``create_riemannian_optimizer``: scaled GD / RPrecAdamW),
  ``muon`` (``torch.optim.Muon`` on the LoRA factors), and ``init: lora_ga`` (PEFT's LoRA-GA).

In every method the classification head is a ``modules_to_save`` copy trained by AdamW at ``head_lr`` (default
``lr``), so the comparison isolates what happens to the adapters.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from ..optim.riemannion import create_riemannion_optimizer
from ..tuners.riemannion import RiemannionConfig, initialize_loi
from .methods import AdapterOptions, ContinualMethod, LoraOptions, head_module_name, register_continual_method

if TYPE_CHECKING:
    from ..data.tasks import Task
    from .context import RunContext


@dataclass
class RiemannionOptions(AdapterOptions):
    """Options of ``riemannion``.

    Args:
        adapter: The :class:`~peft_ext.RiemannionConfig` (``r``, ``target_modules``, ``init_scale``,
            ``riemannion_dropout``, ...); YAML ``adapter: {r: 16, target_modules: [query, value]}``. The method sets
            ``modules_to_save`` (the head).
        init: ``loi`` (gradient-informed, on the first task) or ``random``.
        variant: ``muon`` (Riemannion: orthogonalized steps, ``lr`` in spectral-norm units) or ``sgd``
            (RiemannLoRA: Riemannian gradient steps, ``lr`` in Frobenius units).
        momentum: Momentum coefficient.
        nesterov: Nesterov momentum.
        head_lr: AdamW learning rate of the head (default ``lr``).
        loi_batches: Calibration batches (of ``train.batch_size``) for LOI.
        loi_oversampling: LOI's extra random probes.
        loi_power_iters: LOI's power iterations.
    """

    legacy_names: ClassVar[dict[str, str]] = {"dropout": "riemannion_dropout"}

    adapter: RiemannionConfig = field(default_factory=RiemannionConfig)
    init: Literal["loi", "random"] = "loi"
    variant: Literal["muon", "sgd"] = "muon"
    momentum: float = 0.9
    nesterov: bool = False
    head_lr: float | None = None
    loi_batches: int = 4
    loi_oversampling: int = 16
    loi_power_iters: int = 1

    def validate(self) -> None:
        super().validate()
        if self.init not in ("loi", "random"):
            raise ValueError(f"`init` must be 'loi' or 'random', got {self.init!r}")
        if self.variant not in ("muon", "sgd"):
            raise ValueError(f"`variant` must be 'muon' or 'sgd', got {self.variant!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"`momentum` must be in [0, 1), got {self.momentum}")
        if self.head_lr is not None and not self.head_lr > 0:
            raise ValueError(f"`head_lr` must be > 0 (or unset), got {self.head_lr}")
        for key in ("loi_batches",):
            if getattr(self, key) < 1:
                raise ValueError(f"`{key}` must be a positive integer, got {getattr(self, key)}")
        for key in ("loi_oversampling", "loi_power_iters"):
            if getattr(self, key) < 0:
                raise ValueError(f"`{key}` must be >= 0, got {getattr(self, key)}")


def calibration_batches(task: Task, ctx: RunContext, n: int) -> list[dict[str, Any]]:
    """The first ``n`` training batches of ``task`` in a seeded order, collated and on the run's device.

    Args:
        task: The task whose training data is used.
        ctx: The run context.
        n: Number of batches.
    """
    rng = random.Random(f"calibration:{ctx.train.seed}")
    return list(ctx.iter_batches(task.train, rng=rng, limit=n))


@register_continual_method
class RiemannionMethod(ContinualMethod):
    """Riemannion: LoRA on the fixed-rank manifold, Muon-style steps, LOI or random start."""

    name = "riemannion"
    options_cls = RiemannionOptions

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        from peft import get_peft_model

        config = self.options.adapter_config(modules_to_save=[head_module_name(base_model)])
        return get_peft_model(base_model, config)

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        # LOI picks the start point; later tasks continue from where the previous one ended
        if self.options.init == "loi" and task_id == 0:
            result = initialize_loi(
                model,
                calibration_batches(task, ctx, self.options.loi_batches),
                loss_fn=lambda m, batch: ctx.task_loss(m, batch, task_id),
                oversampling=self.options.loi_oversampling,
                power_iters=self.options.loi_power_iters,
                seed=ctx.train.seed,
            )
            ctx.state["loi_seconds"] = result.seconds
        return model

    def make_optimizer(self, model: nn.Module, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        opts = self.options
        return create_riemannion_optimizer(
            model,
            lr=opts.lr,
            variant=opts.variant,
            momentum=opts.momentum,
            nesterov=opts.nesterov,
            weight_decay=opts.weight_decay,
            aux_lr=opts.head_lr if opts.head_lr is not None else opts.lr,
            aux_weight_decay=opts.weight_decay,
        )


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

    def make_optimizer(self, model: nn.Module, params: list[nn.Parameter]) -> torch.optim.Optimizer:
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
