"""``seq_lora``: PEFT's LoRA fine-tuned task after task, with nothing to protect old tasks (how forgetting looks
without care)."""

from __future__ import annotations

from .base import register_continual_method
from .lora import LoraMethod


@register_continual_method
class SequentialLoRA(LoraMethod):
    """PEFT's LoRA fine-tuned on each task in turn, with nothing to protect old tasks."""

    name = "seq_lora"
    task_kinds = ("classification", "generation")
