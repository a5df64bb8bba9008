"""SplitLoRA variants of the plasticity ablation (``python -m benchmarks.splitlora_ablation``): the method that records
each task's split, the within-task accuracy measure, and the adaptive rule that raises the trade-off or the next
task's ``A`` norm when a task is learnt worse than the first."""

from __future__ import annotations

from typing import Any

import torch

from peft_ext.continual.methods.splitlora import SplitLoRAMethod


class WithinTaskMixin:
    """Also measures, right after each task, its accuracy among its own classes on its scored examples (the
    task-incremental diagonal: how well the task itself was learned, without the confusion with earlier tasks'
    classes that the class-incremental diagonal adds), reported as ``within_task``."""

    def after_task(self, model: torch.nn.Module, task_id: int, task: Any, ctx: Any) -> torch.nn.Module:
        model = super().after_task(model, task_id, task, ctx)
        self.state.setdefault("within_task", []).append(own_classes_accuracy(model, task.test, task, ctx))
        return model

    def report(self, ctx: Any) -> dict[str, Any]:
        return {**super().report(ctx), "within_task": list(self.state.get("within_task", []))}


def own_classes_accuracy(model: torch.nn.Module, examples: list[Any], task: Any, ctx: Any) -> float:
    """Accuracy on ``examples`` when the model may only predict ``task``'s classes (no random numbers drawn)."""
    from peft_ext.continual.evaluation import evaluate

    torch_state = torch.get_rng_state()
    try:
        return evaluate(
            model,
            examples,
            task.classes,
            ctx.sequence.num_classes,
            ctx.collate,
            ctx.device,
            batch_size=ctx.train.eval_batch_size,
        )
    finally:
        torch.set_rng_state(torch_state)


class RecordedSplitLoRA(WithinTaskMixin, SplitLoRAMethod):
    """The ``splitlora`` method, unchanged, that also keeps what ``end_task`` returns (``k*`` and the primary
    dimension per module after each task) and reports it as ``splits``."""

    def build(self, base_model: torch.nn.Module, ctx: Any) -> torch.nn.Module:
        model = super().build(base_model, ctx)
        splits: list[dict[str, list[int]]] = self.state.setdefault("ablation_splits", [])
        end_task = model.end_task

        def recording(*args: Any, **kwargs: Any) -> Any:
            out = end_task(*args, **kwargs)
            splits.append({name: [s.k_star, s.primary] for name, s in out.items()})
            return out

        model.end_task = recording  # an instance attribute: this model only
        return model

    def report(self, ctx: Any) -> dict[str, Any]:
        return {**super().report(ctx), "splits": list(self.state.get("ablation_splits", []))}


class AdaptiveSplitLoRA(RecordedSplitLoRA):
    """SplitLoRA whose plasticity is raised from each task's measured new-task accuracy on held-out examples.

    After training task ``t`` (before its ``end_task``), the task's accuracy among its own classes is measured on its
    ``validation`` examples (held out: never trained on, never scored). The first task's is the reference: it learns
    with an unrestricted kaiming ``A``. When task ``t >= 1`` scores below ``tolerance`` times the reference, the knob
    is raised by ``factor`` for every later task (it never comes down):

    - ``knob="norm"``: the next tasks' ``A`` norm (``init_scaling: inverse_task`` gives ``||A_kaiming|| / (t + 1)``),
      capped at the kaiming norm (``init_scaling: constant``);
    - ``knob="trade_off"``: the ``trade_off`` of the split ``end_task`` is about to make (fewer primary directions).

    Args:
        options: The ``splitlora`` options.
        knob: ``"norm"`` or ``"trade_off"``.
        factor: How much the knob rises after a task that learned poorly.
        tolerance: A task learned poorly when its held-out accuracy is below ``tolerance`` x the first task's.
    """

    def __init__(self, options: Any, knob: str = "norm", factor: float = 2.0, tolerance: float = 0.9) -> None:
        super().__init__(options)
        if knob not in ("norm", "trade_off"):
            raise ValueError(f"`knob` must be 'norm' or 'trade_off', got {knob!r}")
        self.knob, self.factor, self.tolerance = knob, factor, tolerance

    @staticmethod
    def _layers(model: torch.nn.Module) -> list[Any]:
        return [m for m in model.modules() if hasattr(m, "splitlora_A") and "default" in m.splitlora_A]

    def before_task(self, model: torch.nn.Module, task_id: int, task: Any, ctx: Any) -> torch.nn.Module:
        if not task.validation:
            raise ValueError(f"the adaptive SplitLoRA needs held-out (validation) examples in task {task.name!r}")
        model = super().before_task(model, task_id, task, ctx)
        state = self.state.setdefault("adaptive", {"gain": 1.0, "accuracy": [], "gain_used": [], "trade_off": []})
        gain = state["gain"] if self.knob == "norm" and task_id > 0 else 1.0
        # at most the kaiming norm: inverse_task divided it by t + 1 (constant: already there)
        gain = min(gain, task_id + 1.0 if self.options.adapter.init_scaling == "inverse_task" else 1.0)
        if gain != 1.0:
            with torch.no_grad():
                for layer in self._layers(model):
                    layer.splitlora_A["default"].mul_(gain)
        state["gain_used"].append(gain)
        return model

    def after_task(self, model: torch.nn.Module, task_id: int, task: Any, ctx: Any) -> torch.nn.Module:
        state = self.state["adaptive"]
        accuracy = own_classes_accuracy(model, task.validation, task, ctx)
        state["accuracy"].append(accuracy)
        if task_id > 0 and accuracy < self.tolerance * state["accuracy"][0]:
            state["gain"] *= self.factor
            if self.knob == "trade_off":
                trade_off = model.peft_config["default"].trade_off * self.factor
                model.peft_config["default"].trade_off = trade_off
                for layer in self._layers(model):  # each layer's split reads its own reference to the config
                    layer.splitlora_config["default"].trade_off = trade_off
        state["trade_off"].append(model.peft_config["default"].trade_off)  # the split this end_task makes
        return super().after_task(model, task_id, task, ctx)

    def report(self, ctx: Any) -> dict[str, Any]:
        state = self.state.get("adaptive", {})
        return {**super().report(ctx), "adaptive": {k: v for k, v in state.items() if k != "gain"}}
