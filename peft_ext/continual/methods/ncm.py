"""``ncm``: SimpleCIL, the frozen backbone's class means scored by cosine similarity (the ``prototype`` head)."""

from __future__ import annotations

from .base import register_continual_method
from .training_free import TrainingFree


@register_continual_method
class NearestClassMean(TrainingFree):
    """SimpleCIL: the frozen backbone's class means, cosine scores."""

    name = "ncm"
    default_head = "prototype"
    reference_name = "SimpleCIL"
