"""``ranpac``: RanPAC without its first-session adaptation: the frozen backbone, a random ReLU projection and a
ridge head solved in closed form (the ``analytic`` head)."""

from __future__ import annotations

from .base import register_continual_method
from .training_free import TrainingFree


@register_continual_method
class RanPAC(TrainingFree):
    """RanPAC without its first-session adaptation: the frozen backbone, a random ReLU projection, a ridge head."""

    name = "ranpac"
    known_as = "RanPAC"
    default_head = "analytic"
