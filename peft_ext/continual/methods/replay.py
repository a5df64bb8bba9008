"""``replay``: sequential LoRA that trains each task on its data plus a small memory of earlier tasks' examples, the
standard baseline of continual instruction tuning (experience replay with a task-balanced buffer).

The memory holds at most ``memory_size`` training examples over all finished tasks, split evenly between them: when a
task finishes, each earlier task's share shrinks to make room, keeping a prefix of that task's seeded random order,
so what stays is still a uniform sample of the task. It is kept as indices into the tasks' training sets, saved with
the method's state (a resumed run replays the same examples).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import LoraOptions, register_continual_method
from .lora import LoraMethod

if TYPE_CHECKING:
    from torch import nn

    from ...data.tasks import Example, Task
    from ..context import RunContext

__all__ = ["ReplayLoRA", "ReplayOptions", "memory_shares"]


@dataclass
class ReplayOptions(LoraOptions):
    """Options of the replay baseline: LoRA's, plus the memory's size.

    Args:
        memory_size: Examples of earlier tasks kept, over all of them (split evenly; the earliest tasks get the
            remainder). Each later task trains on its own data plus the whole memory.
    """

    memory_size: int = 32

    def validate(self) -> None:
        super().validate()
        if isinstance(self.memory_size, bool) or not isinstance(self.memory_size, int) or self.memory_size < 1:
            raise ValueError(f"`memory_size` must be a positive integer, got {self.memory_size!r}")


def memory_shares(memory_size: int, finished: int) -> list[int]:
    """How many examples each of ``finished`` tasks keeps in a memory of ``memory_size``: an even split, the first
    ``memory_size % finished`` tasks one more."""
    if finished < 1:
        return []
    base, extra = divmod(memory_size, finished)
    return [base + (1 if t < extra else 0) for t in range(finished)]


@register_continual_method
class ReplayLoRA(LoraMethod):
    """LoRA task after task, each task trained on its data plus a task-balanced memory of earlier tasks' examples.

    Instruction sequences only: a classification run trains each task on its own classes' logits (the task mask),
    which an old class's example would fall outside of.
    """

    name = "replay"
    options_cls = ReplayOptions
    task_kinds = ("generation",)

    def _orders(self) -> list[list[int]]:
        return self.state.setdefault("replay_order", [])

    def remembered(self, ctx: RunContext) -> list[Example]:
        """The examples in the memory now, task by task."""
        orders = self._orders()
        shares = memory_shares(self.options.memory_size, len(orders))
        return [ctx.sequence.tasks[t].train[i] for t, (order, k) in enumerate(zip(orders, shares)) for i in order[:k]]

    def training_examples(self, task_id: int, task: Task, ctx: RunContext) -> list[Example]:
        if len(self._orders()) != task_id:
            raise ValueError(
                f"the replay memory holds {len(self._orders())} finished tasks but the runner starts task {task_id}; "
                "was a task's after_task skipped?"
            )
        memory = self.remembered(ctx)
        return task.train + memory if memory else task.train

    def after_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        # a seeded random order of the task's training examples; its prefix is what the memory keeps
        generator = torch.Generator().manual_seed(ctx.train.seed * 1_000_003 + task_id)
        order = torch.randperm(len(task.train), generator=generator)[: self.options.memory_size].tolist()
        self._orders().append(order)
        return model

    def report(self, ctx: RunContext) -> dict:
        shares = memory_shares(self.options.memory_size, len(self._orders()))
        return {
            "memory_size": self.options.memory_size,
            "memory_per_task": [min(k, len(o)) for k, o in zip(shares, self._orders())],
        }
