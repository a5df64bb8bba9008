"""``joint``: LoRA trained once on the union of all tasks, the upper bound continual methods are measured against
(no accuracy matrix before the last row)."""

from __future__ import annotations

from .base import register_continual_method
from .lora import LoraMethod


@register_continual_method
class JointLoRA(LoraMethod):
    """Upper bound: the same LoRA trained once on the union of every task's training data."""

    name = "joint"
    trains_on_union = True
    is_upper_bound = True
    is_continual_adapter = False
    task_kinds = ("classification", "generation")
