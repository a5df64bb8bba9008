"""``inflora``: InfLoRA-style (Liang & Li, CVPR 2024). Before a task, ``A`` is fixed to the top-``r`` left singular
vectors of ``(I - M M^T) C_new`` (``C_new``: the new task's input covariance under the current model); ``B`` trains.
After the task, the memory ``M`` grows by the task's directions that a GPM energy threshold keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .base import MethodOptions, register_continual_method
from .covariance import backbone_of, input_covariances
from .rewrap import RewrapMethod

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext

__all__ = ["InfLoRAMethod", "InfLoRAOptions", "gpm_update", "inflora_A"]


@dataclass
class InfLoRAOptions(MethodOptions):
    """Options of the InfLoRA-style baseline.

    Args:
        r: Rank of each task's adapter.
        target_modules: Module-name suffixes to adapt.
        threshold_start: GPM energy threshold after the first task (InfLoRA's ``lamb``; its CIFAR-100 config: 0.95).
        threshold_end: Threshold the schedule moves towards, reached after the last task (``lame``; 1.0 there).
    """

    r: int = 10
    target_modules: list[str] = field(default_factory=lambda: ["query", "value"])
    threshold_start: float = 0.95
    threshold_end: float = 1.0

    def validate(self) -> None:
        super().validate()
        if self.r < 1:
            raise ValueError(f"`r` must be a positive integer, got {self.r}")
        if not self.target_modules:
            raise ValueError("`target_modules` must name at least one module, got an empty list")
        for key in ("threshold_start", "threshold_end"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"`{key}` must be in (0, 1], got {getattr(self, key)}")


def inflora_A(covariance: torch.Tensor, memory: torch.Tensor | None, r: int) -> torch.Tensor:
    """InfLoRA's frozen ``A``: the top-``r`` left singular vectors of ``(I - M M^T) C_new``, as rows, ``/ sqrt(3)``.

    The ``1 / sqrt(3)`` is the scale of InfLoRA's public code (a kaiming-uniform row's expected norm).

    Args:
        covariance: ``(n, n)`` input covariance of the new task.
        memory: ``(n, k)`` orthonormal basis ``M`` of the protected directions, or ``None``.
        r: Rank.

    Returns:
        ``A`` of shape ``(r, n)`` (float64).
    """
    c = covariance.to(torch.float64)
    if memory is not None and memory.shape[1]:
        c = c - memory @ (memory.T @ c)
    u, _, _ = torch.linalg.svd(c, full_matrices=False)
    return u[:, :r].T / math.sqrt(3)


def gpm_update(memory: torch.Tensor | None, covariance: torch.Tensor, threshold: float) -> torch.Tensor:
    """Grow the GPM memory by the task's directions that its energy threshold keeps (InfLoRA's ``update_GPM``).

    As in InfLoRA's public code, the "representation" whose energy is thresholded is the covariance itself, so a
    direction's energy is its squared eigenvalue. First task: keep the leading directions whose cumulative energy
    stays below ``threshold`` (at least one). Later tasks: the energy already captured by ``M`` counts first; add the
    leading directions of ``(I - M M^T) C`` until the captured share reaches ``threshold``.

    Args:
        memory: ``(n, k)`` orthonormal basis, or ``None`` before the first task.
        covariance: ``(n, n)`` input covariance of the finished task.
        threshold: Energy share in ``(0, 1]``.

    Returns:
        The new ``(n, k')`` basis, ``k <= k' <= n``.
    """
    c = covariance.to(torch.float64)
    n = c.shape[0]
    _, s, _ = torch.linalg.svd(c, full_matrices=False)
    total = float(s.square().sum())
    if total <= 0:
        raise ValueError("the task's input covariance is zero; no directions to protect")
    if memory is None or memory.shape[1] == 0:
        u, s, _ = torch.linalg.svd(c, full_matrices=False)
        keep = int((torch.cumsum(s.square(), 0) / total < threshold).sum())
        return u[:, : max(keep, 1)]
    residual = c - memory @ (memory.T @ c)
    u, s_hat, _ = torch.linalg.svd(residual, full_matrices=False)
    ratios = s_hat.square() / total
    captured = (total - float(s_hat.square().sum())) / total
    keep = 0
    while keep < ratios.numel() and captured < threshold:
        captured += float(ratios[keep])
        keep += 1
    return torch.cat([memory, u[:, :keep]], dim=1)[:, :n]


@register_continual_method
class InfLoRAMethod(RewrapMethod):
    """InfLoRA-style: A from the new task's inputs projected away from a GPM memory of old directions; B trains."""

    name = "inflora"
    options_cls = InfLoRAOptions
    task_kinds = ("classification", "generation")
    rank_bounded_by_input_width = True

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        from peft import LoraConfig

        opts = self.options
        backbone = self._fold(model)
        memory: dict[str, torch.Tensor] = self.state.setdefault("inflora_memory", {})
        covariances = input_covariances(backbone, opts.target_modules, task.train, ctx)
        # lora_alpha = r makes PEFT's scale 1, as in InfLoRA (y = W x + B A x).
        config = LoraConfig(r=opts.r, lora_alpha=opts.r, target_modules=list(opts.target_modules))
        model = self._wrap(backbone, config, ctx)
        for name, module in backbone_of(model).named_modules():
            if name in covariances:
                weight = module.lora_A["default"].weight
                with torch.no_grad():
                    weight.copy_(inflora_A(covariances[name], memory.get(name), opts.r).to(weight.dtype))
                weight.requires_grad_(False)
        return model

    def after_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        opts = self.options
        steps = max(len(ctx.sequence), 1)
        threshold = opts.threshold_start + (opts.threshold_end - opts.threshold_start) * task_id / steps
        memory: dict[str, torch.Tensor] = self.state.setdefault("inflora_memory", {})
        for name, covariance in input_covariances(model, opts.target_modules, task.train, ctx).items():
            memory[name] = gpm_update(memory.get(name), covariance, threshold)
        return model
