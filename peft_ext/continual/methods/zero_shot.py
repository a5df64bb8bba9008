"""``zero_shot``: the pretrained model as it is, scored on every task of an instruction sequence: the reference that
says what the tasks cost a model that was never tuned on them, and what tuning gained."""

from __future__ import annotations

from .base import register_continual_method
from .training_free import Untrained


@register_continual_method
class ZeroShot(Untrained):
    """The base model untouched; each task is scored once, since no row changes the model."""

    name = "zero_shot"
    task_kinds = ("generation",)
