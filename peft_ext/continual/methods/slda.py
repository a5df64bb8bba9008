"""``slda``: the frozen backbone with streaming linear discriminant analysis on a shared, shrunk covariance (the
``lda`` head)."""

from __future__ import annotations

from .base import register_continual_method
from .training_free import TrainingFree


@register_continual_method
class StreamingLDA(TrainingFree):
    """The frozen backbone with linear discriminant analysis on a shared, shrunk covariance."""

    name = "slda"
    known_as = "streaming LDA (slda)"
    default_head = "lda"
