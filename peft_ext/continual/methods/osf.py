"""``osf``: PEFT's Orthogonal Subspace Fine-tuning, re-wrapped per task as PEFT's OSF guide describes, with a
growing preserved rank. The guide unwraps with ``unload()``; OSF keeps its update outside the base weight, so
``unload()`` would drop the finished task: the fold merges it instead."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from .base import MethodOptions, register_continual_method
from .rewrap import RewrapMethod

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext

__all__ = ["OSFMethod", "OSFOptions"]


@dataclass
class OSFOptions(MethodOptions):
    """Options of the PEFT OSF baseline.

    Args:
        target_modules: Module-name suffixes to adapt.
        preserved_start: Preserved (frozen) share of each weight's singular directions for the first task
            (PEFT's default effective rank: 0.5).
        preserved_end: Preserved share for the last task; in between it grows linearly, as the OSF guide grows the
            preserved rank after every task.
    """

    target_modules: list[str] = field(default_factory=lambda: ["query", "value"])
    preserved_start: float = 0.5
    preserved_end: float = 0.9

    def validate(self) -> None:
        super().validate()
        if not self.target_modules:
            raise ValueError("`target_modules` must name at least one module, got an empty list")
        for key in ("preserved_start", "preserved_end"):
            if not 0 < getattr(self, key) < 1:
                raise ValueError(f"`{key}` must be in (0, 1), got {getattr(self, key)}")
        if self.preserved_end < self.preserved_start:
            raise ValueError(
                f"`preserved_end` ({self.preserved_end}) must be >= `preserved_start` ({self.preserved_start})"
            )


@register_continual_method
class OSFMethod(RewrapMethod):
    """PEFT's OSF: trains each weight's minor singular subspace; re-wrapped per task with a growing preserved rank."""

    name = "osf"
    options_cls = OSFOptions

    def preserved_share(self, task_id: int, n_tasks: int) -> float:
        """Fraction of singular directions OSF freezes for ``task_id``."""
        opts = self.options
        progress = task_id / max(n_tasks - 1, 1)
        return opts.preserved_start + (opts.preserved_end - opts.preserved_start) * progress

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        from peft import OSFConfig

        share = self.preserved_share(task_id, len(ctx.sequence))
        config = OSFConfig(effective_rank=share, target_modules=list(self.options.target_modules))
        return self._wrap(self._fold(model), config, ctx)
