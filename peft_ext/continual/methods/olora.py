"""``olora``: O-LoRA (Wang et al., EMNLP 2023 findings): a fresh LoRA per task with the orthogonality loss
``lambda_orth * sum_{i<t} |A_i A_t^T|_1`` between the new ``A`` and every earlier task's ``A``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .base import LoraOptions, register_continual_method
from .rewrap import RewrapMethod

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext

__all__ = ["OLoRAMethod", "OLoRAOptions"]


@dataclass
class OLoRAOptions(LoraOptions):
    """Options of the O-LoRA baseline (LoRA options plus the two regularizer weights).

    Args:
        lambda_orth: Weight of the orthogonality loss ``sum_{i<t} |A_i A_t^T|_1`` (O-LoRA's ``lamda_1``: 0.5).
        lambda_l2: Weight of the L2 penalty on the new task's LoRA weights (``lamda_2``; 0 in O-LoRA's scripts).
    """

    lambda_orth: float = 0.5
    lambda_l2: float = 0.0

    def validate(self) -> None:
        super().validate()
        for key in ("lambda_orth", "lambda_l2"):
            if getattr(self, key) < 0:
                raise ValueError(f"`{key}` must be >= 0, got {getattr(self, key)}")


@register_continual_method
class OLoRAMethod(RewrapMethod):
    """O-LoRA: a fresh LoRA per task, kept orthogonal to earlier tasks' LoRA A by a loss term.

    Each finished task's ``A`` is recorded in ``after_task``, while its adapter is still there: ``between_tasks``
    merges it into the backbone before the next ``before_task`` runs. The run's report gives, per task, the rows of
    earlier ``A`` the penalty covered and the trained ``A``'s overlap ``sum |A_i A_t^T|`` with them.
    """

    name = "olora"
    options_cls = OLoRAOptions
    task_kinds = ("classification", "generation")

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        old: dict[str, list[torch.Tensor]] = self.state.setdefault("olora_A", {})
        finished = {len(mats) for mats in old.values()} or {0}
        if finished != {task_id}:
            raise ValueError(
                f"O-LoRA holds the A of {sorted(finished)} finished tasks per layer but the runner starts task "
                f"{task_id}; was a task's after_task skipped?"
            )
        model = self._wrap(self._fold(model), self.options.adapter_config(), ctx)
        device = next(model.parameters()).device
        self._old = {name: torch.cat(mats).to(device) for name, mats in old.items()}
        return model

    def after_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        old: dict[str, list[torch.Tensor]] = self.state.setdefault("olora_A", {})
        overlap = 0.0
        for name, layer in self._lora_layers(model):
            a = layer.lora_A["default"].weight.detach()
            if name in self._old:
                overlap += float((self._old[name].to(a.dtype) @ a.T).abs().sum())
            old.setdefault(name, []).append(a.cpu().clone())
        self.state.setdefault("olora_old_rows", []).append(sum(m.shape[0] for m in self._old.values()))
        self.state.setdefault("olora_overlap", []).append(overlap)
        return model

    @staticmethod
    def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        if not isinstance(model, PeftModel):
            return []
        return [(n, m) for n, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)]

    def extra_loss(
        self, model: nn.Module, batch: dict[str, Any], task_id: int, ctx: RunContext
    ) -> torch.Tensor | None:
        opts = self.options
        terms = []
        for name, layer in self._lora_layers(model):
            a = layer.lora_A["default"].weight
            if opts.lambda_orth and name in self._old:
                terms.append(opts.lambda_orth * (self._old[name].to(a.dtype) @ a.T).abs().sum())
            if opts.lambda_l2:
                b = layer.lora_B["default"].weight
                terms.append(opts.lambda_l2 * (a.square().sum() + b.square().sum()))
        return torch.stack(terms).sum() if terms else None

    def report(self, ctx: RunContext) -> dict[str, Any]:
        return {
            "old_A_rows": list(self.state.get("olora_old_rows", [])),
            "orth_overlap": list(self.state.get("olora_overlap", [])),
        }
