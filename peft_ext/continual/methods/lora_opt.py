"""``lora_opt``: PEFT's LoRA with a choice of optimizer and initialization, the peers Riemannion is compared with:
the ``optimizer:`` section names any registered optimizer that steps parameters or LoRA factors
(:mod:`peft_ext.optim.choices`: ``adamw``, ``riemannian_precond`` - PEFT's ``create_riemannian_optimizer``, scaled GD
/ RPrecAdamW -, ``muon`` - ``torch.optim.Muon`` on the factors -, ``dct_adamw``, ...), and ``init: lora_ga`` is PEFT's
LoRA-GA. The head trains with AdamW at ``head_lr`` (default ``lr``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from ...optim.choices import OptimizerRequest, StepTogether, optimizer_spec
from .base import ContinualMethod, HeadRateOptions, LoraOptions, head_module_name, register_continual_method
from .riemannion import calibration_batches

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext

__all__ = ["LoraOpt", "LoraOptOptions", "StepTogether"]  # StepTogether: from peft_ext.optim.choices


@dataclass
class LoraOptOptions(LoraOptions, HeadRateOptions):
    """Options of ``lora_opt``.

    Args:
        optimizer: The factors' optimizer: a registered name (``adamw``, ``riemannian_precond``, ``muon``,
            ``dct_adamw``, ...) or a mapping with its ``name`` and options (``{name: riemannian_precond, reg: 0.01}``;
            Muon's learning rate is matched to AdamW's update RMS by default).
        init: ``default`` (PEFT's LoRA init, B = 0) or ``lora_ga`` (PEFT's LoRA-GA, on the first task's data).
        head_lr: AdamW learning rate of the head (default ``lr``).
        init_batches: Batches LoRA-GA estimates the gradient on.
    """

    method_owned: ClassVar[tuple[str, ...]] = ("modules_to_save", "init_lora_weights", "lora_ga_config")
    #: What the method hands its optimizer: the LoRA factors by name (the head trains by AdamW beside them).
    optimizer_steps: ClassVar[tuple[str, ...]] = ("parameters", "lora_factors")
    legacy_optimizer_keys: ClassVar[dict[str, str]] = {"precond_reg": "reg"}

    optimizer: str | dict[str, Any] = "adamw"
    init: Literal["default", "lora_ga"] = "default"
    init_batches: int = 4

    def validate(self) -> None:
        super().validate()
        if self.init not in ("default", "lora_ga"):
            raise ValueError(f"`init` must be 'default' or 'lora_ga', got {self.init!r}")
        if self.init_batches < 1:
            raise ValueError(f"`init_batches` must be a positive integer, got {self.init_batches}")


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
        names = {id(p): n for n, p in model.named_parameters()}
        is_factor = {id(p): ".lora_A." in names[id(p)] or ".lora_B." in names[id(p)] for p in params}
        choice, options = optimizer_spec(opts.optimizer)
        request = OptimizerRequest(
            model,
            [(names[id(p)], p) for p in params if is_factor[id(p)]],
            opts.lr,
            opts.weight_decay,
            others=[p for p in params if not is_factor[id(p)]],
            others_lr=opts.head_rate,
        )
        return choice.build(request, options)
