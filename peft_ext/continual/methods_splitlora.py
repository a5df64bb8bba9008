"""SplitLoRA and the subspace baselines it is compared with, as continual-learning method plugins.

- ``splitlora``: the SplitLoRA adapter type (``peft_ext.tuners.splitlora``, docs/methods.md (SplitLoRA)): per task,
  ``B``
  trains on a frozen ``A`` drawn in the minor subspace of the running input covariance of all earlier tasks; after
  the task its ``B A`` is folded into a frozen delta.
- ``inflora``: InfLoRA-style (Liang & Li, CVPR 2024). Before a task, ``A`` is fixed to the top-``r`` left singular
  vectors of ``(I - M M^T) C_new`` (``C_new``: the new task's input covariance under the current model); ``B`` trains.
  After the task, the memory ``M`` grows by the task's directions that a GPM energy threshold keeps.
- ``olora``: O-LoRA (Wang et al., EMNLP 2023 findings): a fresh LoRA per task with the orthogonality loss
  ``lambda_orth * sum_{i<t} |A_i A_t^T|_1`` between the new ``A`` and every earlier task's ``A``.
- ``osf``: PEFT's Orthogonal Subspace Fine-tuning, re-wrapped per task as PEFT's OSF guide describes, with a growing
  preserved rank. The guide unwraps with ``unload()``; in peft 0.21 OSF keeps its update outside the base weight, so
  ``unload()`` would drop the finished task; we ``merge_and_unload()`` instead.

The three re-wrapping baselines fold a finished task by merging its adapter into the (copied) backbone, which is the
same function as keeping it as a frozen adapter, and train the classification head in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..tuners import matches_targets
from ..tuners.splitlora import SplitLoRAConfig
from .methods import (
    AdapterOptions,
    ContinualMethod,
    LoraOptions,
    MethodOptions,
    head_module_name,
    register_continual_method,
    saved_head,
)

if TYPE_CHECKING:
    from ..data.tasks import Example, Task
    from .context import RunContext

__all__ = [
    "InfLoRAMethod",
    "InfLoRAOptions",
    "OLoRAMethod",
    "OLoRAOptions",
    "OSFMethod",
    "OSFOptions",
    "SplitLoRAMethod",
    "SplitLoRAOptions",
    "gpm_update",
    "inflora_A",
    "input_covariances",
    "run_forward",
]


# --- shared helpers --------------------------------------------------------------------------------------------------


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


def _unwrap(model: nn.Module) -> nn.Module:
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
    backbone = _unwrap(model)
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


# --- SplitLoRA -------------------------------------------------------------------------------------------------------


@dataclass
class SplitLoRAOptions(AdapterOptions):
    """Options of the ``splitlora`` method.

    Args:
        adapter: The :class:`~peft_ext.SplitLoRAConfig` (``r``, ``trade_off``, ``target_modules``, ``statistics``,
            ...); YAML ``adapter: {r: 10, target_modules: [query, value]}``. The method sets ``modules_to_save``
            (the head) and ``seed`` (``train.seed``).
    """

    method_owned: ClassVar[tuple[str, ...]] = ("modules_to_save", "seed")

    adapter: SplitLoRAConfig = field(default_factory=SplitLoRAConfig)


@register_continual_method
class SplitLoRAMethod(ContinualMethod):
    """SplitLoRA: each task trains LoRA's B on a frozen A in the minor subspace of all earlier tasks' inputs."""

    name = "splitlora"
    options_cls = SplitLoRAOptions
    task_kinds = ("classification", "generation")

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        from peft import get_peft_model

        seed = ctx.train.seed if ctx is not None else 0
        config = self.options.adapter_config(seed=seed, modules_to_save=saved_head(base_model, ctx))
        return get_peft_model(base_model, config)

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        index = model.begin_task()
        if index != task_id:
            raise ValueError(f"the SplitLoRA adapter has finished {index} tasks but the runner starts task {task_id}")
        return model

    def after_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        # The paper collects the task's inputs with the trained model, after training (public code: get_cur_feat).
        with model.collect_statistics():
            run_forward(model, task.train, ctx)
        model.end_task()
        return model


# --- the re-wrapping baselines ---------------------------------------------------------------------------------------


class _RewrapMethod(ContinualMethod):
    """Wraps a fresh PEFT adapter before every task and merges the previous one into the backbone."""

    rewraps_model = True

    def _fold(self, model: nn.Module) -> nn.Module:
        from peft import PeftModel

        return model.merge_and_unload() if isinstance(model, PeftModel) else model

    def between_tasks(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        # Folding here rather than in the next before_task gives the same numbers, and the model a snapshot is taken
        # of has the structure of a fresh build (the plain backbone), so a resumed run can load it.
        return self._fold(model)

    def _wrap(self, backbone: nn.Module, config: Any) -> nn.Module:
        from peft import get_peft_model

        model = get_peft_model(backbone, config)
        # The head is trained in place across tasks (like modules_to_save would, without a wrapper to unload).
        getattr(_unwrap(model), head_module_name(_unwrap(model))).requires_grad_(True)
        return model


@dataclass
class InfLoRAOptions(MethodOptions):
    """Options of the InfLoRA-style baseline.

    Args:
        r: Rank of each task's adapter.
        target_modules: Module-name suffixes to adapt.
        threshold_start: GPM energy threshold after the first task (InfLoRA's ``lamb``; its CIFAR-100 config: 0.95).
        threshold_end: Threshold the schedule moves towards, reached after the last task (``lame``; 1.0 there).
    """

    r: int = 10
    target_modules: list[str] = field(default_factory=lambda: ["query", "value"])
    threshold_start: float = 0.95
    threshold_end: float = 1.0

    def validate(self) -> None:
        super().validate()
        if self.r < 1:
            raise ValueError(f"`r` must be a positive integer, got {self.r}")
        if not self.target_modules:
            raise ValueError("`target_modules` must name at least one module, got an empty list")
        for key in ("threshold_start", "threshold_end"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"`{key}` must be in (0, 1], got {getattr(self, key)}")


def inflora_A(covariance: torch.Tensor, memory: torch.Tensor | None, r: int) -> torch.Tensor:
    """InfLoRA's frozen ``A``: the top-``r`` left singular vectors of ``(I - M M^T) C_new``, as rows, ``/ sqrt(3)``.

    The ``1 / sqrt(3)`` is the scale of InfLoRA's public code (a kaiming-uniform row's expected norm).

    Args:
        covariance: ``(n, n)`` input covariance of the new task.
        memory: ``(n, k)`` orthonormal basis ``M`` of the protected directions, or ``None``.
        r: Rank.

    Returns:
        ``A`` of shape ``(r, n)`` (float64).
    """
    c = covariance.to(torch.float64)
    if memory is not None and memory.shape[1]:
        c = c - memory @ (memory.T @ c)
    u, _, _ = torch.linalg.svd(c, full_matrices=False)
    return u[:, :r].T / math.sqrt(3)


def gpm_update(memory: torch.Tensor | None, covariance: torch.Tensor, threshold: float) -> torch.Tensor:
    """Grow the GPM memory by the task's directions that its energy threshold keeps (InfLoRA's ``update_GPM``).

    As in InfLoRA's public code, the "representation" whose energy is thresholded is the covariance itself, so a
    direction's energy is its squared eigenvalue. First task: keep the leading directions whose cumulative energy
    stays below ``threshold`` (at least one). Later tasks: the energy already captured by ``M`` counts first; add the
    leading directions of ``(I - M M^T) C`` until the captured share reaches ``threshold``.

    Args:
        memory: ``(n, k)`` orthonormal basis, or ``None`` before the first task.
        covariance: ``(n, n)`` input covariance of the finished task.
        threshold: Energy share in ``(0, 1]``.

    Returns:
        The new ``(n, k')`` basis, ``k <= k' <= n``.
    """
    c = covariance.to(torch.float64)
    n = c.shape[0]
    _, s, _ = torch.linalg.svd(c, full_matrices=False)
    total = float(s.square().sum())
    if total <= 0:
        raise ValueError("the task's input covariance is zero; no directions to protect")
    if memory is None or memory.shape[1] == 0:
        u, s, _ = torch.linalg.svd(c, full_matrices=False)
        keep = int((torch.cumsum(s.square(), 0) / total < threshold).sum())
        return u[:, : max(keep, 1)]
    residual = c - memory @ (memory.T @ c)
    u, s_hat, _ = torch.linalg.svd(residual, full_matrices=False)
    ratios = s_hat.square() / total
    captured = (total - float(s_hat.square().sum())) / total
    keep = 0
    while keep < ratios.numel() and captured < threshold:
        captured += float(ratios[keep])
        keep += 1
    return torch.cat([memory, u[:, :keep]], dim=1)[:, :n]


@register_continual_method
class InfLoRAMethod(_RewrapMethod):
    """InfLoRA-style: A from the new task's inputs projected away from a GPM memory of old directions; B trains."""

    name = "inflora"
    options_cls = InfLoRAOptions

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        from peft import LoraConfig

        opts = self.options
        backbone = self._fold(model)
        memory: dict[str, torch.Tensor] = ctx.state.setdefault("inflora_memory", {})
        covariances = input_covariances(backbone, opts.target_modules, task.train, ctx)
        # lora_alpha = r makes PEFT's scale 1, as in InfLoRA (y = W x + B A x).
        config = LoraConfig(r=opts.r, lora_alpha=opts.r, target_modules=list(opts.target_modules))
        model = self._wrap(backbone, config)
        for name, module in _unwrap(model).named_modules():
            if name in covariances:
                weight = module.lora_A["default"].weight
                with torch.no_grad():
                    weight.copy_(inflora_A(covariances[name], memory.get(name), opts.r).to(weight.dtype))
                weight.requires_grad_(False)
        return model

    def after_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        opts = self.options
        steps = max(len(ctx.sequence), 1)
        threshold = opts.threshold_start + (opts.threshold_end - opts.threshold_start) * task_id / steps
        memory: dict[str, torch.Tensor] = ctx.state.setdefault("inflora_memory", {})
        for name, covariance in input_covariances(model, opts.target_modules, task.train, ctx).items():
            memory[name] = gpm_update(memory.get(name), covariance, threshold)
        return model


@dataclass
class OLoRAOptions(LoraOptions):
    """Options of the O-LoRA baseline (LoRA options plus the two regularizer weights).

    Args:
        lambda_orth: Weight of the orthogonality loss ``sum_{i<t} |A_i A_t^T|_1`` (O-LoRA's ``lamda_1``: 0.5).
        lambda_l2: Weight of the L2 penalty on the new task's LoRA weights (``lamda_2``; 0 in O-LoRA's scripts).
    """

    lambda_orth: float = 0.5
    lambda_l2: float = 0.0

    def validate(self) -> None:
        super().validate()
        for key in ("lambda_orth", "lambda_l2"):
            if getattr(self, key) < 0:
                raise ValueError(f"`{key}` must be >= 0, got {getattr(self, key)}")


@register_continual_method
class OLoRAMethod(_RewrapMethod):
    """O-LoRA: a fresh LoRA per task, kept orthogonal to earlier tasks' LoRA A by a loss term.

    Each finished task's ``A`` is recorded in ``after_task``, while its adapter is still there: ``between_tasks``
    merges it into the backbone before the next ``before_task`` runs. The run's report gives, per task, the rows of
    earlier ``A`` the penalty covered and the trained ``A``'s overlap ``sum |A_i A_t^T|`` with them.
    """

    name = "olora"
    options_cls = OLoRAOptions

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        old: dict[str, list[torch.Tensor]] = ctx.state.setdefault("olora_A", {})
        finished = {len(mats) for mats in old.values()} or {0}
        if finished != {task_id}:
            raise ValueError(
                f"O-LoRA holds the A of {sorted(finished)} finished tasks per layer but the runner starts task "
                f"{task_id}; was a task's after_task skipped?"
            )
        model = self._wrap(self._fold(model), self.options.adapter_config())
        device = next(model.parameters()).device
        self._old = {name: torch.cat(mats).to(device) for name, mats in old.items()}
        return model

    def after_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        old: dict[str, list[torch.Tensor]] = ctx.state.setdefault("olora_A", {})
        overlap = 0.0
        for name, layer in self._lora_layers(model):
            a = layer.lora_A["default"].weight.detach()
            if name in self._old:
                overlap += float((self._old[name].to(a.dtype) @ a.T).abs().sum())
            old.setdefault(name, []).append(a.cpu().clone())
        ctx.state.setdefault("olora_old_rows", []).append(sum(m.shape[0] for m in self._old.values()))
        ctx.state.setdefault("olora_overlap", []).append(overlap)
        return model

    @staticmethod
    def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        if not isinstance(model, PeftModel):
            return []
        return [(n, m) for n, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)]

    def extra_loss(self, model: nn.Module, batch: dict[str, Any], task_id: int) -> torch.Tensor | None:
        opts = self.options
        terms = []
        for name, layer in self._lora_layers(model):
            a = layer.lora_A["default"].weight
            if opts.lambda_orth and name in self._old:
                terms.append(opts.lambda_orth * (self._old[name].to(a.dtype) @ a.T).abs().sum())
            if opts.lambda_l2:
                b = layer.lora_B["default"].weight
                terms.append(opts.lambda_l2 * (a.square().sum() + b.square().sum()))
        return torch.stack(terms).sum() if terms else None

    def report(self, ctx: RunContext) -> dict[str, Any]:
        return {
            "old_A_rows": list(ctx.state.get("olora_old_rows", [])),
            "orth_overlap": list(ctx.state.get("olora_overlap", [])),
        }


@dataclass
class OSFOptions(MethodOptions):
    """Options of the PEFT OSF baseline.

    Args:
        target_modules: Module-name suffixes to adapt.
        preserved_start: Preserved (frozen) share of each weight's singular directions for the first task
            (PEFT's default effective rank: 0.5).
        preserved_end: Preserved share for the last task; in between it grows linearly, as the OSF guide grows the
            preserved rank after every task.
    """

    target_modules: list[str] = field(default_factory=lambda: ["query", "value"])
    preserved_start: float = 0.5
    preserved_end: float = 0.9

    def validate(self) -> None:
        super().validate()
        if not self.target_modules:
            raise ValueError("`target_modules` must name at least one module, got an empty list")
        for key in ("preserved_start", "preserved_end"):
            if not 0 < getattr(self, key) < 1:
                raise ValueError(f"`{key}` must be in (0, 1), got {getattr(self, key)}")
        if self.preserved_end < self.preserved_start:
            raise ValueError(
                f"`preserved_end` ({self.preserved_end}) must be >= `preserved_start` ({self.preserved_start})"
            )


@register_continual_method
class OSFMethod(_RewrapMethod):
    """PEFT's OSF: trains each weight's minor singular subspace; re-wrapped per task with a growing preserved rank."""

    name = "osf"
    options_cls = OSFOptions

    def preserved_share(self, task_id: int, n_tasks: int) -> float:
        """Fraction of singular directions OSF freezes for ``task_id``."""
        opts = self.options
        progress = task_id / max(n_tasks - 1, 1)
        return opts.preserved_start + (opts.preserved_end - opts.preserved_start) * progress

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        from peft import OSFConfig

        share = self.preserved_share(task_id, len(ctx.sequence))
        config = OSFConfig(effective_rank=share, target_modules=list(self.options.target_modules))
        return self._wrap(self._fold(model), config)
