"""SubspaceAdamW: AdamW whose moments live in a rank-r subspace of each projected matrix, chosen without any SVD.

The general optimizer of DCT-AdamW's family. What varies is two objects per param group: the subspace basis
(:mod:`peft_ext.optim.bases`: the DCT selection, plain coordinates, or a power-iteration basis; ``basis=``) and the
update rule (:mod:`peft_ext.optim.update_rules`: the projected direction, or APOLLO's channel scaling; ``update=``),
both looked up in one registry (:mod:`peft_ext.optim.components`) and each declaring and validating its own options.
One orchestrating step calls them; Adam's arithmetic is :func:`~peft_ext.optim.adam_math.adam_direction`, moment
storage (8-bit buffers) :mod:`peft_ext.optim.subspace_state`, non-finite gradients :mod:`peft_ext.optim.nonfinite`.
:class:`~peft_ext.optim.DCTAdamW` is the preset of the paper (arXiv 2505.17967): ``basis="dct"``, refreshed every step.

Every option lives in the param groups (the parts as a name plus their options), so ``state_dict()``,
``copy.deepcopy`` and pickling keep all of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..distributed import (
    all_reduce_over_row_shards_,
    check_parameters_unchanged,
    is_dtensor,
    local_part,
    registered_parameters,
)
from ..precision import compute_dtype
from .adam_math import adam_direction
from .bases import Moments, SubspaceBasis, SubspaceSpec
from .components import KINDS, component_class
from .nonfinite import caller_stacklevel, check_gradients, nonfinite_policy, skipped_steps
from .saved_state import restore_saved_dtypes
from .subspace_checks import (
    check_group,
    check_lr,
    drop_foreign_options,
    param_name,
    parts_from_options,
    planned_rank,
    resolve_group,
    restore_group,
    side_of,
    unmatched_targets,
)
from .subspace_state import load_buffer, store_buffer
from .update_rules import ProjectedStep, UpdateRule

__all__ = ["SubspaceAdamW"]

#: What the optimizers take as ``params``: tensors, ``(name, tensor)`` pairs (names enable ``target_modules``) or
#: param-group dicts.
Params = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]]


class SubspaceAdamW(Optimizer):
    """AdamW with low-rank moments in an SVD-free subspace per projected matrix; by default a power-iteration basis.

    For a projected ``(R, C)`` matrix with ``R >= C`` (else mirrored, see :mod:`peft_ext.optim.dct`) the moments
    live in an ``r``-dimensional subspace of the columns, given by an ``(r, C)`` basis ``B`` with orthonormal rows.
    Every ``update_proj_gap`` steps the basis is refreshed from the gradient (:meth:`SubspaceBasis.select
    <peft_ext.optim.bases.SubspaceBasis.select>`) and the moments are carried into it; each step runs Adam on
    ``a = G B^T`` (``R x r``) and applies ``p <- p (1 - lr wd) - lr * scale * U`` with ``U`` from the update rule
    (``adam(a) B`` for ``update="projected"``). Everything else (vectors, matrices with a dimension ``>= max_shape``
    such as embeddings and LM heads, matrices outside ``target_modules``) gets plain AdamW inside the same optimizer.

    The default basis (``basis="power"``) moves by one block power iteration on the gradient, warm-started from
    the previous basis (the first one from the DCT selection), every 50 steps: two ``O(m n r)`` products and a QR of
    an ``n x r`` matrix per refresh, and an ``r x n`` float32 basis stored per matrix. :class:`DCTAdamW
    <peft_ext.optim.DCTAdamW>` is the paper's preset (the DCT selection, ``r`` integers per matrix, every step).

    When not to use it: tiny models (the projection saves nothing worth its approximation), LoRA-style adapters whose
    matrices already have a dimension of ``r`` (nothing to compress), or tensor-parallel / DeepSpeed ZeRO training
    (column shards and flat partitions are rejected with a ``ValueError``; DDP and FSDP2's row shards are supported,
    see docs/distributed.md).

    Half precision: bfloat16 / float16 parameters are stepped in float32 (the transform, Adam's arithmetic and the
    update, rounded into the parameter once); their moments are stored in float32, the error-feedback buffer (as
    large as the parameter) in the parameter's dtype.

    Decisions left open by the papers, and what this implementation does:

    * ``rank`` larger than a matrix's projected dimension ``n``: clamped to ``n``, with one ``UserWarning`` naming
      every such matrix when their state is created. At ``r = n`` the update is Adam in a rotated basis (no memory
      saving); use ``target_modules`` to give those matrices plain AdamW instead. Not an error, because one ``rank``
      usually serves matrices of many shapes (a classifier head may be narrower than ``r``).
    * Non-finite gradients: checked on every parameter before anything is modified (:mod:`peft_ext.optim.nonfinite`).
      ``nonfinite="raise"`` (default) raises :class:`~peft_ext.optim.nonfinite.NonFiniteGradientError` (a
      ``FloatingPointError`` and a ``ValueError``) naming the parameter; ``"skip"`` skips the whole step (no
      parameter, moment or counter changes) with a ``UserWarning``, counted in :attr:`skipped_steps` (saved with the
      param groups in ``state_dict()``).
    * A basis vector that enters the selection (``basis="dct"`` or ``"coordinates"``) starts with zero moments
      (docs/methods.md (DCT-AdamW)). By default its bias correction uses the parameter's step count, as in the
      public code; its first updates are then 3 to 6.5 times Adam's unit step (``(1 - beta1^k) / sqrt(1 - beta2^k)``
      after ``k`` updates, before the moments fill). With the basis option ``column_bias_correction=True`` each one
      is corrected by
      its own age, so a new column starts exactly like a fresh Adam coordinate. In a small ablation
      (docs/dct_adamw.md, table 4) that helped only at the highest learning rate with the smallest rank and was
      slightly worse elsewhere, so the paper's behaviour stays the default.

    Args:
        params: Parameters or param groups. Pass ``model.named_parameters()`` (or groups of ``(name, param)``
            pairs) when using ``target_modules``. Every option below except ``sync_indices`` and ``nonfinite`` can be
            set per group, ``basis`` and ``update`` too (a group takes its parts' options from its own keys, then
            from the optimizer's when it names the same part).
        lr: Learning rate.
        rank: Subspace dimension ``r`` per projected matrix; a projected ``(R, C)`` matrix keeps ``2 max(R, C) r``
            moment entries instead of AdamW's ``2 R C``.
        update_proj_gap: Refresh the basis every this many steps (:class:`DCTAdamW <peft_ext.optim.DCTAdamW>`: 1,
            since a DCT refresh costs one transform).
        betas: Adam's ``(beta1, beta2)``.
        eps: Adam's epsilon.
        weight_decay: Decoupled weight decay, applied to the full parameter as in AdamW.
        scale: Multiplier on the projected matrices' update (GaLore's ``scale``; not applied to weight decay or to
            plain-AdamW parameters). A rank-``r`` update moves a matrix less than a full Adam step at the same
            ``lr``; GaLore's README uses 0.25 with lr 0.01 for pre-training and 4 with lr ~3e-5 for fine-tuning.
        target_modules: Which matrices are projected: ``None`` (every 2-D parameter below ``max_shape``), a list of
            module names matched as whole dotted components (``["query", "value", "dense"]``), or a regex string
            matched against the full module name. Others get plain AdamW.
        max_shape: Matrices with a dimension ``>= max_shape`` get plain AdamW (embeddings and LM heads, whose rows
            are sparse updates rather than a low-rank signal).
        rotate_moments: When the basis changes, carry the moments into the new one (:meth:`SubspaceBasis.carry
            <peft_ext.optim.bases.SubspaceBasis.carry>`: for the DCT and coordinates, columns present in both
            selections keep theirs and new ones start at zero, the rotation of docs/methods.md (DCT-AdamW)). Off:
            moments stay positional, as in GaLore, and are reinterpreted in the new basis.
        moments_8bit: Store both moments (projected and plain-AdamW ones, from ``min_8bit_size`` entries) 8-bit with
            bitsandbytes' blockwise dynamic quantization. Saves 3/4 of the moment memory; see the tolerance measured
            in the tests. On CPU it costs time (every step de- and re-quantizes), and bitsandbytes' CPU library
            links the system libgomp while torch bundles its own: with more than one torch thread both OpenMP
            runtimes spin-wait for the same cores and a step can be 30x slower. Use one torch thread or
            ``OMP_WAIT_POLICY=PASSIVE`` there.
        quant_blocksize: Block size of the 8-bit quantization.
        min_8bit_size: Buffers with fewer entries stay 32-bit even in 8-bit mode: biases and norms, whose state is
            negligible and whose few blocks would gain nothing (bitsandbytes' 8-bit optimizers use the same 4096).
        side: Which dimension is compressed: ``"auto"`` (the smaller one, as the paper; always ``"right"`` for a
            DTensor, FSDP2's row shard, so each process projects its own rows), ``"right"`` (columns: moments
            ``R x r``) or ``"left"`` (rows: ``r x C``; refused for row-sharded matrices). One process with
            ``side="right"`` reproduces an FSDP2 run exactly where ``"auto"`` would pick ``"left"`` (``R < C``).
        sync_indices: Broadcast each refreshed basis from rank 0 (``r`` integers, or the ``r x n`` basis, per
            matrix). ``None``: whenever ``torch.distributed`` is initialized with more than one process. DDP already
            gives every rank the same gradient, so this guards against reductions that are not bit-identical across
            ranks.
        nonfinite: ``"raise"`` or ``"skip"``; see above.
        basis: The basis, an object (:class:`~peft_ext.optim.bases.DCTBasis`, ``CoordinateBasis``, ``PowerBasis``)
            or its name: ``"power"`` (default here), ``"dct"`` (the paper's ``r`` DCT-II basis vectors with the
            largest scores) or ``"coordinates"`` (the ``r`` plain columns / rows with the largest gradient norm).
        update: The update rule, an object (:class:`~peft_ext.optim.update_rules.ProjectedUpdate`,
            ``ChannelUpdate``) or its name: ``"projected"`` (the low-rank Adam direction mapped back) or
            ``"channel"`` (APOLLO's rule: the whole gradient scaled per channel by the ratio the low-rank Adam state
            estimates).
        **options: With ``basis`` / ``update`` given by name, their options, each passed to the part that declares
            it: ``selection_norm``, ``dct_method``, ``column_bias_correction`` (the bases'), ``error_feedback``,
            ``error_feedback_8bit`` (``"projected"``'s), ``norm_growth_limit`` (``"channel"``'s); see those classes.
            An option the chosen parts do not declare is a ``TypeError`` naming who does. ``projection=`` is the
            deprecated name of ``basis=``.

    Example: ``SubspaceAdamW(named, basis=DCTBasis(dct_method="fft"), update=ChannelUpdate(norm_growth_limit=None))``
    is ``SubspaceAdamW(named, basis="dct", dct_method="fft", update="channel", norm_growth_limit=None)``.
    """

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        rank: int = 128,
        update_proj_gap: int = 50,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        basis: SubspaceBasis | str = "power",
        update: UpdateRule | str = "projected",
        scale: float = 1.0,
        target_modules: str | Sequence[str] | None = None,
        max_shape: int = 32_000,
        side: str = "auto",
        rotate_moments: bool = True,
        moments_8bit: bool = False,
        quant_blocksize: int = 256,
        min_8bit_size: int = 4096,
        sync_indices: bool | None = None,
        nonfinite: str = "raise",
        **options: Any,
    ) -> None:
        owner = type(self).__name__
        check_lr(lr, owner)
        if sync_indices not in (None, True, False):
            raise TypeError(f"`sync_indices` must be None, True or False, got {sync_indices!r}")
        basis, update = parts_from_options(basis, update, options, owner)
        defaults = {
            "lr": lr,
            "rank": rank,
            "update_proj_gap": update_proj_gap,
            "betas": tuple(betas) if isinstance(betas, (list, tuple)) else betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "scale": scale,
            "target_modules": list(target_modules) if isinstance(target_modules, (list, tuple)) else target_modules,
            "max_shape": max_shape,
            "side": side,
            "rotate_moments": rotate_moments,
            "moments_8bit": moments_8bit,
            "quant_blocksize": quant_blocksize,
            "min_8bit_size": min_8bit_size,
            "sync_indices": sync_indices,
            "nonfinite": nonfinite_policy(nonfinite),
            "basis": basis.name,
            **basis.options(),
            "update": update.name,
            **update.options(),
        }
        super().__init__(params, defaults)
        unmatched = unmatched_targets(self.param_groups, owner)
        if unmatched is not None:
            warnings.warn(unmatched, UserWarning, stacklevel=caller_stacklevel())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because of non-finite gradients (``nonfinite="skip"``); saved with ``state_dict()``."""
        return skipped_steps(self)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        for group in self.param_groups:
            group["skipped_steps"] = int(value)

    @property
    def nonfinite(self) -> str:
        """The non-finite gradient policy, ``"raise"`` or ``"skip"`` (kept in every param group)."""
        return self.defaults["nonfinite"]

    @property
    def sync_indices(self) -> bool | None:
        """Whether each refreshed basis is broadcast from rank 0 (``None``: when distributed; in every group)."""
        return self.defaults["sync_indices"]

    def parts(self, group: dict[str, Any]) -> tuple[SubspaceBasis, UpdateRule]:
        """The basis and update rule a param group configures (built from its name and option keys)."""
        basis, update = (component_class(kind, group[kind]).from_group(group) for kind in KINDS)
        return basis, update  # type: ignore[return-value]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        owner = type(self).__name__
        super().add_param_group(resolve_group(param_group, self.defaults, owner))
        try:
            drop_foreign_options(self.param_groups[-1])  # the optimizer's own parts' options, where a group differs
            check_group(self.param_groups[-1], owner)
        except (TypeError, ValueError):
            self.param_groups.pop()  # a rejected group must not stay behind in a live optimizer
            raise
        self._registered = registered_parameters(self.param_groups)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch calls this on unpickling and from load_state_dict; a copy or a pickle keeps defaults, state and
        # param groups only, so the shapes a step checks against are recorded again from the groups
        super().__setstate__(state)
        for group in self.param_groups:
            restore_group(group, self.defaults)
        if "_registered" not in self.__dict__:
            self._registered = registered_parameters(self.param_groups)

    # ------------------------------------------------------------------------------------------------------------
    # which parameters are projected

    def _describe(self, group: dict[str, Any], index: int, p: torch.Tensor) -> str:
        name = param_name(group, index)
        number = next(i for i, g in enumerate(self.param_groups) if g is group)  # `index` would compare tensors
        where = f"`{name}`" if name is not None else f"parameter {index} of group {number}"
        return f"{where} (shape {tuple(p.shape)})"

    def _describe_param(self, p: torch.Tensor) -> str:
        group, index = next((g, i) for g in self.param_groups for i, q in enumerate(g["params"]) if q is p)
        return self._describe(group, index, p)

    def projection_plan(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """``(name, shape, rank)`` for every parameter; ``rank`` is None for parameters that get plain AdamW.

        Parameters without names are listed as ``"group G, param I"``. Useful to check ``target_modules`` before
        training.
        """
        plan = []
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                name = param_name(group, i) or f"group {g}, param {i}"
                plan.append((name, tuple(p.shape), planned_rank(group, i, p)[0]))
        return plan

    # ------------------------------------------------------------------------------------------------------------
    # the step

    def _sync_active(self) -> bool:
        ready = dist.is_available() and dist.is_initialized()
        if self.sync_indices is True and not ready:
            raise ValueError(
                "`sync_indices=True` needs torch.distributed to be initialized (call init_process_group first); "
                "use None to sync only when it is"
            )
        return bool(self.sync_indices is not False and ready and dist.get_world_size() > 1)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step over every parameter that has a gradient.

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.
        """
        owner = type(self).__name__
        # DeepSpeed ZeRO swaps the matrices for flat partitions, which would silently get plain AdamW
        check_parameters_unchanged(self.param_groups, self._registered, owner)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = [
            (group, i, p) for group in self.param_groups for i, p in enumerate(group["params"]) if p.grad is not None
        ]
        for group, i, p in items:
            if p.grad.is_sparse:
                raise TypeError(f"{owner} does not support sparse gradients ({self._describe(group, i, p)})")
        if not check_gradients(self, self._describe_param, self.nonfinite):
            return loss
        sync = self._sync_active() if items else False
        clamped: list[str] = []
        clamped_bases: dict[str, None] = {}  # the labels of their bases, in order
        parts = {id(group): self.parts(group) for group in self.param_groups}
        for group, i, p in items:
            state = self.state[p]
            if not state:
                state["step"] = 0
                rank, requested = planned_rank(group, i, p)
                if rank is not None:
                    state["rank"] = rank
                    if rank < requested:
                        clamped.append(f"{self._describe(group, i, p)}: rank {requested} -> {rank}")
                        clamped_bases[parts[id(group)][0].label] = None
            if "rank" in state:
                self._subspace_step(group, parts[id(group)], p, state, sync)
            else:
                self._adamw_step(group, p, state)
        if clamped:
            warnings.warn(
                f"{owner}: `rank` exceeds the projected (smaller) dimension of "
                + "; ".join(clamped)
                + f". Clamped to that dimension: these matrices get Adam in the full {'/'.join(clamped_bases)} basis "
                "with no memory saving; exclude them through `target_modules` to give them plain AdamW.",
                stacklevel=caller_stacklevel(),
            )
        return loss

    @staticmethod
    def _work_dtype(p: torch.Tensor) -> torch.dtype:
        # Half-precision parameters are updated in fp32 arithmetic (stored back in their own dtype), as the DCT and
        # the sqrt/div of Adam lose too much in bf16; their moments are kept in fp32 too (a float16 second moment
        # underflows).
        return compute_dtype(p.dtype)

    @staticmethod
    def _apply_update(p: torch.Tensor, update: torch.Tensor, alpha: float, decay: float) -> None:
        """``p <- p (1 - decay) + alpha * update``; a half-precision ``p`` is updated in ``update``'s dtype and
        rounded once (decay and step rounded separately would lose small steps twice)."""
        target = p if p.dtype == update.dtype else p.to(update.dtype)
        if decay != 0:
            target.mul_(1 - decay)
        target.add_(update, alpha=alpha)
        if target is not p:
            p.copy_(target)

    def _adamw_step(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        work = self._work_dtype(p)
        grad, p = local_part(p.grad), local_part(p)  # elementwise: an FSDP2 shard keeps the state of its entries
        eight, bs = group["moments_8bit"], group["quant_blocksize"]
        m = load_buffer(state, "exp_avg", p.shape, "dynamic", bs, work, p.device)
        v = load_buffer(state, "exp_avg_sq", p.shape, "udynamic", bs, work, p.device)
        state["step"] += 1
        direction = adam_direction(m, v, grad.to(work), group["betas"], group["eps"], state["step"])
        store_buffer(state, "exp_avg", m, eight, "dynamic", group, work)
        store_buffer(state, "exp_avg_sq", v, eight, "udynamic", group, work)
        self._apply_update(p, direction, -group["lr"], group["lr"] * group["weight_decay"])

    def _subspace_step(
        self,
        group: dict[str, Any],
        parts: tuple[SubspaceBasis, UpdateRule],
        p: torch.Tensor,
        state: dict[str, Any],
        sync: bool,
    ) -> None:
        """Adam in the subspace of one projected matrix: the group's basis and update rule do what varies."""
        basis, rule = parts
        # an FSDP2 row shard: project the local rows; only per-column sums are combined over the processes
        reduce = partial(all_reduce_over_row_shards_, like=p) if is_dtensor(p) else None
        spec = SubspaceSpec(side_of(group, p), state["rank"], reduce, sync)
        work = self._work_dtype(p)
        grad, p = local_part(p.grad).to(work), local_part(p)
        low_shape = (p.shape[0], spec.rank) if spec.side == "right" else (spec.rank, p.shape[1])
        bs = group["quant_blocksize"]
        if rule.error_feedback:
            grad = grad + load_buffer(state, "error", p.shape, "linear", bs, work, p.device)
        m = load_buffer(state, "exp_avg", low_shape, "dynamic", bs, work, p.device)
        v = load_buffer(state, "exp_avg_sq", low_shape, "udynamic", bs, work, p.device)

        ages_on = group["rotate_moments"] and basis.column_bias_correction
        ages = state.get("column_step") if ages_on else None
        if ages_on and ages is None:
            # Columns present since before ages were tracked have seen every step so far.
            ages = torch.full((spec.rank,), state["step"], dtype=torch.int64, device=p.device)
        old = state.get(basis.key)
        if old is None or state["step"] % group["update_proj_gap"] == 0:
            matrix, low = basis.select(grad, state, spec)
            if old is not None and group["rotate_moments"]:
                m, v, ages = basis.carry(Moments(m, v, ages), old, state[basis.key], spec)
        else:
            matrix = basis.current(grad, state, spec)
            low = basis.project(grad, matrix, spec)

        if rule.error_feedback:
            residual = grad - basis.project_back(low, matrix, spec)
            store_buffer(state, "error", residual, rule.error_feedback_8bit, "linear", group, p.dtype)

        state["step"] += 1
        if ages_on:
            state["column_step"] = ages = ages + 1
            step: int | torch.Tensor = ages.view(1, -1) if spec.side == "right" else ages.view(-1, 1)
        else:
            state.pop("column_step", None)
            step = state["step"]
        direction = adam_direction(m, v, low, group["betas"], group["eps"], step)
        store_buffer(state, "exp_avg", m, group["moments_8bit"], "dynamic", group, work)
        store_buffer(state, "exp_avg_sq", v, group["moments_8bit"], "udynamic", group, work)
        update = rule.update(ProjectedStep(basis, matrix, grad, low, direction, state, spec))
        self._apply_update(p, update, -group["lr"] * group["scale"], group["lr"] * group["weight_decay"])

    # ------------------------------------------------------------------------------------------------------------
    # checkpointing

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` (after ``torch.load(..., weights_only=True)`` too).

        ``torch.optim.Optimizer`` casts every floating-point state tensor to its parameter's dtype; the selected
        indices and column ages (int64), the 8-bit codes (uint8), their absmax scales and a power-iteration basis
        (float32) are put back in their saved dtype afterwards, so a bf16 model keeps exact indices and scales.
        """
        super().load_state_dict(state_dict)
        restore_saved_dtypes(self, state_dict)
