"""Data, models and byte counts that several benchmarks use."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "eval_loss",
    "fixed_windows",
    "minilm",
    "plot_loss_curves",
    "random_windows",
    "state_bytes",
    "tensor_bytes",
    "wordnet_all_classes",
]


def wordnet_all_classes(
    train_per_class: int, test_per_class: int, val_per_class: int = 0, classes: int | None = None
) -> Any:
    """One task with every supersense that has enough synsets (or the first ``classes`` of them; data seed 0), with
    a validation split when asked (synsets disjoint from train and test)."""
    from peft_ext.data.wordnet import class_counts, wordnet_task_sequence

    need = train_per_class + val_per_class
    eligible = sum(1 for c in class_counts().values() if c["train"] >= need and c["test"] >= test_per_class)
    return wordnet_task_sequence(
        n_tasks=1,
        classes_per_task=classes or eligible,
        seed=0,
        train_per_class=train_per_class,
        test_per_class=test_per_class,
        val_per_class=val_per_class,
    )


def minilm(num_classes: int, max_length: int) -> tuple[nn.Module, Any]:
    """The real pretrained MiniLM-L6 classifier (head drawn after ``torch.manual_seed(0)``) and its collator."""
    from peft_ext.data.collate import TextCollator
    from peft_ext.models import load_text_classifier

    torch.manual_seed(0)
    model, tokenizer = load_text_classifier("minilm", num_classes)
    return model, TextCollator(tokenizer, max_length)


def causal_lm(name: str, layers: int | None = None) -> tuple[nn.Module, Any]:
    """A packaged causal LM (``peft_ext.models.load_causal_lm``) and its tokenizer; ``layers`` keeps only the first
    decoder layers (smoke runs: the real tokenizer, embeddings and chat template, a fraction of the compute)."""
    from peft_ext.models import load_causal_lm

    model, tokenizer = load_causal_lm(name)
    if layers is not None:
        total = len(model.model.layers)
        if not 1 <= layers <= total:
            raise ValueError(f"--layers must be in [1, {total}] ({name}'s decoder layers), got {layers}")
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers  # the KV cache is sized from the config
    return model, tokenizer


# -- byte-level causal LM (causal_lm_bf16, pretrain_llama) ------------------------------------------------------------


def random_windows(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` windows of ``seq`` bytes at random starts of ``stream`` (drawn from ``gen``)."""
    starts = torch.randint(0, stream.numel() - seq, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq] for s in starts.tolist()])


def fixed_windows(stream: torch.Tensor, count: int, seq: int) -> torch.Tensor:
    """``count`` evenly spaced windows: the same evaluation set for every method and seed."""
    starts = torch.linspace(0, stream.numel() - seq - 1, count).long()
    return torch.stack([stream[s : s + seq] for s in starts.tolist()])


@torch.no_grad()
def evaluation_windows(streams: dict[str, torch.Tensor], count: int, seq: int, **keys: str) -> dict[str, Any]:
    """``{"train": streams["train"], key: fixed_windows(streams[name], count, seq) for key=name in keys}``: the
    training stream whole and each evaluation stream cut into the same ``count`` windows of ``seq`` tokens."""
    return {"train": streams["train"], **{key: fixed_windows(streams[name], count, seq) for key, name in keys.items()}}


def eval_loss(model: nn.Module, windows: torch.Tensor, batch: int = 32) -> float:
    """Mean next-token loss of ``model`` over ``windows`` (eval mode, then back to train mode)."""
    model.eval()
    losses = [model(input_ids=w, labels=w).loss.item() for w in windows.split(batch)]
    model.train()
    return sum(losses) / len(losses)


# -- bytes ----------------------------------------------------------------------------------------------------------


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable from ``obj`` (dicts, lists, and attributes of objects such as GaLore's
    projector, whose ``ortho_matrix`` lives in the optimizer state)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors directly in ``optimizer.state`` (each parameter's moments, step counters, ...)."""
    return sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )


def plot_loss_curves(
    curves: dict[str, list[list[tuple[int, float]]]], path: Any, title: str, top: float | None = None
) -> None:
    """Validation loss against step, one line per label (the mean over its runs, ± sd band with several runs):
    ``curves`` maps a label to its runs' ``[(step, loss), ...]``; ``top`` caps the y axis."""
    from pathlib import Path

    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    for label, runs in curves.items():
        steps = [s for s, _ in runs[0]]
        values = torch.tensor([[v for _, v in run] for run in runs])
        mean = values.mean(0)
        (line,) = ax.plot(steps, mean, label=label)
        if len(runs) > 1:
            sd = values.std(0)
            ax.fill_between(steps, mean - sd, mean + sd, alpha=0.15, color=line.get_color())
    ax.set_xlabel("training step")
    ax.set_ylabel("validation loss (nats / byte)")
    if top is not None:
        ax.set_ylim(top=min(ax.get_ylim()[1], top))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
