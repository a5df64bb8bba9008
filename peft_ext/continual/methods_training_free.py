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

from .heads import HEADS, head_spec
from .heads.base import feature_heads
from .methods import ContinualMethod, MethodOptions, register_continual_method

if TYPE_CHECKING:
    from .context import RunContext


class TrainingFree(ContinualMethod):
    """A frozen backbone and a head that learns from its features (``lr`` and ``weight_decay`` are not used)."""

    trains = False

    def __init__(self, options: MethodOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        name = head_spec(self.head)[0]
        if not HEADS[name].reads_features:
            raise ValueError(
                f"`head` {name!r} is trained with the model, and {self.name!r} trains nothing: use a head that learns "
                f"from features ({', '.join(feature_heads())})"
            )
        if self.options.adapt != "every_task":
            raise ValueError(f"`adapt` is for methods that train; {self.name!r} trains nothing")

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        return base_model.requires_grad_(False)


@register_continual_method
class NearestClassMean(TrainingFree):
    """SimpleCIL: the frozen backbone's class means, cosine scores."""

    name = "ncm"
    default_head = "prototype"


@register_continual_method
class StreamingLDA(TrainingFree):
    """The frozen backbone with linear discriminant analysis on a shared, shrunk covariance."""

    name = "slda"
    default_head = "lda"


@register_continual_method
class RanPAC(TrainingFree):
    """RanPAC without its first-session adaptation: the frozen backbone, a random ReLU projection, a ridge head."""

    name = "ranpac"
    default_head = "analytic"
