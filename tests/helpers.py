"""Shared test fixtures: a tiny text classifier and a small, learnable synthetic task sequence.

The synthetic sequence is only for mechanical runner tests (fast, exact); quality is measured on real data.
"""

from __future__ import annotations

import torch
from torch import nn

from peft_ext.continual import TrainConfig, run_sequence
from peft_ext.data.tasks import Example, Task, TaskSequence
from peft_ext.models import SentenceClassifier, tiny_bert


def tiny_classifier(num_labels: int, seed: int = 0) -> SentenceClassifier:
    return SentenceClassifier(tiny_bert(vocab_size=64, hidden_size=32, seed=seed).bert, num_labels, dropout=0.0)


def token_sequence(n_tasks: int = 3, classes_per_task: int = 2, per_class: int = 24, seed: int = 0) -> TaskSequence:
    """Class c's sentences are drawn from its own 4 token ids (plus shared noise), so classes are separable."""
    gen = torch.Generator().manual_seed(seed)
    n_classes = n_tasks * classes_per_task
    tasks = []
    for t in range(n_tasks):
        classes = list(range(t * classes_per_task, (t + 1) * classes_per_task))
        splits = {"train": [], "test": []}
        for c in classes:
            for split, n in (("train", per_class), ("test", per_class // 2)):
                for _ in range(n):
                    own = 4 + 4 * c + torch.randint(0, 4, (5,), generator=gen)
                    noise = torch.randint(4 + 4 * n_classes, 64, (3,), generator=gen)
                    splits[split].append(Example(torch.cat([own, noise]), c))
        tasks.append(Task(f"t{t}", classes, splits["train"], splits["test"]))
    return TaskSequence("tokens", [f"c{c}" for c in range(n_classes)], tasks)


def stack_collate(examples):
    ids = torch.stack([ex.inputs for ex in examples])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.tensor([e.label for e in examples]),
    }


QUERY_VALUE = ["query", "value"]


def lora_adapter(r: int, lora_alpha: float = 16.0) -> dict:
    """A LoRA ``adapter:`` section with the alpha and targets the LoRA methods used before they embedded LoraConfig."""
    return {"r": r, "lora_alpha": lora_alpha, "target_modules": list(QUERY_VALUE)}


def pclr_adapter(**fields) -> dict:
    """A PCLR ``adapter:`` section: what the ``pclr`` method used before it embedded PCLRConfig, then ``fields``."""
    base = {"pool_size": 64, "ranks_schedule": [16], "compress_schedule": [0.0, 0.0, 0.25], "top_k": 16, "alpha": 16.0}
    return {**base, "shared_r": 4, "shared_alpha": 8.0, "target_modules": list(QUERY_VALUE), **fields}


class ContractMLP(nn.Module):
    """Two hidden linears and a head, ``forward(x)`` like any model PEFT wraps: the tuner-contract test model.

    Hidden widths are 64: bitsandbytes' CPU 4-bit inference kernel (used on AVX512-BF16 machines) repacks the weight
    in blocks of 32 output rows and 64 input columns and refuses other shapes.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin0 = nn.Linear(64, 64)
        self.lin1 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin1(torch.tanh(self.lin0(x)))))


def run_recording_state(seq: TaskSequence, method, epochs: int = 2, batch_size: int = 8) -> tuple[dict, dict]:
    """``run_sequence`` of ``method`` over ``seq`` on :func:`tiny_classifier`; returns the result and the run
    context's ``state`` as it stood after the last ``after_task`` (what the method recorded there)."""
    recorded = {}
    original = method.after_task

    def after_task(model, task_id, task, ctx):
        out = original(model, task_id, task, ctx)
        recorded.update(ctx.state)
        return out

    method.after_task = after_task
    config = TrainConfig(epochs=epochs, batch_size=batch_size, progress=False)
    return run_sequence(seq, method, tiny_classifier(seq.num_classes), stack_collate, config), recorded
