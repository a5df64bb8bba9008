"""PCLR as a continual-learning method plugin: the rank pool with keyed routing and its task cycle.

Per task (METHODS.md section 3; :mod:`peft_ext.tuners.pclr.cycle`): before training, the task's query prototype is
computed from its training inputs and :func:`~peft_ext.tuners.pclr.begin_task` adds the task's trainable ranks;
training optimizes the new ranks, their keys (through the query loss, added by :meth:`PCLRMethod.extra_loss`) and the
classification head; after training, :func:`~peft_ext.tuners.pclr.end_task` stores the prototype, compresses and
integrates as scheduled, and freezes the ranks. Evaluation runs without a task id (prototype routing decides).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..tuners.pclr import INTEGRATE_ROUTING, PCLRConfig
from .methods import AdapterOptions, ContinualMethod, head_module_name, register_continual_method

if TYPE_CHECKING:
    from ..data.tasks import Task
    from .context import RunContext

__all__ = ["PCLRMethod", "PCLROptions"]


@dataclass
class PCLROptions(AdapterOptions):
    """Options of the ``pclr`` method: the task cycle's own settings and the adapter's :class:`~peft_ext.PCLRConfig`.

    Args:
        adapter: The PCLR adapter (pool size, schedules, ``top_k``, ``alpha``, shared LoRA, targets, ...); YAML
            ``adapter: {pool_size: 64, ...}``. The method sets ``modules_to_save`` (the head).
        train_shared: Also train the shared LoRA while learning each task (default: only during integration).
        integrate_epochs: Distillation passes over the task's data after compression (0: no integration).
        integrate_routing: ``"input"`` (default: each sample routed by its own query; the current task's logits)
            or ``"tasks"`` (public code: each distillation batch routed as one stored task, drawn with probability
            proportional to ``sqrt`` of its last distillation loss; the logits of every class seen so far). On
            WordNet (benchmarks/continual_wordnet.py, 3 seeds) ``"input"`` kept more accuracy (39.9 vs 36.3 final)
            at the same forgetting.
        integrate_lr: Distillation learning rate.
        temperature: Distillation temperature.
        key_pull_threshold: Cosine above which a key counts as close to a task prototype.
        key_pull_strength: How far keys close to several prototypes move toward them.
    """

    adapter: PCLRConfig = field(default_factory=PCLRConfig)
    train_shared: bool = False
    integrate_epochs: int = 1
    integrate_routing: str = "input"
    integrate_lr: float = 1e-3
    temperature: float = 2.0
    key_pull_threshold: float = 0.8
    key_pull_strength: float = 0.5

    def validate(self) -> None:
        super().validate()
        if self.integrate_epochs < 0:
            raise ValueError(f"`integrate_epochs` must be >= 0, got {self.integrate_epochs}")
        if not self.integrate_lr > 0:
            raise ValueError(f"`integrate_lr` must be > 0, got {self.integrate_lr}")
        if self.integrate_routing not in INTEGRATE_ROUTING:
            raise ValueError(f"`integrate_routing` must be one of {INTEGRATE_ROUTING}, got {self.integrate_routing!r}")


@register_continual_method
class PCLRMethod(ContinualMethod):
    """PCLR: a capped LoRA rank pool, per-sample keyed routing, compress - integrate - learn per task."""

    name = "pclr"
    options_cls = PCLROptions

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        from peft import get_peft_model

        model = get_peft_model(base_model, self.options.adapter_config(modules_to_save=[head_module_name(base_model)]))
        ctx.state["pclr_pool"] = []
        ctx.state["pclr_adapter_params"] = []
        ctx.state["pclr_integrate"] = []
        ctx.state["pclr_generator"] = torch.Generator().manual_seed(ctx.train.seed)
        return model

    def _task_batches(self, task: Task, ctx: RunContext) -> list[dict[str, Any]]:
        return list(ctx.iter_batches(task.train))

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        prototype = model.query_prototype(self._task_batches(task, ctx))
        ctx.state["pclr_prototype"] = prototype
        model.begin_task(task_id, prototype)
        return model

    def trainable_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        learnt = ("pclr_A.", "pclr_B.", "pclr_keys.", "modules_to_save.")
        params = []
        for name, p in model.named_parameters():
            trains = any(part in name for part in learnt) or (self.options.train_shared and "pclr_shared_" in name)
            # the shared LoRA trains only as part of the integration student unless train_shared is set
            p.requires_grad_(trains)
            if trains:
                params.append(p)
        return params

    def extra_loss(self, model: nn.Module, batch: dict[str, Any], task_id: int) -> torch.Tensor | None:
        from ..tuners.pclr import query_loss

        return query_loss(model)

    def after_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        from ..tuners.pclr import PCLRCycleConfig, pool_in_use, stored_adapter_parameters

        opts = self.options
        mask = torch.zeros(ctx.sequence.num_classes, dtype=torch.bool, device=ctx.device)
        if opts.integrate_routing == "tasks":
            # routed as an old task, the teacher's outputs on the old classes are what must be kept
            for seen in ctx.sequence.tasks[: task_id + 1]:
                mask[list(seen.classes)] = True
        else:
            mask[list(task.classes)] = True
        cycle = PCLRCycleConfig(
            integrate_epochs=opts.integrate_epochs,
            integrate_lr=opts.integrate_lr,
            integrate_routing=opts.integrate_routing,
            temperature=opts.temperature,
            key_pull_threshold=opts.key_pull_threshold,
            key_pull_strength=opts.key_pull_strength,
        )
        result = model.end_task(
            task_id,
            ctx.state.pop("pclr_prototype"),
            self._task_batches(task, ctx),
            cycle=cycle,
            mask=mask,
            generator=ctx.state["pclr_generator"],
        )
        ctx.state["pclr_pool"].append(pool_in_use(model))
        ctx.state["pclr_adapter_params"].append(stored_adapter_parameters(model))
        ctx.state["pclr_integrate"].append(None if result is None else (result.kl_before, result.kl_after))
        return model

    def report(self, ctx: RunContext) -> dict[str, Any]:
        """Pool ranks and adapter values in use after each task, and the distillation loss before/after each one."""
        return {
            "pool_ranks": list(ctx.state.get("pclr_pool", [])),
            "adapter_params": list(ctx.state.get("pclr_adapter_params", [])),
            "integrate_kl": [None if kl is None else list(kl) for kl in ctx.state.get("pclr_integrate", [])],
        }
