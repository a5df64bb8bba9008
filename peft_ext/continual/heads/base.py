"""What every continual head shares: the interface, the registry, and the feature pass that statistics heads read.

A head decides how a continual run turns the model's features into class scores. The features are the input of the
model's classification head (the module named ``classifier``, e.g. a :class:`~peft_ext.models.SentenceClassifier`'s
pooled and dropped-out encoder output; in evaluation mode dropout is the identity). Two families:

- heads the model trains (``linear``, ``cosine``): the model's own output is the score; the head may shape the
  classifier module (``cosine`` replaces it) and act before each task (freeze earlier rows);
- heads that learn from features (``prototype``, ``lda``, ``analytic``, ``aligned``): after each task one pass over
  the task's training examples, without gradients, adds to class statistics (sums, counts, Gram matrices); scores
  come from those statistics alone. No example is stored or revisited. The sums are float64 and additive, so any
  batch split and, for the order-free heads, any task order give the same statistics; under several processes each
  process reads its share and the sums are all-reduced.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
from torch import nn

from ...distributed import all_reduce_, rank, world_size
from ..context import by_length, model_logits, split_batches
from ..sharding import is_sharded

if TYPE_CHECKING:
    from ...data.tasks import Example, Task
    from ..context import RunContext

__all__ = [
    "HEADS",
    "ContinualHead",
    "HeadOptions",
    "build_head",
    "classifier_module",
    "feature_batches",
    "feature_heads",
    "head_options",
    "head_spec",
    "learn_heads",
    "reduce_sums_",
    "register_head",
]


@dataclass
class HeadOptions:
    """Options of a head without settings."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option and what would be valid."""


class ContinualHead:
    """Base class of a continual head (see the module docstring for the two families).

    Subclasses set ``name`` (and ``options_cls`` when they have settings) and register with :func:`register_head`.

    Args:
        options: The head's options (``options_cls``).
        num_classes: Classes of the whole sequence (the width of the scores).
        seed: Seed of the head's own random draws (projections, samples), from the run's ``train.seed``.
    """

    name: ClassVar[str] = ""
    options_cls: ClassVar[type[HeadOptions]] = HeadOptions
    #: Scores come from class statistics of the features (``False``: the model's own output is the score).
    reads_features: ClassVar[bool] = True
    #: Changes what the model trains (its classifier module or gradients): cannot be compared on another head's run.
    shapes_training: ClassVar[bool] = False

    def __init__(self, options: Optional[HeadOptions] = None, num_classes: int = 1, seed: int = 0) -> None:
        self.options = options if options is not None else self.options_cls()
        self.options.validate()
        if num_classes < 1:
            raise ValueError(f"`num_classes` must be a positive integer, got {num_classes}")
        self.num_classes = num_classes
        self.seed = seed

    def needs_validation(self) -> Optional[str]:
        """The option that asks for a validation split (``None`` when the head runs without one)."""
        return None

    def attach(self, model: nn.Module) -> nn.Module:
        """Called on the base model before the method builds on it; may replace its classifier module."""
        return model

    def before_task(self, model: nn.Module, task_id: int, ctx: RunContext) -> None:
        """Called before training task ``task_id`` (after the method's own ``before_task``)."""

    def begin_task(self, task_id: int, task: Task, width: int) -> None:
        """Start the statistics of one task's pass over features of width ``width`` (heads that read features)."""

    def accumulate(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one batch of this process's share of the pass."""

    def end_task(self, model: nn.Module, task_id: int, ctx: RunContext) -> None:
        """Sum the pass over the processes (:func:`reduce_sums_`) and solve for the scores."""

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        """``(batch, num_classes)`` scores of ``(batch, dim)`` features; ``-inf`` for classes not learned yet."""
        raise NotImplementedError(f"the {self.name!r} head scores with the model's own output")

    def state_dict(self) -> dict[str, Any]:
        """Everything the head learned (tensors and plain values), loadable with ``weights_only=True``."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def describe(self) -> dict[str, Any]:
        """JSON-serializable facts of the run for the report (choices made, bytes held)."""
        return {}

    @classmethod
    def bytes_per_class(cls, options: HeadOptions, dim: int) -> int:
        """Bytes the head keeps per class at feature width ``dim`` (shared matrices are not per class)."""
        return 0


HEADS: dict[str, type[ContinualHead]] = {}


def register_head(cls: type[ContinualHead]) -> type[ContinualHead]:
    """Class decorator: make ``cls`` available to configs as ``head: <cls.name>``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} must set a non-empty `name`")
    HEADS[cls.name] = cls
    return cls


def feature_heads() -> list[str]:
    """The names of the heads that learn from features (sorted): what a model that stops training needs."""
    return [name for name, cls in sorted(HEADS.items()) if cls.reads_features]


def head_spec(value: Any) -> tuple[str, dict[str, Any]]:
    """``(name, options)`` of a ``head`` option: a name (``prototype``) or a mapping with a ``name``.

    Raises:
        ValueError: Not a name or mapping, an unknown name (with the nearest valid one), or an unknown option.
    """
    if isinstance(value, str):
        name, settings = value, {}
    elif isinstance(value, dict) and isinstance(value.get("name"), str):
        name, settings = value["name"], {k: v for k, v in value.items() if k != "name"}
    else:
        raise ValueError(
            f"`head` must be a head name or a mapping with a `name`, got {value!r}; heads: {sorted(HEADS)}"
        )
    if name not in HEADS:  # perhaps a head an installed package declares (peft_ext.plugins)
        from ...plugins import ENTRY_POINT_GROUPS, load_entry_points

        load_entry_points(ENTRY_POINT_GROUPS["heads"])
    if name not in HEADS:
        close = difflib.get_close_matches(name, list(HEADS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"`head` {name!r} is not a head{hint}; heads: {', '.join(sorted(HEADS))}")
    valid = [f.name for f in dataclasses.fields(HEADS[name].options_cls)]
    for key in settings:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            options = ", ".join(valid) if valid else "none"
            raise ValueError(f"`head.{key}` is not an option of the {name!r} head{hint}; its options: {options}")
    return name, settings


def head_options(value: Any) -> tuple[str, HeadOptions]:
    """The head's name and its validated options, from a ``head`` option (see :func:`head_spec`)."""
    name, settings = head_spec(value)
    options = HEADS[name].options_cls(**settings)
    options.validate()
    return name, options


def build_head(value: Any, num_classes: int, seed: int = 0) -> ContinualHead:
    """The head a ``head`` option names, with its options validated (see :func:`head_spec`)."""
    name, options = head_options(value)
    return HEADS[name](options, num_classes=num_classes, seed=seed)


def classifier_module(model: nn.Module) -> nn.Module:
    """The outermost module named ``classifier`` (PEFT's ``modules_to_save`` wrapper when the head is trained)."""
    found: Optional[tuple[str, nn.Module]] = None
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "classifier" and (found is None or name.count(".") < found[0].count(".")):
            found = (name, module)
    if found is None:
        raise TypeError(f"{type(model).__name__} has no `classifier` module; a continual head reads its input")
    return found[1]


def feature_width(model: nn.Module) -> int:
    """The width of the features the classifier module reads (its first weight's second dimension)."""
    for param in classifier_module(model).parameters():
        if param.dim() == 2:
            return int(param.shape[1])
    raise TypeError("the `classifier` module has no 2-D weight to read the feature width from")


@contextmanager
def captured_features(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, each forward of ``model`` appends the input of its classifier module to the yielded list."""
    seen: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(args[0].detach())

    handle = classifier_module(model).register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def forward_with_features(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, features)`` of one forward of ``model`` on a collated ``batch``."""
    with captured_features(model) as seen:
        logits = model_logits(model, batch)
    if not seen:
        raise RuntimeError("the model's forward did not call its `classifier` module; no features to read")
    return logits, seen[-1]


@torch.no_grad()
def feature_batches(
    model: nn.Module, examples: Sequence[Example], ctx: RunContext, whole: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(features, labels)`` of ``examples``, a batch at a time, the model in evaluation mode (restored after).

    Under several processes each process reads its contiguous share (sum what it yields, then
    :func:`reduce_sums_`), except with ``whole`` or an FSDP2-sharded model, whose forwards every process must run
    together: then each reads everything and no reduction is needed.
    """
    world = world_size()
    split = world > 1 and not whole and not is_sharded(model)
    examples = by_length(examples)  # the heads' sums do not depend on the order; similar lengths pad less
    if split:
        size, extra = divmod(len(examples), world)
        start = rank() * size + min(rank(), extra)
        examples = examples[start : start + size + (rank() < extra)]
    was_training = model.training
    model.eval()
    try:
        for chunk in split_batches(examples, ctx.train.eval_batch_size):
            batch = ctx.to_device(ctx.collate(chunk))
            if ctx.frozen_features is not None:  # a frozen backbone's features of this batch, once per job
                features = ctx.frozen_features.features(model, chunk, batch)
            else:
                _, features = forward_with_features(model, batch)
            yield features.float(), batch["labels"]
    finally:
        model.train(was_training)


def learn_heads(heads: Sequence[ContinualHead], model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> None:
    """One pass over ``task.train`` feeds every head of ``heads`` that reads features."""
    readers = [head for head in heads if head.reads_features]
    if not readers:
        return
    width = feature_width(model)
    for head in readers:
        head.begin_task(task_id, task, width)
    for features, labels in feature_batches(model, task.train, ctx):
        x, y = features.double().cpu(), labels.cpu()
        for head in readers:
            head.accumulate(x, y)
    for head in readers:
        head.end_task(model, task_id, ctx)


def reduce_sums_(tensors: Sequence[torch.Tensor], model: nn.Module) -> None:
    """Sum statistics that :func:`feature_batches` split over the processes (a no-op where it did not split)."""
    if world_size() > 1 and not is_sharded(model):
        all_reduce_(list(tensors))


def grow(t: Optional[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """``t``, or float64 zeros of ``shape`` when ``t`` is ``None`` (statistics are made at the first pass, when the
    feature width is known)."""
    return torch.zeros(shape, dtype=torch.float64) if t is None else t


def masked_scores(scores: torch.Tensor, learned: torch.Tensor) -> torch.Tensor:
    """``scores`` with ``-inf`` at classes not learned yet (``learned``: boolean ``(num_classes,)``)."""
    return scores.masked_fill(~learned.to(scores.device), float("-inf"))
