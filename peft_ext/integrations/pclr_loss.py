"""PCLR's query-key loss in ``transformers.Trainer``: a ``compute_loss_func`` that adds it to the task loss.

PCLR's keys learn only through ``w * mean(1 - cos(q, k))`` over the selected keys (docs/methods.md (PCLR)); a model's
own ``outputs.loss`` does not contain it, so a plain ``Trainer`` would leave the keys untrained. Pass
``Trainer(..., compute_loss_func=pclr_loss_func(model))``: Trainer then pops ``labels`` from each batch, calls the
model without them and this function computes the task loss (causal-LM or classification cross entropy, or your
own) plus the query-key loss of that same forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..tuners.pclr import query_loss
from ..tuners.pclr.pool import pclr_tuner

__all__ = ["pclr_loss_func"]

#: ``task_loss(outputs, labels, num_items_in_batch) -> scalar``.
TaskLoss = Callable[[Any, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def _default_task_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Optional[torch.Tensor]) -> torch.Tensor:
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    if logits.dim() == 3 and labels.shape == logits.shape[:2]:
        # next-token prediction: position t predicts token t + 1; -100 (padding, prompt) is ignored
        logits, labels = logits[:, :-1], labels[:, 1:]
        total = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten().to(logits.device), ignore_index=-100, reduction="sum"
        )
        count = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
        return total / torch.as_tensor(count, device=total.device).clamp_min(1)
    if logits.dim() == 2 and labels.dim() == 1 and labels.shape[0] == logits.shape[0]:
        return F.cross_entropy(logits.float(), labels.to(logits.device), ignore_index=-100)
    raise ValueError(
        f"pclr_loss_func cannot infer the task loss for logits of shape {tuple(logits.shape)} and labels of shape "
        f"{tuple(labels.shape)}: it knows causal LM (logits (batch, seq, vocab), labels (batch, seq)) and "
        "classification (logits (batch, classes), labels (batch,)); pass task_loss=your_loss(outputs, labels, "
        "num_items_in_batch)"
    )


def pclr_loss_func(model: nn.Module, task_loss: Optional[TaskLoss] = None) -> Callable[..., torch.Tensor]:
    """A ``compute_loss_func`` for ``transformers.Trainer`` that adds PCLR's query-key loss to the task loss.

    Args:
        model: The PCLR ``PeftModel`` the Trainer trains (its last forward pass's query-key loss is added).
        task_loss: ``task_loss(outputs, labels, num_items_in_batch)``; default: causal-LM cross entropy (labels
            shifted by one, ``-100`` ignored, divided by ``num_items_in_batch`` under gradient accumulation) for
            3-d logits, cross entropy for 2-d logits.

    Returns:
        ``loss_func(outputs, labels, num_items_in_batch=None)``. In evaluation (no gradients) the query-key loss is
        ``None`` and only the task loss is returned.

    Example::

        Trainer(model=model, args=args, train_dataset=data, compute_loss_func=pclr_loss_func(model)).train()
    """
    pclr_tuner(model)  # raises now (TypeError naming the model) if it has no PCLR adapter
    compute_task = task_loss or _default_task_loss

    def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Optional[torch.Tensor] = None):
        loss = compute_task(outputs, labels, num_items_in_batch)
        keys = query_loss(model)
        return loss if keys is None else loss + keys.to(loss.dtype)

    return loss_func
