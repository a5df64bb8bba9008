"""Heads built on class means: ``prototype`` (SimpleCIL / APER: cosine to each class's mean feature) and ``lda``
(a shared, shrunk covariance: linear discriminant analysis, as in streaming LDA and FeCAM's shared form)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Union

import torch
from torch import nn

from .base import ContinualHead, HeadOptions, masked_scores, reduce_sums_, register_head
from .selection import best_on_validation, validation_examples

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext


class ClassSums:
    """Float64 per-class counts and feature sums, and optionally the Gram matrix ``sum x x^T`` of every feature."""

    def __init__(self, num_classes: int, gram: bool = False) -> None:
        self.num_classes = num_classes
        self.with_gram = gram
        self.counts = torch.zeros(num_classes, dtype=torch.float64)
        self.sums: Optional[torch.Tensor] = None
        self.gram: Optional[torch.Tensor] = None

    def begin_task(self, width: int) -> None:
        """Start a task's pass: zeroed per-task sums (added to the totals by :meth:`end_task`)."""
        self._task = [torch.zeros_like(self.counts), torch.zeros(self.num_classes, width, dtype=torch.float64)]
        if self.with_gram:
            self._task.append(torch.zeros(width, width, dtype=torch.float64))

    def accumulate(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add a batch of float64 features ``x`` with labels ``y``."""
        counts, sums, *gram = self._task
        counts.index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
        sums.index_add_(0, y, x)
        if gram:
            gram[0].addmm_(x.T, x)

    def end_task(self, model: nn.Module) -> None:
        """Sum the task's pass over the processes and add it to the totals."""
        reduce_sums_(self._task, model)
        counts, sums, *gram = self._task
        self.counts = self.counts + counts
        self.sums = sums if self.sums is None else self.sums + sums
        if gram:
            self.gram = gram[0] if self.gram is None else self.gram + gram[0]
        del self._task

    @property
    def learned(self) -> torch.Tensor:
        return self.counts > 0

    def means(self) -> torch.Tensor:
        """``(num_classes, dim)`` float64 means (zeros for classes not seen)."""
        return self.sums / self.counts.clamp_min(1)[:, None]

    def within_class_covariance(self) -> torch.Tensor:
        """The pooled within-class covariance ``(sum x x^T - sum_c n_c mu_c mu_c^T) / (N - C)``, float64."""
        learned = self.learned
        n, c = self.counts.sum(), int(learned.sum())
        sums = self.sums[learned]
        scatter = self.gram - (sums.T / self.counts[learned]) @ sums
        return scatter / max(float(n) - c, 1.0)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"counts": self.counts, "sums": self.sums}
        if self.with_gram:
            state["gram"] = self.gram
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts, self.sums = state["counts"], state["sums"]
        if self.with_gram:
            self.gram = state["gram"]


class ClassSumsHead(ContinualHead):
    """A head whose statistics are :class:`ClassSums`; subclasses solve for their scores in :meth:`solve`."""

    #: Keep the Gram matrix of every feature too.
    with_gram: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stats = ClassSums(self.num_classes, gram=self.with_gram)

    def begin_task(self, task_id: int, task: Task, width: int) -> None:
        self.stats.begin_task(width)

    def accumulate(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.stats.accumulate(features, labels)

    def end_task(self, model: nn.Module, task_id: int, ctx: RunContext) -> None:
        self.stats.end_task(model)
        self.solve(model, ctx)

    def solve(self, model: nn.Module, ctx: RunContext) -> None:
        """Turn the statistics into what :meth:`scores` reads (after every task)."""


@register_head
class PrototypeHead(ClassSumsHead):
    """SimpleCIL / APER: each class's mean feature, taken when the class is learned; a feature scores the cosine to
    each mean. Exact for any batch split and task order; holds one mean per class."""

    name = "prototype"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prototypes: Optional[torch.Tensor] = None

    def solve(self, model: nn.Module, ctx: RunContext) -> None:
        self._prototypes = None

    def prototypes(self) -> torch.Tensor:
        """``(num_classes, dim)`` unit-norm class means (float32; zero rows for classes not learned)."""
        if self._prototypes is None:
            self._prototypes = nn.functional.normalize(self.stats.means(), dim=-1).float()
        return self._prototypes

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        protos = self.prototypes().to(features.device)
        return masked_scores(nn.functional.normalize(features.float(), dim=-1) @ protos.T, self.stats.learned)

    def state_dict(self) -> dict[str, Any]:
        return self.stats.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats.load_state_dict(state)
        self._prototypes = None

    @classmethod
    def bytes_per_class(cls, options: HeadOptions, dim: int) -> int:
        return 8 * (dim + 1)  # float64 sum and count


#: Shrinkage grid of the ``lda`` head's validation choice.
SHRINKAGE_GRID = (1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)


@dataclass
class LDAOptions(HeadOptions):
    """Options of the ``lda`` head.

    Args:
        shrinkage: Weight of the isotropic target in ``(1 - s) * Sigma + s * (tr Sigma / d) * I``: a number in
            (0, 1], ``"validation"`` (chosen on the validation split, which the run must have) or ``"auto"`` (on the
            validation split when the run has one, else the oracle-approximating shrinkage of Chen et al. (2010),
            computed from the covariance alone).
    """

    shrinkage: Union[float, str] = "auto"

    def validate(self) -> None:
        s = self.shrinkage
        if isinstance(s, str):
            if s not in ("auto", "validation"):
                raise ValueError(f"`head.shrinkage` must be a number in (0, 1], 'auto' or 'validation', got {s!r}")
        elif isinstance(s, bool) or not 0 < s <= 1:
            raise ValueError(f"`head.shrinkage` must be a number in (0, 1], 'auto' or 'validation', got {s!r}")


def oas_shrinkage(cov: torch.Tensor, n: float) -> float:
    """The oracle-approximating shrinkage coefficient (Chen, Wiesel, Eldar, Hero 2010) of a covariance estimated from
    ``n`` samples, toward ``(tr cov / d) I``."""
    d = cov.shape[0]
    tr, tr2 = float(torch.trace(cov)), float((cov * cov).sum())
    denominator = (n + 1 - 2 / d) * (tr2 - tr * tr / d)
    return 1.0 if denominator <= 0 else min(1.0, ((1 - 2 / d) * tr2 + tr * tr) / denominator)


@register_head
class LDAHead(ClassSumsHead):
    """Linear discriminant analysis on a shared, shrunk covariance ``S``: ``w_c = S^-1 mu_c``,
    ``b_c = -mu_c^T S^-1 mu_c / 2``.

    The statistics are every class's feature sum and one Gram matrix of all features (``dim x dim``), both additive,
    so the head is exact for any batch split and task order."""

    name = "lda"
    options_cls = LDAOptions
    with_gram = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight: Optional[torch.Tensor] = None
        self.bias: Optional[torch.Tensor] = None
        self.chosen: list[float] = []

    def needs_validation(self) -> Optional[str]:
        return "head.shrinkage: validation" if self.options.shrinkage == "validation" else None

    def discriminant(self, shrinkage: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight (C, d), bias (C,))`` float32 at ``shrinkage``; classes not learned get zero rows."""
        cov = self.stats.within_class_covariance()
        d = cov.shape[0]
        target = torch.trace(cov) / d
        shrunk = (1 - shrinkage) * cov + shrinkage * target * torch.eye(d, dtype=cov.dtype)
        means = self.stats.means()
        weight = torch.linalg.solve(shrunk, means.T).T
        bias = -0.5 * (weight * means).sum(-1)
        return weight.float(), bias.float()

    def solve(self, model: nn.Module, ctx: RunContext) -> None:
        option = self.options.shrinkage
        validation = validation_examples(ctx, self.stats.learned) if isinstance(option, str) else []
        if validation:
            candidates = {s: self.discriminant(s) for s in SHRINKAGE_GRID}
            shrinkage = best_on_validation(
                model, validation, ctx, lambda f, s: self._scores(f, *candidates[s]), SHRINKAGE_GRID
            )
        elif isinstance(option, str):  # auto without a validation split
            shrinkage = oas_shrinkage(self.stats.within_class_covariance(), float(self.stats.counts.sum()))
        else:
            shrinkage = float(option)
        self.chosen.append(shrinkage)
        self.weight, self.bias = self.discriminant(shrinkage)

    def _scores(self, features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        scores = features.float() @ weight.to(features.device).T + bias.to(features.device)
        return masked_scores(scores, self.stats.learned)

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        return self._scores(features, self.weight, self.bias)

    def state_dict(self) -> dict[str, Any]:
        return {**self.stats.state_dict(), "weight": self.weight, "bias": self.bias, "chosen": list(self.chosen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats.load_state_dict(state)
        self.weight, self.bias, self.chosen = state["weight"], state["bias"], list(state["chosen"])

    def describe(self) -> dict[str, Any]:
        return {"shrinkage_per_task": [round(s, 6) for s in self.chosen]}

    @classmethod
    def bytes_per_class(cls, options: HeadOptions, dim: int) -> int:
        return 8 * (dim + 1) + 4 * (dim + 1)  # float64 sum and count, float32 weight row and bias
