"""DCT-AdamW: AdamW whose moments live in a rank-r subspace picked from a fixed DCT basis, without any SVD.

Reference: Modoranu, Safaryan, Alistarh et al., "SVD-Free Low-Rank Adaptive Gradient Optimization" / "FFT-based
Dynamic Subspace Selection" (arXiv 2505.17967); formulas in docs/methods.md (DCT-AdamW). The DCT math is in
:mod:`peft_ext.optim.dct`, Adam's arithmetic in :mod:`peft_ext.optim.adam_math` (:func:`adam_direction`), the moment
rotation and 8-bit buffers in :mod:`peft_ext.optim.dct_state`; :class:`DCTAdamW` only manages state.

Against GaLore (the usual alternative), what changes for a user:

* No SVD: a subspace refresh is one DCT of the gradient (an FFT or a product with a matrix shared by every layer of
  that size) plus a top-k, so refreshing every step (the paper's default) is affordable.
* The per-layer projector is ``r`` integers instead of an ``r x n`` float matrix, and ``state_dict()`` holds only
  tensors and plain numbers, so it loads with ``torch.load(weights_only=True)`` and a resumed run is bit-identical to
  an uninterrupted one.
* Data parallel: the selection is a deterministic function of the (all-reduced) gradient, and with
  ``torch.distributed`` initialized the indices are also broadcast from rank 0, so every rank applies the same
  update.
* FSDP2 (``fully_shard``): each rank projects its own rows of a row-sharded matrix (the DCT runs along the columns)
  and only the ``C`` column scores are all-reduced, so no gradient is gathered and the moments stay sharded (about
  ``1 / world`` per rank). GaLore's SVD needs the whole matrix (docs/dct_adamw.md, "FSDP2").
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
    all_shards_agree,
    check_parameters_unchanged,
    is_dtensor,
    local_part,
    registered_parameters,
)
from ..precision import compute_dtype
from .adam_math import adam_direction
from .dct import dct_matrix, dct_select, project, project_back, projection_side
from .dct_checks import NONFINITE_POLICIES, caller_stacklevel, check_group, matches_target, unmatched_targets
from .dct_state import (
    load_buffer,
    rotate_selected,
    store_buffer,
)
from .saved_state import restore_saved_dtypes
from .subspace import (
    channel_scaled_update,
    coordinate_select,
    limit_norm_growth,
    one_hot_rows,
    power_refresh,
    rotate_by_overlap,
)

__all__ = ["NONFINITE_POLICIES", "DCTAdamW", "matches_target"]


class DCTAdamW(Optimizer):
    """AdamW with low-rank moments in a dynamically selected DCT subspace (DCT-AdamW, arXiv 2505.17967).

    For a projected ``(R, C)`` matrix with ``R >= C`` (else mirrored, see :mod:`peft_ext.optim.dct`), every
    ``update_proj_gap`` steps the gradient's DCT-II ``S = G Q^T`` is computed and the ``r`` columns with the largest
    L1 norm become the subspace ``I``; each step then runs Adam on ``a = G Q[I]^T`` (``R x r``) and applies
    ``p <- p (1 - lr wd) - lr * scale * adam(a) Q[I]``. Only ``r`` indices are stored per layer; the ``n x n`` DCT
    matrix is built once per size and shared. Everything else (vectors, matrices with a dimension ``>= max_shape``
    such as embeddings and LM heads, matrices outside ``target_modules``) gets plain AdamW inside the same optimizer.

    When to use it: full fine-tuning or pre-training where Adam's moments dominate memory and GaLore's SVD refresh is
    too slow or its state cannot be checkpointed. When not to: tiny models (the projection saves nothing worth its
    approximation), LoRA-style adapters whose matrices already have a dimension of ``r`` (nothing to compress), or
    tensor-parallel / DeepSpeed ZeRO training (column shards and flat partitions are rejected with a ``ValueError``;
    DDP and FSDP2's row shards are supported, see docs/distributed.md).

    Half precision: bfloat16 / float16 parameters are stepped in float32 (the DCT, Adam's arithmetic and the update,
    rounded into the parameter once); their moments are stored in float32, the error-feedback buffer (as large as the
    parameter) in the parameter's dtype.

    Decisions the paper leaves open, and what this implementation does:

    * ``rank`` larger than a matrix's projected dimension ``n``: clamped to ``n``, with one ``UserWarning`` naming
      every such matrix when their state is created. At ``r = n`` the update is Adam in the DCT-rotated basis (no
      memory saving); use ``target_modules`` to give those matrices plain AdamW instead. Not an error, because one
      ``rank`` usually serves matrices of many shapes (a classifier head may be narrower than ``r``).
    * Non-finite gradients: checked on every parameter before anything is modified. ``nonfinite_grad="raise"``
      (default) raises ``FloatingPointError`` naming the parameter; ``"skip"`` skips the whole step (no parameter,
      moment or counter changes) with a ``UserWarning``, counted in :attr:`skipped_steps`. A mixed-precision
      ``torch.amp.GradScaler`` already skips such steps before calling ``step()``, so neither path is hit there.
    * A column that enters the selection starts with zero moments (docs/methods.md (DCT-AdamW)). By default its bias
      correction
      uses the parameter's step count, as in the public code; its first updates are then 3 to 6.5 times Adam's
      unit step (``(1 - beta1^k) / sqrt(1 - beta2^k)`` after ``k`` updates, before the moments fill). With
      ``column_bias_correction=True`` each column is corrected by its own age, so a new column starts exactly like
      a fresh Adam coordinate. In a small ablation (docs/dct_adamw.md, table 4) that helped only at the highest
      learning rate with the smallest rank and was slightly worse elsewhere, so the paper's behaviour stays the
      default. With ``rank`` equal to the full dimension both agree with AdamW on the rotated parameter.

    Args:
        params: Parameters or param groups. Pass ``model.named_parameters()`` (or groups of ``(name, param)``
            pairs) when using ``target_modules``. Every option below except ``sync_indices`` and ``nonfinite_grad``
            can be set per group.
        lr: Learning rate.
        rank: Subspace dimension ``r`` per projected matrix; a projected ``(R, C)`` matrix keeps ``2 max(R, C) r``
            moment entries instead of AdamW's ``2 R C``.
        update_proj_gap: Refresh the selection every this many steps. The paper's default is 1 (a refresh costs one
            DCT); raise it only if the refresh shows up in profiles.
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
        rotate_moments: When the selection changes, keep the moments of columns present in both selections and
            zero the new ones (the rotation of docs/methods.md (DCT-AdamW)). Off: moments stay positional, as in
            GaLore,
            and are reinterpreted in the new basis.
        column_bias_correction: Bias-correct each column by its own age (only with ``rotate_moments``); see above.
            Off by default, as in the paper.
        error_feedback: Keep the residual ``E = (G + E) - a Q[I]`` and add it to the next gradient, so directions
            outside the subspace are delayed rather than lost. Costs a full ``R x C`` buffer per matrix (1 byte per
            entry with ``error_feedback_8bit``): larger than the moments it saves at small ``r``.
        moments_8bit: Store both moments (projected and plain-AdamW ones, from ``min_8bit_size`` entries) 8-bit with
            bitsandbytes' blockwise dynamic quantization. Saves 3/4 of the moment memory; see the tolerance measured
            in the tests. On CPU it costs time (every step de- and re-quantizes), and bitsandbytes' CPU library
            links the system libgomp while torch bundles its own: with more than one torch thread both OpenMP
            runtimes spin-wait for the same cores and a step can be 30x slower. Use one torch thread or
            ``OMP_WAIT_POLICY=PASSIVE`` there.
        error_feedback_8bit: Store the error-feedback buffer 8-bit.
        quant_blocksize: Block size of the 8-bit quantization.
        min_8bit_size: Buffers with fewer entries stay 32-bit even in 8-bit mode: biases and norms, whose state is
            negligible and whose few blocks would gain nothing (bitsandbytes' 8-bit optimizers use the same 4096).
        dct_method: ``"auto"`` (FFT from size :data:`~peft_ext.optim.dct.FFT_MIN_SIZE` on), ``"matmul"`` or ``"fft"``;
            all three select the same columns up to floating-point ties.
        selection_norm: Norm of the column score (paper: 1).
        side: Which dimension is compressed: ``"auto"`` (the smaller one, as the paper; always ``"right"`` for a
            DTensor, FSDP2's row shard, so each process projects its own rows), ``"right"`` (columns: moments
            ``R x r``) or ``"left"`` (rows: ``r x C``; refused for row-sharded matrices). One process with
            ``side="right"`` reproduces an FSDP2 run exactly where ``"auto"`` would pick ``"left"`` (``R < C``).
        sync_indices: Broadcast each refreshed selection from rank 0 (``r`` integers per matrix). ``None``: whenever
            ``torch.distributed`` is initialized with more than one process. DDP already gives every rank the same
            gradient, so this guards against reductions that are not bit-identical across ranks.
        nonfinite_grad: ``"raise"`` or ``"skip"``; see above.
        projection: The subspace (:mod:`peft_ext.optim.subspace`): ``"dct"`` (the paper), ``"coordinates"`` (the
            ``r`` plain columns / rows with the largest gradient norm) or ``"power"`` (an orthonormal basis tracked
            by one warm-started block power iteration per refresh: no SVD, moments carried over by the basis
            overlap; :class:`SubspaceAdamW` defaults to it).
        update: ``"projected"`` (the low-rank Adam direction mapped back) or ``"channel"`` (APOLLO's rule: the whole
            gradient scaled per channel by the ratio the low-rank Adam state estimates; no error feedback).
        norm_growth_limit: With ``update="channel"``: APOLLO's limiter, an update's norm may be at most this times
            the previous one's (``None``: off). Ignored for ``"projected"``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        rank: int = 128,
        update_proj_gap: int = 1,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        scale: float = 1.0,
        target_modules: str | Sequence[str] | None = None,
        max_shape: int = 32_000,
        rotate_moments: bool = True,
        column_bias_correction: bool = False,
        error_feedback: bool = False,
        moments_8bit: bool = False,
        error_feedback_8bit: bool = False,
        quant_blocksize: int = 256,
        min_8bit_size: int = 4096,
        dct_method: str = "auto",
        selection_norm: float = 1.0,
        side: str = "auto",
        sync_indices: bool | None = None,
        nonfinite_grad: str = "raise",
        projection: str = "dct",
        update: str = "projected",
        norm_growth_limit: float | None = 1.01,
    ) -> None:
        if sync_indices not in (None, True, False):
            raise TypeError(f"`sync_indices` must be None, True or False, got {sync_indices!r}")
        if nonfinite_grad not in NONFINITE_POLICIES:
            raise ValueError(f"`nonfinite_grad` must be one of {NONFINITE_POLICIES}, got {nonfinite_grad!r}")
        self.sync_indices = sync_indices
        self.nonfinite_grad = nonfinite_grad
        #: Steps skipped because of non-finite gradients (``nonfinite_grad="skip"``); not part of ``state_dict``.
        self.skipped_steps = 0
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
            "rotate_moments": rotate_moments,
            "column_bias_correction": column_bias_correction,
            "error_feedback": error_feedback,
            "moments_8bit": moments_8bit,
            "error_feedback_8bit": error_feedback_8bit,
            "quant_blocksize": quant_blocksize,
            "min_8bit_size": min_8bit_size,
            "dct_method": dct_method,
            "selection_norm": selection_norm,
            "side": side,
            "projection": projection,
            "update": update,
            "norm_growth_limit": norm_growth_limit,
        }
        super().__init__(params, defaults)
        unmatched = unmatched_targets(self.param_groups)
        if unmatched is not None:
            warnings.warn(unmatched, UserWarning, stacklevel=2)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            check_group(self.param_groups[-1])
        except (TypeError, ValueError):
            self.param_groups.pop()  # a rejected group must not stay behind in a live optimizer
            raise
        self._registered = registered_parameters(self.param_groups)

    # ------------------------------------------------------------------------------------------------------------
    # which parameters are projected

    def _param_name(self, group: dict[str, Any], index: int) -> str | None:
        names = group.get("param_names")
        return names[index] if names is not None else None

    def _describe(self, group: dict[str, Any], index: int, p: torch.Tensor) -> str:
        name = self._param_name(group, index)
        number = next(i for i, g in enumerate(self.param_groups) if g is group)  # `index` would compare tensors
        where = f"`{name}`" if name is not None else f"parameter {index} of group {number}"
        return f"{where} (shape {tuple(p.shape)})"

    def _planned_rank(self, group: dict[str, Any], index: int, p: torch.Tensor) -> tuple[int | None, int]:
        """``(rank, requested)``: the rank ``p`` will be projected to (None: plain AdamW) and the group's rank."""
        if p.ndim != 2 or max(p.shape) >= group["max_shape"]:
            return None, group["rank"]
        name = self._param_name(group, index)
        module = name.rsplit(".", 1)[0] if name is not None and "." in name else (name or "")
        if not matches_target(module, group["target_modules"]):
            return None, group["rank"]
        n = p.shape[1] if self._side(group, p) == "right" else p.shape[0]
        return min(group["rank"], n), group["rank"]

    @staticmethod
    def _side(group: dict[str, Any], p: torch.Tensor) -> str:
        side = group.get("side", "auto")  # state dicts saved before `side` existed lack it
        if side != "auto":
            return side
        return "right" if is_dtensor(p) else projection_side(p.shape)

    def projection_plan(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """``(name, shape, rank)`` for every parameter; ``rank`` is None for parameters that get plain AdamW.

        Parameters without names are listed as ``"group G, param I"``. Useful to check ``target_modules`` before
        training.
        """
        plan = []
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                name = self._param_name(group, i) or f"group {g}, param {i}"
                plan.append((name, tuple(p.shape), self._planned_rank(group, i, p)[0]))
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

    def _check_finite(self, items: list[tuple[dict[str, Any], int, torch.Tensor]]) -> bool:
        if not items:
            return True
        # min and max are finite exactly when every entry is (both propagate nan; inf shows up in one of them).
        # aminmax reads the gradient once without a boolean copy (~25x faster than isfinite().all() on CPU), and the
        # whole model meets in one host sync per device instead of one per parameter.
        per_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, _, p in items:
            grad = local_part(p.grad)
            if grad.numel():
                per_device.setdefault(grad.device, []).append(torch.stack(torch.aminmax(grad.detach())).float())
        finite = all(bool(torch.isfinite(torch.stack(e)).all()) for e in per_device.values())
        # every process must skip (or raise) together, though only one may hold the bad rows
        if all_shards_agree(finite, [p for _, _, p in items]):
            return True
        culprit = next((item for item in items if not bool(torch.isfinite(local_part(item[2].grad)).all())), None)
        where = self._describe(*culprit) if culprit is not None else "another process's rows of a sharded parameter"
        message = f"non-finite gradient (inf or nan) in {where}"
        if self.nonfinite_grad == "raise":
            raise FloatingPointError(
                f"{message}; nothing was updated. Pass nonfinite_grad='skip' to skip such steps instead."
            )
        warnings.warn(
            f"{message}; skipping this optimizer step (no parameter or state changed)", stacklevel=caller_stacklevel()
        )
        self.skipped_steps += 1
        return False

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step over every parameter that has a gradient.

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.
        """
        # DeepSpeed ZeRO swaps the matrices for flat partitions, which would silently get plain AdamW
        check_parameters_unchanged(self.param_groups, self._registered, "DCTAdamW")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = [
            (group, i, p) for group in self.param_groups for i, p in enumerate(group["params"]) if p.grad is not None
        ]
        for group, i, p in items:
            if p.grad.is_sparse:
                raise TypeError(f"DCTAdamW does not support sparse gradients ({self._describe(group, i, p)})")
        if not self._check_finite(items):
            return loss
        sync = self._sync_active() if items else False
        clamped: list[str] = []
        for group, i, p in items:
            state = self.state[p]
            if not state:
                state["step"] = 0
                rank, requested = self._planned_rank(group, i, p)
                if rank is not None:
                    state["rank"] = rank
                    if rank < requested:
                        clamped.append(f"{self._describe(group, i, p)}: rank {requested} -> {rank}")
            if "rank" in state:
                self._dct_step(group, p, state, sync)
            else:
                self._adamw_step(group, p, state)
        if clamped:
            warnings.warn(
                "DCTAdamW: `rank` exceeds the projected (smaller) dimension of "
                + "; ".join(clamped)
                + ". Clamped to that dimension: these matrices get Adam in the full DCT basis with no memory saving; "
                "exclude them through `target_modules` to give them plain AdamW.",
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

    def _dct_step(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], sync: bool) -> None:
        work = self._work_dtype(p)
        rank = state["rank"]
        side = self._side(group, p)
        # an FSDP2 row shard: project the local rows; only the column scores are summed over the processes
        reduce = partial(all_reduce_over_row_shards_, like=p) if is_dtensor(p) else None
        grad, p = local_part(p.grad).to(work), local_part(p)
        dim = 1 if side == "right" else 0
        n = p.shape[dim]
        low_shape = (p.shape[0], rank) if side == "right" else (rank, p.shape[1])
        bs = group["quant_blocksize"]
        ages_on = group["rotate_moments"] and group["column_bias_correction"]
        projection = group.get("projection", "dct")
        q = dct_matrix(n, work, p.device) if projection != "coordinates" else grad.new_empty(0)

        if group["error_feedback"]:
            grad = grad + load_buffer(state, "error", p.shape, "linear", bs, work, p.device)
        m = load_buffer(state, "exp_avg", low_shape, "dynamic", bs, work, p.device)
        v = load_buffer(state, "exp_avg_sq", low_shape, "udynamic", bs, work, p.device)

        ages = state.get("column_step")
        if ages_on and ages is None:
            # Columns present since before ages were tracked have seen every step so far.
            ages = torch.full((rank,), state["step"], dtype=torch.int64, device=p.device)
        refresh = state["step"] % group["update_proj_gap"] == 0
        if projection == "power":
            basis, low, m, v = self._power_basis(group, state, grad, q, m, v, side, reduce, sync, refresh)
        else:
            rows = q.index_select if projection == "dct" else partial(self._unit_rows, n=n, like=grad)
            old = state.get("indices")
            if old is None or refresh:
                if projection == "dct":
                    indices, low = dct_select(grad, rank, side, group["selection_norm"], group["dct_method"], reduce)
                else:
                    indices, low = coordinate_select(grad, rank, side, group["selection_norm"], reduce)
                if sync:
                    local = indices.clone()
                    dist.broadcast(indices, src=0)
                    if not torch.equal(local, indices):
                        low = project(grad, rows(0, indices), side)
                if old is not None and group["rotate_moments"]:
                    m = rotate_selected(m, old, indices, dim)
                    v = rotate_selected(v, old, indices, dim)
                    if ages_on:
                        ages = rotate_selected(ages, old, indices, 0)
                state["indices"] = indices
                basis = rows(0, indices)
            else:
                basis = rows(0, old)
                low = project(grad, basis, side)

        if group["error_feedback"]:
            residual = grad - project_back(low, basis, side)
            store_buffer(state, "error", residual, group["error_feedback_8bit"], "linear", group, p.dtype)

        state["step"] += 1
        if ages_on:
            state["column_step"] = ages = ages + 1
            step: int | torch.Tensor = ages.view(1, -1) if side == "right" else ages.view(-1, 1)
        else:
            state.pop("column_step", None)
            step = state["step"]
        direction = adam_direction(m, v, low, group["betas"], group["eps"], step)
        store_buffer(state, "exp_avg", m, group["moments_8bit"], "dynamic", group, work)
        store_buffer(state, "exp_avg_sq", v, group["moments_8bit"], "udynamic", group, work)
        if group.get("update", "projected") == "channel":
            update = channel_scaled_update(grad, low, direction, side)
            update = limit_norm_growth(update, state, group.get("norm_growth_limit"), reduce)
        else:
            update = project_back(direction, basis, side)
        self._apply_update(p, update, -group["lr"] * group["scale"], group["lr"] * group["weight_decay"])

    @staticmethod
    def _unit_rows(_: int, indices: torch.Tensor, *, n: int, like: torch.Tensor) -> torch.Tensor:
        # the coordinate basis in q.index_select(0, indices)'s calling convention
        return one_hot_rows(indices, n, like.dtype, like.device)

    def _power_basis(
        self,
        group: dict[str, Any],
        state: dict[str, Any],
        grad: torch.Tensor,
        q: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        side: str,
        reduce: Any,
        sync: bool,
        refresh: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(basis, low, m, v)`` for ``projection="power"``: the tracked basis, refreshed by one block power
        iteration every ``update_proj_gap`` steps (the first one warm-started from the DCT selection), with the
        moments carried into the new basis."""
        basis = state.get("basis")
        if basis is None:
            indices, _ = dct_select(grad, state["rank"], side, group["selection_norm"], group["dct_method"], reduce)
            start = q.index_select(0, indices).to(torch.float32)
            basis = power_refresh(grad, start, side, reduce)
        elif refresh:
            new = power_refresh(grad, basis, side, reduce)
            if sync:
                dist.broadcast(new, src=0)
            if group["rotate_moments"]:
                m, v = rotate_by_overlap(m, v, basis, new, side)
                v = v.clamp_min(0)
            basis = new
        if sync and "basis" not in state:
            dist.broadcast(basis, src=0)
        state["basis"] = basis
        basis = basis.to(grad.dtype)
        return basis, project(grad, basis, side), m, v

    # ------------------------------------------------------------------------------------------------------------
    # checkpointing

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` (after ``torch.load(..., weights_only=True)`` too).

        ``torch.optim.Optimizer`` casts every floating-point state tensor to its parameter's dtype; the selected
        indices and column ages (int64), the 8-bit codes (uint8) and their absmax scales (float32) are put back in
        their saved dtype afterwards, so a bf16 model keeps exact indices and scales.
        """
        super().load_state_dict(state_dict)
        restore_saved_dtypes(self, state_dict)


class SubspaceAdamW(DCTAdamW):
    """DCT-AdamW's family with an adaptive, SVD-free basis by default: ``projection="power"``.

    Every ``update_proj_gap`` steps the basis of each projected matrix moves by one block power iteration on its
    gradient, warm-started from the previous basis (the first one from the DCT selection), and Adam's moments are
    carried into the new basis through the ``r x r`` overlap (:mod:`peft_ext.optim.subspace`). It costs two
    ``O(m n r)`` products and a QR of an ``n x r`` matrix per refresh, and stores the ``r x n`` basis. Pass
    ``update="channel"`` for APOLLO's rule (the whole gradient scaled per channel), and any :class:`DCTAdamW`
    option (8-bit moments, ``side``, ``target_modules``, ``nonfinite_grad``, ...).
    """

    def __init__(self, params: Any, lr: float = 1e-3, rank: int = 128, update_proj_gap: int = 50, **kwargs: Any):
        kwargs.setdefault("projection", "power")
        super().__init__(params, lr=lr, rank=rank, update_proj_gap=update_proj_gap, **kwargs)
