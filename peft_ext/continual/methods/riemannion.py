"""``riemannion``: the Riemannion adapter trained by :class:`~peft_ext.optim.Riemannion` (``optimizer: riemannion``)
or :class:`~peft_ext.optim.RiemannLoRA` (``optimizer: riemannlora``), started at a random point or at the LOI point
(``init: loi``, computed on the first task's data before it is trained). The classification head is a
``modules_to_save`` copy trained by AdamW at ``head_lr`` (default ``lr``), as in ``lora_opt``, so a comparison
isolates the adapters."""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from ...optim.choices import OptimizerRequest, optimizer_spec
from ...tuners.riemannion import RiemannionConfig, initialize_loi
from .base import ContinualMethod, HeadRateOptions, head_module_name, register_continual_method

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext

__all__ = ["RiemannionMethod", "RiemannionOptions", "calibration_batches"]


@dataclass
class RiemannionOptions(HeadRateOptions):
    """Options of ``riemannion``.

    Args:
        adapter: The :class:`~peft_ext.RiemannionConfig` (``r``, ``target_modules``, ``init_scale``,
            ``riemannion_dropout``, ...); YAML ``adapter: {r: 16, target_modules: [query, value]}``. The method sets
            ``modules_to_save`` (the head).
        init: ``loi`` (gradient-informed, on the first task) or ``random``.
        optimizer: ``riemannion`` (orthogonalized steps, ``lr`` in spectral-norm units) or ``riemannlora``
            (Riemannian gradient steps, ``lr`` in Frobenius units), by name or as a mapping with options
            (``{name: riemannion, momentum: 0.9, nesterov: true}``).
        head_lr: AdamW learning rate of the head (default ``lr``).
        loi_batches: Calibration batches (of ``train.batch_size``) for LOI.
        loi_oversampling: LOI's extra random probes.
        loi_power_iters: LOI's power iterations.
    """

    legacy_names: ClassVar[dict[str, str]] = {"dropout": "riemannion_dropout"}
    #: What the method hands its optimizer: the model's fixed-rank adapters (the head trains by AdamW beside them).
    optimizer_steps: ClassVar[tuple[str, ...]] = ("fixed_rank_adapters",)
    legacy_optimizer_keys: ClassVar[dict[str, str]] = {"momentum": "momentum", "nesterov": "nesterov"}
    #: The old ``variant`` option's values, now optimizer names.
    legacy_variants: ClassVar[dict[str, str]] = {"muon": "riemannion", "sgd": "riemannlora"}

    adapter: RiemannionConfig = field(default_factory=RiemannionConfig)
    init: Literal["loi", "random"] = "loi"
    optimizer: str | dict[str, Any] = "riemannion"
    loi_batches: int = 4
    loi_oversampling: int = 16
    loi_power_iters: int = 1

    @classmethod
    def nest_flat_keys(cls, data: dict[str, Any], where: str = "") -> dict[str, Any]:
        if "variant" in data:  # the old `variant: muon | sgd` names the optimizer
            data = dict(data)
            variant = data.pop("variant")
            if variant not in cls.legacy_variants:
                raise ValueError(f"`{where}variant` must be 'muon' or 'sgd', got {variant!r}")
            name = cls.legacy_variants[variant]
            given = data.get("optimizer")
            data["optimizer"] = name if given is None else given
            warnings.warn(
                f"`{where}variant: {variant}` is now `{where}optimizer: {name}` (`variant` will stop working)",
                DeprecationWarning,
                stacklevel=3,
            )
        return super().nest_flat_keys(data, where)

    def validate(self) -> None:
        super().validate()
        if self.init not in ("loi", "random"):
            raise ValueError(f"`init` must be 'loi' or 'random', got {self.init!r}")
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
            self.state["loi_seconds"] = result.seconds
        return model

    def make_optimizer(self, model: nn.Module, params: list[nn.Parameter], ctx: RunContext) -> torch.optim.Optimizer:
        opts = self.options
        choice, options = optimizer_spec(opts.optimizer)
        # the optimizer finds the adapters in the model; every other trainable parameter (the head) gets its AdamW
        request = OptimizerRequest(model, [], opts.lr, opts.weight_decay, others_lr=opts.head_rate)
        return choice.build(request, options)
