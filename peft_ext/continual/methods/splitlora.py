"""``splitlora``: the SplitLoRA adapter type as a continual method. Per task, ``B`` trains on a frozen ``A`` drawn in
the minor subspace of the running input covariance of all earlier tasks; after the task its ``B A`` is folded into a
frozen delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from torch import nn

from ...tuners.splitlora import SplitLoRAConfig
from .base import AdapterOptions, ContinualMethod, register_continual_method, saved_head
from .covariance import run_forward

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext

__all__ = ["SplitLoRAMethod", "SplitLoRAOptions"]


@dataclass
class SplitLoRAOptions(AdapterOptions):
    """Options of the ``splitlora`` method.

    Args:
        adapter: The :class:`~peft_ext.SplitLoRAConfig` (``r``, ``trade_off``, ``target_modules``, ``statistics``,
            ...); YAML ``adapter: {r: 10, target_modules: [query, value]}``. The method sets ``modules_to_save``
            (the head) and ``seed`` (``train.seed``).
    """

    method_owned: ClassVar[tuple[str, ...]] = ("modules_to_save", "seed")

    adapter: SplitLoRAConfig = field(default_factory=SplitLoRAConfig)


@register_continual_method
class SplitLoRAMethod(ContinualMethod):
    """SplitLoRA: each task trains LoRA's B on a frozen A in the minor subspace of all earlier tasks' inputs."""

    name = "splitlora"
    options_cls = SplitLoRAOptions
    task_kinds = ("classification", "generation")
    rank_bounded_by_input_width = True

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        from peft import get_peft_model

        seed = ctx.train.seed if ctx is not None else 0
        config = self.options.adapter_config(seed=seed, modules_to_save=saved_head(base_model, ctx))
        return get_peft_model(base_model, config)

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        index = model.begin_task()
        if index != task_id:
            raise ValueError(f"the SplitLoRA adapter has finished {index} tasks but the runner starts task {task_id}")
        return model

    def after_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        # The paper collects the task's inputs with the trained model, after training (public code: get_cur_feat).
        with model.collect_statistics():
            run_forward(model, task.train, ctx)
        model.end_task()
        return model
