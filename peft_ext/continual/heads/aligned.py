"""The ``aligned`` head: classifier alignment on stored class statistics (SLCA, Zhang et al., ICCV 2023; shipped
with InfLoRA's public code as "+ CA").

When a class is learned its feature mean and covariance are stored; after each task a linear classifier over every
class seen so far is retrained on Gaussian samples drawn from those statistics, starting from its previous weights.
No example of an earlier task is read again: :meth:`AlignedHead.align` sees statistics only.

The covariance is kept in one of three forms (bytes per class at width ``d``, float32):

- ``full``: ``d x d`` (``4 d^2``: 590 KB at 384, 64 MiB at 4096);
- ``lowrank``: the top ``rank`` eigenpairs plus the mean remaining variance (``4 (rank + 1) d``);
- ``diagonal``: per-feature variances (``4 d``).

``auto`` is ``full`` up to width 1024 and ``lowrank`` beyond.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from .base import ContinualHead, HeadOptions, masked_scores, reduce_sums_, register_head

if TYPE_CHECKING:
    from ...data.tasks import Task
    from ..context import RunContext

COVARIANCES = ("auto", "full", "lowrank", "diagonal")
#: Widest feature for which ``covariance: auto`` keeps full covariances.
FULL_UP_TO = 1024


@dataclass
class AlignedOptions(HeadOptions):
    """Options of the ``aligned`` head.

    Args:
        covariance: ``auto``, ``full``, ``lowrank`` or ``diagonal`` (see the module docstring).
        rank: Eigenpairs kept by ``lowrank``.
        samples_per_class: Gaussian samples per class in each alignment.
        epochs: Passes over the samples per alignment.
        lr: Adam's learning rate for the alignment.
    """

    covariance: str = "auto"
    rank: int = 64
    samples_per_class: int = 256
    epochs: int = 10
    lr: float = 1e-2

    def validate(self) -> None:
        if self.covariance not in COVARIANCES:
            raise ValueError(f"`head.covariance` must be one of {list(COVARIANCES)}, got {self.covariance!r}")
        for key in ("rank", "samples_per_class", "epochs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`head.{key}` must be a positive integer, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"`head.lr` must be > 0, got {self.lr}")

    def form(self, dim: int) -> str:
        """The covariance form used at feature width ``dim``."""
        if self.covariance == "auto":
            return "full" if dim <= FULL_UP_TO else "lowrank"
        return self.covariance


@dataclass
class ClassGaussian:
    """One class's stored statistics: its mean and its covariance in ``form``.

    ``factor`` is ``(d, d)`` lower-triangular (full: the Cholesky factor of the covariance), ``(d, k)`` (lowrank:
    eigenvectors scaled by the square roots of their eigenvalues) or ``(d,)`` (diagonal: standard deviations);
    ``residual`` is the standard deviation of the isotropic rest (lowrank) or 0.
    """

    mean: torch.Tensor
    factor: torch.Tensor
    residual: float = 0.0

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        d = self.mean.shape[0]
        if self.factor.dim() == 1:
            return self.mean + torch.randn(n, d, generator=generator) * self.factor
        z = torch.randn(n, self.factor.shape[1], generator=generator)
        x = self.mean + z @ self.factor.T
        if self.residual > 0:
            x = x + self.residual * torch.randn(n, d, generator=generator)
        return x


def class_gaussian(count: float, total: torch.Tensor, outer: torch.Tensor, form: str, rank: int) -> ClassGaussian:
    """A class's :class:`ClassGaussian` from its float64 count, feature sum and sum of outer products."""
    mean = total / count
    cov = outer / count - torch.outer(mean, mean)
    cov = (cov + cov.T) / 2
    d = mean.shape[0]
    if form == "diagonal":
        return ClassGaussian(mean.float(), cov.diagonal().clamp_min(0).sqrt().float())
    if form == "full":
        jitter = 1e-6 * float(cov.diagonal().mean().clamp_min(1e-12))
        factor = torch.linalg.cholesky(cov + jitter * torch.eye(d, dtype=cov.dtype))
        return ClassGaussian(mean.float(), factor.float())
    k = min(rank, d)
    if k == d:
        values, vectors = torch.linalg.eigh(cov)
    else:
        # randomized range finding (Halko et al.): O(d^2 k) where a full eigendecomposition is O(d^3), ~30 s per class
        # at width 4096 on one CPU thread; its random draws come from a private seed, not the run's generator
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            vectors, values, _ = torch.svd_lowrank(cov, q=min(k + 8, d), niter=4)
        values, vectors = values[:k].flip(0), vectors[:, :k].flip(1)
    top = values.clamp_min(0)
    rest = (float(torch.trace(cov)) - float(top.sum())) / (d - k) if d > k else 0.0
    residual = max(rest, 0.0) ** 0.5
    return ClassGaussian(mean.float(), (vectors * top.sqrt()).float(), residual)


@register_head
class AlignedHead(ContinualHead):
    """Classifier alignment on stored class statistics (see the module docstring)."""

    name = "aligned"
    options_cls = AlignedOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.classes: dict[int, ClassGaussian] = {}
        self.weight: Optional[torch.Tensor] = None
        self.bias: Optional[torch.Tensor] = None
        self.aligned_tasks = 0

    @property
    def learned(self) -> torch.Tensor:
        mask = torch.zeros(self.num_classes, dtype=torch.bool)
        mask[list(self.classes)] = True
        return mask

    def begin_task(self, task_id: int, task: Task, width: int) -> None:
        classes = sorted(set(task.classes))
        self._index = {c: i for i, c in enumerate(classes)}
        # class id -> row of this task's sums, as a tensor so a batch's labels map in one indexing
        self._rows = torch.full((self.num_classes,), -1, dtype=torch.long)
        self._rows[classes] = torch.arange(len(classes))
        self._task = [
            torch.zeros(len(classes), dtype=torch.float64),
            torch.zeros(len(classes), width, dtype=torch.float64),
            torch.zeros(len(classes), width, width, dtype=torch.float64),
        ]

    def accumulate(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        counts, totals, outers = self._task
        local = self._rows[labels]
        counts.index_add_(0, local, torch.ones(len(local), dtype=torch.float64))
        totals.index_add_(0, local, features)
        for i in local.unique().tolist():
            rows = features[local == i]
            outers[i].addmm_(rows.T, rows)

    def end_task(self, model: nn.Module, task_id: int, ctx: RunContext) -> None:
        reduce_sums_(self._task, model)
        counts, totals, outers = self._task
        del self._task
        form = self.options.form(totals.shape[1])
        for c, i in self._index.items():
            if counts[i] > 0:
                self.classes[c] = class_gaussian(float(counts[i]), totals[i], outers[i], form, self.options.rank)
        self.align(self.seed * 1000 + task_id)

    def align(self, seed: int) -> None:
        """Retrain the classifier over every stored class on samples of the stored statistics (nothing else)."""
        opts = self.options
        d = next(iter(self.classes.values())).mean.shape[0]
        if self.weight is None:
            self.weight, self.bias = torch.zeros(self.num_classes, d), torch.zeros(self.num_classes)
        generator = torch.Generator().manual_seed(seed)
        classes = sorted(self.classes)
        x = torch.cat([self.classes[c].sample(opts.samples_per_class, generator) for c in classes])
        y = torch.tensor(classes).repeat_interleave(opts.samples_per_class)
        # standardized inputs make one learning rate fit any feature scale; folded back into the weights after
        shift, scale = x.mean(0), x.std(0).clamp_min(1e-6)
        weight = nn.Parameter(self.weight * scale)
        bias = nn.Parameter(self.bias + self.weight @ shift)
        optimizer = torch.optim.Adam([weight, bias], lr=opts.lr)
        learned = self.learned
        batch = 256
        with torch.enable_grad():
            for _ in range(opts.epochs):
                order = torch.randperm(len(x), generator=generator)
                for s in range(0, len(x), batch):
                    idx = order[s : s + batch]
                    logits = masked_scores(((x[idx] - shift) / scale) @ weight.T + bias, learned)
                    loss = nn.functional.cross_entropy(logits, y[idx])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
        self.weight = (weight.detach() / scale).contiguous()
        self.bias = (bias.detach() - self.weight @ shift).contiguous()
        self.aligned_tasks += 1

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        scores = features.float() @ self.weight.to(features.device).T + self.bias.to(features.device)
        return masked_scores(scores, self.learned)

    def state_dict(self) -> dict[str, Any]:
        classes = {
            str(c): {"mean": g.mean, "factor": g.factor, "residual": torch.tensor(g.residual)}
            for c, g in self.classes.items()
        }
        return {"classes": classes, "weight": self.weight, "bias": self.bias, "aligned_tasks": self.aligned_tasks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.classes = {
            int(c): ClassGaussian(g["mean"], g["factor"], float(g["residual"])) for c, g in state["classes"].items()
        }
        self.weight, self.bias, self.aligned_tasks = state["weight"], state["bias"], int(state["aligned_tasks"])

    def describe(self) -> dict[str, Any]:
        d = self.weight.shape[1] if self.weight is not None else 0
        return {"covariance": self.options.form(d) if d else self.options.covariance, "alignments": self.aligned_tasks}

    @classmethod
    def bytes_per_class(cls, options: HeadOptions, dim: int) -> int:
        form = options.form(dim)
        stored = {"full": dim * dim, "lowrank": min(options.rank, dim) * dim + 1, "diagonal": dim}[form]
        return 4 * (stored + dim) + 4 * (dim + 1)  # covariance + mean, and the classifier's row and bias
