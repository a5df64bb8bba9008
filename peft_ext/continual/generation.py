"""The generation side of the continual harness: the next-token loss on answer tokens, exact-match evaluation of
greedy generation, and the prompt query PCLR routes instructions by.

A ``kind="generation"`` :class:`~peft_ext.data.tasks.TaskSequence` is batched by
:class:`~peft_ext.data.collate.CausalLMCollator`: ``labels`` aligned with ``input_ids``, -100 except on the answer
and its eos. :func:`next_token_loss` is the training loss, :func:`evaluate_generation` the accuracy-matrix entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..data.collate import CausalLMCollator
from ..data.tasks import Example
from ..tuners.pclr import default_query
from ..tuners.pclr.router import QueryFn
from .context import Collate, model_logits, split_batches, to_device

__all__ = [
    "answer_logits",
    "evaluate_generation",
    "generate_answers",
    "generation_scores",
    "next_token_loss",
    "prompt_query",
    "require_causal_collate",
    "text_perplexity",
]


def answer_logits(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits that predict the answer tokens, and those tokens: ``logits[:, t]`` predicts ``labels[:, t + 1]``.

    Args:
        logits: (batch, seq, vocab) causal-LM logits.
        labels: (batch, seq) token ids on the answer, -100 elsewhere (prompt, separator, padding).

    Returns:
        ``(logits, targets)``: (n, vocab) and (n,) over the ``n`` answer tokens of the batch.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"answer_logits needs (batch, seq, vocab) logits and (batch, seq) labels, got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}"
        )
    targets = labels[:, 1:]
    keep = targets != -100
    return logits[:, :-1][keep], targets[keep]


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the answer tokens of a batch (prompt and padding are not scored).

    Args:
        logits: (batch, seq, vocab) causal-LM logits.
        labels: (batch, seq), -100 where no token is scored.
    """
    scores, targets = answer_logits(logits, labels)
    if targets.numel() == 0:
        raise ValueError("the batch has no answer tokens (every label is -100); nothing to train on")
    return F.cross_entropy(scores.float(), targets)


def require_causal_collate(collate: Collate) -> CausalLMCollator:
    """``collate`` if it is a :class:`CausalLMCollator` (what a generation sequence is batched by), else an error."""
    if not isinstance(collate, CausalLMCollator):
        raise TypeError(
            f"a generation task sequence is batched by peft_ext.data.collate.CausalLMCollator, got "
            f"{type(collate).__name__}"
        )
    return collate


@torch.no_grad()
def generate_answers(
    model: nn.Module,
    examples: Sequence[Example],
    collate: CausalLMCollator,
    device: torch.device,
    use_cache: bool = True,
) -> list[str]:
    """Greedy answers of ``model`` to ``examples``' prompts (one batch, left-padded), decoded up to the first eos.

    Args:
        model: A causal LM (or a PeftModel of one) with ``generate``.
        examples: Instruction examples.
        collate: Builds the prompts and decodes.
        device: Where the model runs.
        use_cache: Decode with the KV cache (``False``: every step re-reads the whole sequence).
    """
    batch = to_device(collate.prompts(examples), device)
    out = model.generate(
        **batch,
        max_new_tokens=collate.answer_budget(examples),
        do_sample=False,
        num_beams=1,
        use_cache=use_cache,
        pad_token_id=collate.pad_token_id,
        eos_token_id=collate.eos_token_id,
    )
    return [collate.decode(row.tolist()) for row in out[:, batch["input_ids"].shape[1] :]]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 of ``candidate`` against ``reference`` over whitespace tokens (Lin 2004; the longest common
    subsequence, precision and recall weighted equally). 1.0 for two empty strings."""
    a, b = candidate.split(), reference.split()
    if not a or not b:
        return float(a == b)
    row = [0] * (len(b) + 1)
    for x in a:  # one row of the LCS table at a time
        prev = 0
        for j, y in enumerate(b, start=1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    lcs = row[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


@torch.no_grad()
def generation_scores(
    model: nn.Module,
    examples: Sequence[Example],
    collate: Collate,
    device: torch.device,
    *,
    batch_size: int = 128,
    progress: bool = False,
    desc: str = "eval",
) -> dict[str, float]:
    """Exact match and ROUGE-L of greedy generation against the answers, and the answers' per-token loss under
    teacher forcing (mean next-token cross-entropy over every answer token of ``examples``).

    Args:
        model: A causal LM (or a PeftModel of one).
        examples: Instruction examples.
        collate: A :class:`CausalLMCollator`.
        device: Where the model runs.
        batch_size: Prompts per ``generate`` call.
        progress: Show a progress bar.
        desc: Progress-bar label.

    Returns:
        ``{"exact_match", "rouge_l", "answer_loss"}``; the first two are means over ``examples``.
    """
    if not examples:
        raise ValueError("cannot evaluate on an empty test set")
    collate = require_causal_collate(collate)
    was_training = model.training
    model.eval()
    correct, rouge, loss_sum, tokens = 0, 0.0, 0.0, 0
    try:
        for chunk in tqdm(split_batches(examples, batch_size), desc=desc, disable=not progress, leave=False):
            answers = generate_answers(model, chunk, collate, device)
            correct += sum(got == ex.inputs.answer for got, ex in zip(answers, chunk))
            rouge += sum(rouge_l(got, ex.inputs.answer) for got, ex in zip(answers, chunk))
            batch = to_device(collate(chunk), device)
            scores, targets = answer_logits(model_logits(model, batch), batch["labels"])
            loss_sum += float(F.cross_entropy(scores.float(), targets, reduction="sum"))
            tokens += targets.numel()
    finally:
        model.train(was_training)
    n = len(examples)
    return {"exact_match": correct / n, "rouge_l": rouge / n, "answer_loss": loss_sum / max(tokens, 1)}


def evaluate_generation(
    model: nn.Module, examples: Sequence[Example], collate: Collate, device: torch.device, **options: Any
) -> float:
    """Exact match of greedy generation (KV cache, at most the longest answer plus eos new tokens, or the collate's
    ``max_new_tokens``, stopping at eos) against each example's answer, as a fraction of ``examples``: the
    ``exact_match`` of :func:`generation_scores`, which takes the same arguments (``options``: ``batch_size``,
    ``progress``, ``desc``).
    """
    return generation_scores(model, examples, collate, device, **options)["exact_match"]


def prompt_query(separator_id: int) -> QueryFn:
    """PCLR's query for instruction sequences: :func:`~peft_ext.tuners.pclr.default_query` over the prompt tokens
    only, up to and including each row's last ``separator_id`` (all of the row if it has none). The collate refuses
    a separator in an answer, so the last one ends the prompt, also where a chat template writes it more than once.

    A training sequence holds prompt and answer, a generation prefill only the prompt; reading the prompt alone, the
    query (and so the ranks it selects) is the same in training, in the task's prototype, in distillation and at
    generation, where the prefill's query is kept for the decoding steps (:class:`~peft_ext.tuners.pclr.RoutingState`).
    Set it with ``model.base_model.set_query_fn(prompt_query(collate.separator_id))``.

    Args:
        separator_id: The token that ends every prompt (:attr:`CausalLMCollator.separator_id`).
    """

    def query(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Optional[torch.Tensor]:
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            ids = args[0]
        if ids is None or ids.dim() != 2:
            return default_query(model, args, kwargs)
        is_sep = (ids == separator_id).long()
        # positions up to and including the last separator (a separator at or after them); none: the whole row
        prompt = (is_sep.flip(1).cumsum(1).flip(1) > 0) | (is_sep.sum(1, keepdim=True) == 0)
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.shape == ids.shape:
            prompt = prompt & mask.bool()
        return default_query(model, args, {**kwargs, "input_ids": ids, "attention_mask": prompt.long()})

    return query


@torch.no_grad()
def text_perplexity(
    model: nn.Module,
    texts: Sequence[str],
    collate: CausalLMCollator,
    device: torch.device,
    batch_size: int = 32,
) -> float:
    """Per-token perplexity of ``model`` on plain ``texts`` (no prompt, no chat template): ``exp`` of the mean
    next-token cross-entropy over every token after each text's first, its eos included.

    What it measures on text no task trained on is the model's general language ability; compared before and after a
    task sequence, what continual tuning cost it.

    Args:
        model: A causal LM (or a PeftModel of one).
        texts: Non-empty texts.
        collate: Encodes the texts (its tokenizer, eos and pad ids).
        device: Where the model runs.
        batch_size: Texts per forward pass.
    """
    if not texts:
        raise ValueError("text_perplexity needs at least one text")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, len(texts), batch_size):
            rows = [collate.encode(t) + [collate.eos_token_id] for t in texts[start : start + batch_size]]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), collate.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = 1
            labels = ids.masked_fill(mask == 0, -100)
            labels[:, 0] = -100  # the first token has nothing before it to be predicted from
            batch = to_device({"input_ids": ids, "attention_mask": mask, "labels": labels}, device)
            scores, targets = answer_logits(model_logits(model, batch), batch["labels"])
            total += float(F.cross_entropy(scores.float(), targets, reduction="sum"))
            count += targets.numel()
    finally:
        model.train(was_training)
    return float(torch.tensor(total / max(count, 1)).exp())
