"""Training-free baselines: the frozen backbone and a head that learns from its features, nothing trained.

What a continual-learning user checks before adopting an adapter method (SimpleCIL / APER, Zhou et al., IJCV 2024;
RanPAC, McDonnell et al., NeurIPS 2023; streaming LDA and FeCAM's shared covariance). Each keeps class statistics,
never examples, and costs one forward pass over each task's training data.

- ``ncm``: class means, cosine scores (SimpleCIL), the ``prototype`` head;
- ``slda``: a shared covariance shrunk toward the identity, the ``lda`` head;
- ``ranpac``: a random ReLU projection and a ridge head solved in closed form, the ``analytic`` head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ..heads.base import feature_heads
from .base import ContinualMethod, MethodOptions

if TYPE_CHECKING:
    from ..context import RunContext


class Untrained(ContinualMethod):
    """A method that trains nothing: its model is the base model, frozen (``lr`` and ``weight_decay`` are not used)."""

    trains = False
    is_continual_adapter = False

    def __init__(self, options: MethodOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        if self.options.adapt != "every_task":
            raise ValueError(f"`adapt` is for methods that train; {self.name!r} trains nothing")

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        return base_model.requires_grad_(False)


class TrainingFree(Untrained):
    """A frozen backbone and a head that learns from its features (``lr`` and ``weight_decay`` are not used)."""

    @classmethod
    def supported_heads(cls) -> tuple[str, ...]:
        return tuple(feature_heads())

    @classmethod
    def unsupported_head_reason(cls) -> str:
        return f"{cls.name!r} trains nothing, so its head must learn from features"
