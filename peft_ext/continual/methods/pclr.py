"""PCLR as a continual-learning method plugin: the rank pool with keyed routing and its task cycle.

Per task (docs/methods.md (PCLR); docs/task_cycle.md): before training, the task's query prototype is computed from
its training inputs and ``PCLRModel.begin_task`` adds the task's trainable ranks; training optimizes the new ranks,
their keys (through the query loss, added by :meth:`PCLRMethod.extra_loss`) and the classification head; after
training, ``PCLRModel.end_task`` stores the prototype, compresses and integrates as scheduled, and freezes the
ranks. Evaluation runs without a task id (prototype routing decides).

On a generation sequence (instruction tasks on a causal LM) the query is the prompt's
(:func:`~peft_ext.continual.generation.prompt_query`), so training, the prototype, the distillation and generation
route an instruction alike, and the distillation matches the teacher's next-token distributions on the answer
tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...tuners.pclr import PCLRConfig, PCLRCycleConfig
from ..generation import answer_logits, prompt_query, require_causal_collate
from ..task_kinds import task_kind
from .base import AdapterOptions, ContinualMethod, nest_into_section, register_continual_method, saved_head

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext

__all__ = ["PCLRMethod", "PCLROptions"]


@dataclass
class PCLROptions(AdapterOptions):
    """Options of the ``pclr`` method: the adapter's :class:`~peft_ext.PCLRConfig`, the task cycle's
    :class:`~peft_ext.tuners.pclr.PCLRCycleConfig`, and what the method itself decides.

    Args:
        adapter: The PCLR adapter (pool size, schedules, ``top_k``, ``alpha``, shared LoRA, targets, ...); YAML
            ``adapter: {pool_size: 64, ...}``. The method sets ``modules_to_save`` (the head).
        cycle: The task cycle's settings (distillation epochs / lr / routing / temperature, key noise, key pull);
            YAML ``cycle: {integrate_epochs: 1, integrate_routing: input}``. With ``integrate_routing: input`` the
            distillation keeps the current task's logits; with ``tasks`` (public code) the logits of every class
            seen so far. On WordNet (benchmarks/continual_wordnet.py, 3 seeds) ``input`` kept more accuracy (39.9
            vs 36.3 final) at the same forgetting.
        train_shared: Also train the shared LoRA while learning each task (default: only during integration).
    """

    adapter: PCLRConfig = field(default_factory=PCLRConfig)
    cycle: PCLRCycleConfig = field(default_factory=PCLRCycleConfig)
    train_shared: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.cycle, dict):
            self.cycle = PCLRCycleConfig(**self.cycle)

    @classmethod
    def nest_flat_keys(cls, data: dict[str, Any], where: str = "") -> dict[str, Any]:
        """As :meth:`AdapterOptions.nest_flat_keys`; old flat cycle keys (``integrate_epochs``) move into ``cycle``."""
        data = super().nest_flat_keys(data, where)
        cycle_keys = {f.name for f in dataclasses.fields(PCLRCycleConfig)}
        moved = {key: key for key in data if key in cycle_keys}
        return nest_into_section(data, moved, "cycle", where) if moved else data


def _answer_forward(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The logits that predict a causal-LM batch's answer tokens, (answer tokens, vocab): the distillation's output."""
    out = model(**{k: v for k, v in batch.items() if k != "labels"})
    return answer_logits(getattr(out, "logits", out), batch["labels"])[0]


@register_continual_method
class PCLRMethod(ContinualMethod):
    """PCLR: a capped LoRA rank pool, per-sample keyed routing, compress - integrate - learn per task."""

    name = "pclr"
    options_cls = PCLROptions
    task_kinds = ("classification", "generation")

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        from peft import get_peft_model

        model = get_peft_model(base_model, self.options.adapter_config(modules_to_save=saved_head(base_model, ctx)))
        if task_kind(ctx.sequence).causal:
            model.base_model.set_query_fn(prompt_query(require_causal_collate(ctx.collate).separator_id))
        self.state["pclr_pool"] = []
        self.state["pclr_adapter_params"] = []
        self.state["pclr_integrate"] = []
        self.state["pclr_generator"] = torch.Generator().manual_seed(ctx.train.seed)
        return model

    def _task_batches(self, task: Task, ctx: RunContext) -> list[dict[str, Any]]:
        return list(ctx.iter_batches(task.train))

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        prototype = model.query_prototype(self._task_batches(task, ctx))
        self.state["pclr_prototype"] = prototype
        model.begin_task(task_id, prototype, cycle=self.options.cycle)  # the cycle's key_noise
        return model

    def trainable_parameters(self, model: nn.Module, ctx: RunContext) -> list[nn.Parameter]:
        learnt = ("pclr_A.", "pclr_B.", "pclr_keys.", "modules_to_save.")
        params = []
        for name, p in model.named_parameters():
            trains = any(part in name for part in learnt) or (self.options.train_shared and "pclr_shared_" in name)
            # the shared LoRA trains only as part of the integration student unless train_shared is set
            p.requires_grad_(trains)
            if trains:
                params.append(p)
        return params

    def extra_loss(
        self, model: nn.Module, batch: dict[str, Any], task_id: int, ctx: RunContext
    ) -> torch.Tensor | None:
        from ...tuners.pclr import query_loss

        return query_loss(model)

    def after_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        from ...tuners.pclr import pool_in_use, stored_adapter_parameters

        opts = self.options
        mask: torch.Tensor | None = torch.zeros(ctx.sequence.num_classes, dtype=torch.bool, device=ctx.device)
        forward = None
        if task_kind(ctx.sequence).causal:
            # distill the next-token distributions where the task is scored (the answer tokens), over the vocabulary
            mask, forward = None, _answer_forward
        elif opts.cycle.integrate_routing == "tasks":
            # routed as an old task, the teacher's outputs on the old classes are what must be kept
            for seen in ctx.sequence.tasks[: task_id + 1]:
                mask[list(seen.classes)] = True
        else:
            mask[list(task.classes)] = True
        result = model.end_task(
            task_id,
            self.state.pop("pclr_prototype"),
            self._task_batches(task, ctx),
            cycle=opts.cycle,
            forward=forward,
            mask=mask,
            generator=self.state["pclr_generator"],
        )
        self.state["pclr_pool"].append(pool_in_use(model))
        self.state["pclr_adapter_params"].append(stored_adapter_parameters(model))
        self.state["pclr_integrate"].append(None if result is None else (result.kl_before, result.kl_after))
        return model

    def report(self, ctx: RunContext) -> dict[str, Any]:
        """Pool ranks and adapter values in use after each task, and the distillation loss before/after each one."""
        return {
            "pool_ranks": list(self.state.get("pclr_pool", [])),
            "adapter_params": list(self.state.get("pclr_adapter_params", [])),
            "integrate_kl": [None if kl is None else list(kl) for kl in self.state.get("pclr_integrate", [])],
        }
