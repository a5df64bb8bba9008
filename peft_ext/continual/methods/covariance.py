"""Forward passes over a task's data for hooks to read, and the input covariances of adapted modules (what InfLoRA's
subspace is drawn from)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...tuners import matches_targets

if TYPE_CHECKING:
    from ...data.tasks import Example
    from ..context import RunContext

__all__ = ["backbone_of", "input_covariances", "run_forward"]


def run_forward(
    model: nn.Module,
    examples: Sequence[Example],
    ctx: RunContext,
    on_batch: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Run ``model`` (eval mode, no grad) over ``examples`` in evaluation-sized batches, for forward hooks to see.

    Args:
        model: The model.
        examples: The data.
        ctx: The run context (collate, device, batch size).
        on_batch: Called with each batch's inputs just before its forward pass.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in ctx.iter_batches(examples, ctx.train.eval_batch_size):
                inputs = {k: v for k, v in batch.items() if k != "labels"}
                if on_batch is not None:
                    on_batch(inputs)
                model(**inputs)
    finally:
        model.train(was_training)


def _base_layer(module: nn.Module) -> nn.Module:
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def backbone_of(model: nn.Module) -> nn.Module:
    """The plain backbone: a PeftModel's base model, else the model itself."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def input_covariances(
    model: nn.Module, targets: Sequence[str], examples: Sequence[Example], ctx: RunContext
) -> dict[str, torch.Tensor]:
    """Uncentered input covariance (mean of ``x x^T`` over real tokens) of every module named in ``targets``.

    Padded positions (``attention_mask == 0``) are skipped, as in SplitLoRA's own statistics.

    Args:
        model: A plain model or a PeftModel (hooks go on the backbone's modules, wrapped or not).
        targets: Module-name suffixes, matched like PEFT's ``target_modules`` lists.
        examples: The data.
        ctx: The run context (collate, device, batch size).

    Returns:
        ``{module name in the backbone: (n, n) float64 covariance}``.
    """
    backbone = backbone_of(model)
    modules = {
        name: module
        for name, module in backbone.named_modules()
        if matches_targets(name, targets) and isinstance(_base_layer(module), nn.Linear)
    }
    if not modules:
        raise ValueError(f"no nn.Linear module matches target_modules {list(targets)}")
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = dict.fromkeys(modules, 0)
    mask: list[torch.Tensor | None] = [None]

    def hook(name: str, module: nn.Module, args: tuple) -> None:
        x = args[0].detach()
        m = mask[0]
        rows = x[m.bool()] if m is not None and tuple(x.shape[:-1]) == tuple(m.shape) else x.reshape(-1, x.shape[-1])
        rows = rows.float()  # float32 sums (as SplitLoRA's own statistics): float64 would double the pass's cost
        if name not in sums:
            sums[name] = torch.zeros(rows.shape[1], rows.shape[1], dtype=torch.float32, device=rows.device)
        sums[name].addmm_(rows.T, rows)
        counts[name] += rows.shape[0]

    handles = [
        module.register_forward_pre_hook(lambda mod, args, n=name: hook(n, mod, args))
        for name, module in modules.items()
    ]
    try:
        run_forward(model, examples, ctx, on_batch=lambda inputs: mask.__setitem__(0, inputs.get("attention_mask")))
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name, count in counts.items() if count == 0]
    if missing:
        raise ValueError(f"module {missing[0]!r} received no inputs; is it used by the model's forward?")
    return {name: sums[name].double() / counts[name] for name in modules}
