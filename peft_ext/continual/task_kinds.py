"""What differs between the kinds of task sequence a continual run learns, as one object per kind.

- ``classification``: a class label per example; training and evaluation restrict the logits to the classes in play,
  heads apply (feature readers and classifier replacements), the model's classification head trains with the
  adapter, a task is scored by accuracy and the final row records which test examples each method got right (what
  paired comparisons of methods need).
- ``generation``: instruction tasks on a causal LM; batches are prompts with answers (a causal collate), the loss is
  the answers' next-token loss over the whole vocabulary, no head applies and the LM head stays frozen, a task is
  scored by its metric on generated answers (exact match or ROUGE-L, with ROUGE-L and the answers' loss beside), and
  held-out perplexity before and after says what the sequence cost the model's general ability.

A :class:`~peft_ext.data.tasks.TaskSequence` names its kind (``sequence.kind``); :func:`task_kind` gives the object,
and the engine, evaluation, the methods and the job ask it instead of testing the name. A new kind is a subclass
registered with :func:`register_task_kind`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Optional, Union

from ..named import KindRegistry
from .context import masked_cross_entropy
from .evaluation import evaluate_heads
from .generation import generation_scores, next_token_loss, require_causal_collate
from .heads import build_head

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..data.tasks import TaskSequence
    from .context import Collate
    from .heads import ContinualHead

__all__ = ["TASK_KINDS", "Classification", "Generation", "TaskKind", "check_heads", "register_task_kind", "task_kind"]


class TaskKind:
    """One kind of task sequence: what the run does differently for it (see the module docstring)."""

    #: The name a sequence gives (``TaskSequence.kind``).
    name: ClassVar[str]
    #: Training and evaluation restrict the logits to the classes in play (``False``: the loss spans the vocabulary).
    masks_classes: ClassVar[bool]
    #: Heads apply (``head`` / ``compare_heads``), and the result records which head scored.
    takes_heads: ClassVar[bool]
    #: The model's output head trains with the adapter (``modules_to_save``); ``False``: it stays as pretrained.
    trains_output_head: ClassVar[bool]
    #: A task's score does not depend on the row (on the classes seen so far): a phase that changed nothing reuses
    #: the previous row's scores.
    row_independent_scores: ClassVar[bool]
    #: The final row records, per test example, whether the method got it right (for paired comparisons).
    records_hits: ClassVar[bool]
    #: Held-out perplexity is measured before and after the sequence.
    measures_held_out_text: ClassVar[bool]
    #: Batches are prompts with answers, for a causal LM (queries are read from the prompt's tokens).
    causal: ClassVar[bool]
    #: The final model is also scored on the validation split, when the sequence has one (what ``peft-ext predict``
    #: chooses its method by). ``False`` where that costs as much as the test evaluation (generating every answer):
    #: such a job keeps its validation split for ``--tune``.
    scores_final_validation: ClassVar[bool]

    def check_collate(self, collate: Collate) -> None:
        """Refuse a collate that cannot batch this kind's examples (nothing to check by default)."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor]) -> tuple[Any, Any]:
        """The task loss of a batch's ``logits`` and ``labels`` (``mask``: the logits it sees, ``None``: all), and
        the logits it saw."""
        raise NotImplementedError

    def describe(self, sequence: TaskSequence) -> str:
        """How the sequence is learnt and scored, in the words a job's first line uses."""
        return sequence.protocol

    def score_task(
        self, engine: Any, model: nn.Module, row: int, task: int, options: dict[str, Any], split: str = "test"
    ) -> tuple[float, dict[str, float]]:
        """Task ``task``'s score on its ``split`` (``test`` or ``validation``) after phase row ``row``, and the further
        scores by name (for ``score_row``)."""
        raise NotImplementedError


class Classification(TaskKind):
    name = "classification"
    masks_classes = True
    takes_heads = True
    trains_output_head = True
    row_independent_scores = False
    records_hits = True
    measures_held_out_text = False
    causal = False
    scores_final_validation = True

    def score_task(
        self, engine: Any, model: nn.Module, row: int, task: int, options: dict[str, Any], split: str = "test"
    ) -> tuple[float, dict[str, float]]:
        ctx, sequence = engine.ctx, engine.sequence
        heads = {"": engine.head, **{f"head:{name}": head for name, head in engine.compared.items()}}
        # the final row records which test examples the method gets right
        final = row == len(sequence) - 1 and split == "test"
        hits: list[bool] | None = [] if final else None
        scores = evaluate_heads(
            model,
            getattr(sequence.tasks[task], split),
            ctx.eval_classes(row, task),
            sequence.num_classes,
            ctx.collate,
            ctx.device,
            heads,
            hits=hits,
            frozen_features=ctx.frozen_features,
            **options,
        )
        if hits is not None:
            engine.final_hits[task] = "".join("1" if h else "0" for h in hits)
        return scores.pop(""), scores

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor]) -> tuple[Any, Any]:
        return masked_cross_entropy(logits, labels, mask)


class Generation(TaskKind):
    name = "generation"
    masks_classes = False
    takes_heads = False
    trains_output_head = False
    row_independent_scores = True
    records_hits = False
    measures_held_out_text = True
    causal = True
    scores_final_validation = False

    #: A task's metric as a reader says it.
    METRIC_WORDS: ClassVar[dict[str, str]] = {"exact_match": "exact match", "rouge_l": "ROUGE-L"}

    def check_collate(self, collate: Collate) -> None:
        require_causal_collate(collate)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor]) -> tuple[Any, Any]:
        """Cross-entropy of the answer tokens over the whole vocabulary (labels -100 elsewhere): no class mask."""
        if mask is not None:
            raise ValueError("a generation batch takes no class mask; pass mask=None")
        return next_token_loss(logits, labels), logits

    def describe(self, sequence: TaskSequence) -> str:
        metrics = {t.metric for t in sequence.tasks}
        scored = " / ".join(said for metric, said in self.METRIC_WORDS.items() if metric in metrics)
        return f"instruction tasks, scored by {scored} of the generated answers"

    def score_task(
        self, engine: Any, model: nn.Module, row: int, task: int, options: dict[str, Any], split: str = "test"
    ) -> tuple[float, dict[str, float]]:
        ctx = engine.ctx
        spec = engine.sequence.tasks[task]
        scores = generation_scores(model, getattr(spec, split), ctx.collate, ctx.device, **options)
        score = scores[spec.metric]
        scores.pop("exact_match")
        return score, scores


#: The kinds by name.
TASK_KINDS: KindRegistry[TaskKind] = KindRegistry("task sequence kind")
#: Register a kind (a class decorator).
register_task_kind = TASK_KINDS.register
register_task_kind(Classification)
register_task_kind(Generation)


def task_kind(sequence: Union[TaskSequence, str]) -> TaskKind:
    """The kind object of ``sequence`` (or of a kind's name).

    Raises:
        ValueError: A kind no one registered, naming the registered ones.
    """
    return TASK_KINDS.lookup(sequence if isinstance(sequence, str) else sequence.kind)


def check_heads(sequence: TaskSequence, method: Any, heads: Optional[list[ContinualHead]] = None) -> None:
    """Refuse heads that ``sequence`` cannot serve, before any work: a generation sequence takes none, and a head
    that chooses on a validation split needs one.

    Args:
        sequence: The task sequence.
        method: The method, whose ``head`` and ``compare_heads`` options are checked.
        heads: The heads already built from them (default: built here).

    Raises:
        ValueError: One line naming the method, the head and the key that would fix it.
    """
    if heads is None:
        specs = [method.head, *method.options.compare_heads]
        heads = [build_head(spec, sequence.num_classes) for spec in specs]
    # generated answers are scored as text: no head may read features or replace the model's output layer
    if not task_kind(sequence).takes_heads and any(h.reads_features or h.shapes_training for h in heads):
        raise ValueError(
            f"a generation sequence ({sequence.name!r}) scores generated answers, not classes: method "
            f"{method.label!r} takes no `head` or `compare_heads` there"
        )
    needs = method.needs_validation()
    if needs and not any(task.validation for task in sequence.tasks):
        raise ValueError(
            f"method {method.label!r} chooses on a validation split ({needs}), and {sequence.name!r} has none: set "
            "`data.val_per_class` (shipped data sets) or `data.validation` / `data.validation_share` (your files), "
            "or give the head a fixed value"
        )
