"""Riemannion: Muon on the fixed-rank manifold, for Riemannion adapters (docs/methods.md (Riemannion)).

Each adapter's delta ``X = A B^T`` is a point of the manifold of rank-r matrices, and the step moves X itself, not
its factors, so the result does not depend on how X is split into factors (LoRA's factor ambiguity). Per adapter,
with momentum ``M`` (a tangent vector), lr ``eta``, momentum ``beta`` and weight decay ``gamma``:

1. ``grad = P_T(G)`` from the products ``G B_R`` and ``G^T A`` that the layer's backward pass delivers;
2. ``M <- beta * M + grad`` (``M`` was transported to the current point at the end of the previous step);
3. ``D = P_T(Ortho(M))`` (or of ``grad + beta * M`` with Nesterov): the nonzero singular values set to 1, exactly,
   by QR + a 2r x 2r SVD (no Newton-Schulz);
4. ``X <- R((1 - eta * gamma) X - eta * D)``, the best rank-r approximation (retraction);
5. ``M`` (pre-orthogonalization, as in Muon) is transported to the new point by re-projection.

The learning rate is in spectral-norm units, like Muon's: every step moves X by ``eta`` in spectral norm. Paper
defaults (Llama-3-8B, r=16): lr 1e-4, weight decay 3.16e-3, momentum 0.9, linear schedule with 10% warmup.
:class:`RiemannLoRA` is the SGD variant (heavy-ball momentum on ``P_T(G)``, no orthogonalization; lr in Frobenius
units). Other trainable parameters (classification heads, ``modules_to_save``) are updated by an AdamW inside the
same optimizer (as Muon's ``MuonWithAuxAdam`` does).

The step for a stack of same-shaped adapters is the pure :func:`~peft_ext.optim.riemannion_math.riemannion_update`;
the AdamW step is :func:`~peft_ext.optim.adam_math.adamw_update`. This class gathers the stacks, calls them and writes
the results back, handing each layer the new point's ``B_R`` (computed by the retraction) so the next forward pass
and the next step reuse it.

The optimizer reads the adapters through :class:`~peft_ext.optim.adapters.FixedRankAdapters`, the interface
Riemannion's layer implements; it imports no tuner.

When not to use it: on adapters other than Riemannion's (the optimizer refuses them), or with ordinary optimizers on
Riemannion adapters (they would break ``A``'s orthonormality; the constructor checks it).

Use with ``transformers.Trainer``, either way::

    # build it yourself (any scheduler works: every group, manifold and AdamW, has its own "lr")
    optimizer = create_riemannion_optimizer(model, lr=1e-3, aux_lr=1e-3)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, scheduler))

    # or let the Trainer build it: the Trainer passes kwargs["model"] as the first argument (as for LOMO)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_cls_and_kwargs=(Riemannion, {"model": model, "lr": 1e-3, "aux_lr": 1e-3}))

The optimizer needs the model to know which parameters form an adapter (``A``, ``B`` and the zero probe ``Z``);
``Riemannion(params)`` without it raises ``TypeError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ..distributed import (
    all_gather_owned,
    check_parameters_unchanged,
    check_row_sharded,
    full_tensors,
    is_dtensor,
    local_part,
    owned_by,
    owners_by_group,
    registered_parameters,
    row_split,
    write_full_tensors_,
)
from ..kernels.retraction import stack_by_shape
from ..manifolds.fixed_rank import FixedRankPoint, TangentVector, right_basis, stack_bases
from ..precision import check_dtypes, compute_dtype
from .adam_math import adamw_update
from .adapters import AdapterHandle, find_fixed_rank_adapters
from .nonfinite import check_gradients, nonfinite_policy
from .riemannion_checks import check_group, check_momentum_split, check_points, split_groups
from .riemannion_math import riemannion_update
from .saved_state import restore_saved_dtypes

__all__ = ["RiemannLoRA", "Riemannion", "create_riemannion_optimizer"]

ParamsT = Union[Iterable[Tensor], Iterable[dict[str, Any]], nn.Module]


class Riemannion(Optimizer):
    """Muon on the fixed-rank manifold for Riemannion adapters, with an auxiliary AdamW for other parameters.

    See the module docstring for the update. State per adapter (on its ``A``): ``step`` and the momentum's factors
    ``momentum_A`` (m x r) and ``momentum_B`` (n x r), kept in float32 or wider; per AdamW parameter: ``step``,
    ``exp_avg``, ``exp_avg_sq``. Only tensors and numbers, so ``state_dict()`` loads with
    ``torch.load(weights_only=True)``.

    Half precision: bfloat16 / float16 adapters are stepped in float32 (QR, SVD and the momentum in float32) and the
    new factors rounded into their dtype, so ``A`` is orthonormal to that dtype's precision; AdamW moments of
    bfloat16 / float16 parameters are float32.

    Parameter groups: every group given is split into a manifold group (the Riemannion adapters in it, in module
    order) and an AdamW group (everything else), so a scheduler scales both. A group may set ``"manifold": True`` to
    assert it holds only adapter parameters (``ValueError`` otherwise); ``A``, ``B`` and ``Z`` of one adapter must be
    in the same group.

    Args:
        params: The model (all its trainable parameters are optimized) or parameters / parameter groups of
            ``model``.
        model: The model holding the adapters; needed when ``params`` is not the model.
        lr: Manifold step size (spectral-norm units).
        momentum: Momentum coefficient in [0, 1).
        nesterov: Nesterov momentum.
        weight_decay: Decoupled weight decay of the adapters (and of AdamW parameters unless ``aux_weight_decay``).
        orthogonalize: Orthogonalize the step (Riemannion); ``False`` gives the SGD variant (RiemannLoRA).
        aux_lr: AdamW learning rate (default: ``lr``).
        aux_betas: AdamW betas.
        aux_eps: AdamW eps.
        aux_weight_decay: AdamW weight decay (default: ``weight_decay``).
        nonfinite: On a non-finite gradient anywhere: ``"raise"`` a ``ValueError`` naming the parameter (default) or
            ``"skip"`` the whole step with a ``UserWarning`` naming it (nothing changes; ``skipped_steps`` counts them,
            as ``GradScaler`` would).
        rtol: Rank threshold of the orthogonalization (default ``max(m, n) * eps``).

    Raises:
        TypeError: If the model is not given, or a parameter's dtype is not float32, bfloat16, float16 or float64.
        ValueError: On invalid hyperparameters, on non-adapter parameters in a ``"manifold": True`` group, on split
            adapters, on adapters that are off the manifold (``A`` not orthonormal or ``Z`` nonzero), and on layouts
            it cannot use (DTensor placements other than FSDP2's ``Shard(0)`` / ``Replicate()``, DeepSpeed ZeRO-3;
            ``step`` also refuses parameters that DeepSpeed ZeRO replaced with flat partitions): use FSDP2 or DDP
            (docs/distributed.md).

    FSDP2 (``fully_shard``): every step all-gathers every adapter's ``A``, ``B`` and the gradients of ``Z`` and ``B``
    (``(m + n) x r`` each) in one collective (:func:`~peft_ext.distributed.full_tensors`); each process runs the step
    above for the adapters it owns (every ``world``-th of the group) and keeps only their momentum, and one more
    all-gather gives every process every new point, of which it writes back its rows. With the check for non-finite
    gradients (one all-reduce) a step makes three collectives, however many adapters there are. The AdamW state is
    the shard's.
    """

    def __init__(
        self,
        params: ParamsT,
        *,
        model: Optional[nn.Module] = None,
        lr: float = 1e-3,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        orthogonalize: bool = True,
        aux_lr: Optional[float] = None,
        aux_betas: tuple[float, float] = (0.9, 0.999),
        aux_eps: float = 1e-8,
        aux_weight_decay: Optional[float] = None,
        nonfinite: Literal["raise", "skip"] = "raise",
        rtol: Optional[float] = None,
    ) -> None:
        if isinstance(params, nn.Module):
            if model is not None and model is not params:
                raise ValueError("pass the model either as `params` or as `model=`, not two different modules")
            model = params
            params = [p for p in model.parameters() if p.requires_grad]
        if model is None:
            raise TypeError(
                f"{type(self).__name__} needs the model to find the Riemannion adapters: call "
                f"{type(self).__name__}(model, ...), {type(self).__name__}(params, model=model, ...) or "
                "create_riemannion_optimizer(model, ...); with transformers.Trainer put 'model' in the kwargs of "
                "optimizer_cls_and_kwargs"
            )
        owner = type(self).__name__
        self._adapters = find_fixed_rank_adapters(model)
        self._ref_by_A = {id(ref.A): ref for ref in self._adapters}
        self._names = {id(p): name for name, p in model.named_parameters()}
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "orthogonalize": orthogonalize,
            "betas": tuple(aux_betas),
            "eps": aux_eps,
            "rtol": rtol,
            "manifold": False,
            "skipped_steps": 0,
            "nonfinite": nonfinite_policy(nonfinite),
        }
        groups = split_groups(params, self._adapters, self._describe, aux_lr, aux_weight_decay, owner)
        named = [(self._names.get(id(p), "an unnamed parameter"), p) for g in groups for p in g["params"]]
        check_dtypes(named, owner)
        # the retraction (QR + SVD) and the orthonormality of A need whole factors: FSDP2 row shards are gathered
        # for every step (they are only (m + n) x r), other layouts are refused
        check_row_sharded(named, owner, "the retraction (QR and SVD of the adapter factors)")
        for ref in self._adapters:
            if is_dtensor(ref.B):
                # FSDP2 refills the unsharded B of the forward in place without bumping its version counter, so the
                # layer's cache key cannot see the optimizer's writes: recompute B_R in every forward
                ref.module.stop_caching_right_basis()
        super().__init__(groups, defaults)
        for index, group in enumerate(self.param_groups):
            check_group(group, index)
        check_points(self.param_groups, self._ref_of)
        self._registered = registered_parameters(self.param_groups)

    @property
    def nonfinite(self) -> str:
        """The non-finite gradient policy, ``"raise"`` or ``"skip"`` (kept in every param group)."""
        return self.defaults["nonfinite"]

    def __getstate__(self) -> dict[str, Any]:
        # torch keeps defaults, state and param groups; the adapters (their modules) and the parameters' names are
        # kept too, so a copy or an unpickled optimizer can step: within one copy or pickle the modules' parameters
        # are the very tensors of the copied param groups
        names = [[self._names.get(id(p)) for p in group["params"]] for group in self.param_groups]
        return {**super().__getstate__(), "_adapters": self._adapters, "_param_names": names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        names = state.pop("_param_names", None)
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nonfinite", self.defaults.setdefault("nonfinite", "raise"))
        if names is not None:  # unpickling (load_state_dict passes state and param groups only)
            self._ref_by_A = {id(ref.A): ref for ref in self._adapters}
            pairs = zip((p for g in self.param_groups for p in g["params"]), (n for group in names for n in group))
            self._names = {id(p): name for p, name in pairs if name is not None}
            self._registered = registered_parameters(self.param_groups)

    # -- construction ------------------------------------------------------------------------------------------------

    def _describe(self, p: Tensor) -> str:
        return f"{self._names.get(id(p), 'an unnamed parameter')} of shape {tuple(p.shape)}"

    def _ref_of(self, A: Tensor) -> AdapterHandle | str:
        return self._ref_by_A.get(id(A), "an adapter")

    # -- stepping -------------------------------------------------------------------------------------------------

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because of non-finite gradients (``nonfinite="skip"``); saved with the state dict."""
        return int(self.param_groups[0]["skipped_steps"])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Update every adapter on the manifold and every other parameter with AdamW.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).
        """
        check_parameters_unchanged(self.param_groups, self._registered, type(self).__name__)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not check_gradients(self, self._describe, self.nonfinite):
            return loss
        for group in self.param_groups:
            if group["manifold"]:
                self._step_manifold(group)
            else:
                self._step_aux(group)
        return loss

    def _step_manifold(self, group: dict[str, Any]) -> None:
        # Adapters of the same shape are stacked and updated in one batched call (kernels.retraction.stack_by_shape)
        has_momentum, refs, params, parts, slots = [], [], [], [], []
        for slot, (A, B, Z) in enumerate(_triples(group)):
            if B.grad is None and Z.grad is None:
                continue  # the adapter took no part in the loss (e.g. inactive): nothing to do, like torch optimizers
            parts += (A, B, _grad_or_zeros(Z), _grad_or_zeros(B))
            params.append((A, B))
            has_momentum.append("momentum_A" in self.state[A])
            refs.append(self._ref_by_A[id(A)])
            slots.append(slot)
        # FSDP2: factors and gradients gathered whole in one collective; each process steps the adapters it owns (by
        # place in the group), keeping only their momentum; one more all-gather hands every process every new point
        whole = full_tensors(parts)
        rows = [tuple(whole[i : i + 4]) for i in range(0, len(whole), 4)]
        split = row_split(params[0][0]) if params else None
        owners, mine = _owners(group, slots, split, any(has_momentum))
        check_momentum_split(group, split[1] if split else 1, any(has_momentum))
        new_factors, bases = {}, {}  # by position: the new (A, B); the retraction's B_R for the layer's cache
        for sub, (A, B, grad_right, grad_left) in stack_by_shape(
            [rows[i] for i in mine], [has_momentum[i] for i in mine]
        ):
            indices = [mine[j] for j in sub]
            buf = None
            if has_momentum[indices[0]]:
                # stacked as stored (float32 or wider; load_state_dict keeps the saved dtype)
                states = [self.state[params[i][0]] for i in indices]
                buf = TangentVector(
                    torch.stack([s["momentum_A"] for s in states]), torch.stack([s["momentum_B"] for s in states])
                )
            # B_R: the layer's cached basis when in the working precision; half-precision B gets its own fp32 basis
            if B.dtype == rows[indices[0]][1].dtype:
                B_R = stack_bases([self._right_basis(refs[i], rows[i][1]) for i in indices])
            else:
                B_R = right_basis(B)
            new_point, new_buf = riemannion_update(
                FixedRankPoint(A, B, B_R),
                grad_right,
                grad_left,
                buf,
                lr=group["lr"],
                beta=group["momentum"],
                nesterov=group["nesterov"],
                weight_decay=group["weight_decay"],
                orthogonalize_step=group["orthogonalize"],
                rtol=group["rtol"],
            )
            for n, i in enumerate(indices):
                new_factors[i] = (new_point.A[n], new_point.B[n])
                A_param, B_param = params[i]
                if B_param.dtype == new_point.B.dtype:
                    bases[i] = new_point.B_R[n]  # the retraction's right_basis(B): the next forward uses it
                if group["momentum"] > 0:  # clones: a view would make torch.save write the whole stacked buffer
                    state = self.state[A_param]
                    state["momentum_A"], state["momentum_B"] = new_buf.A_dot[n].clone(), new_buf.B_dot[n].clone()
        factors = all_gather_owned(new_factors, owners, params, split)
        # each process copies its rows of the new factors into its shards (no communication)
        write_full_tensors_([p for pair in params for p in pair], [f for pair in factors for f in pair])
        for i, basis in bases.items():  # after the write, which moves B's version (the layer's cache key)
            refs[i].module.store_right_basis(refs[i].adapter_name, basis)
        for A_param, _ in params:
            self.state[A_param]["step"] = self.state[A_param].get("step", 0) + 1

    def _right_basis(self, ref: AdapterHandle, B: Tensor) -> Tensor:
        # the layer's cached basis of its B (one QR shared with the forward), or, for a gathered FSDP2 shard (whose
        # layer recomputes it in every forward), the same deterministic QR of the whole B
        cached = ref.module.cached_right_basis(ref.adapter_name)
        return right_basis(B) if cached is None else cached

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by ``state_dict()``, keeping the saved dtypes of floating state.

        ``torch.optim.Optimizer`` casts every floating state tensor to its parameter's dtype; the float32 momentum and
        AdamW moments of bfloat16 / float16 parameters are put back from the saved tensors, so a resumed run continues
        exactly.

        Args:
            state_dict: What ``state_dict()`` returned (after ``torch.load(..., weights_only=True)`` too).
        """
        super().load_state_dict(state_dict)
        restore_saved_dtypes(self, state_dict)

    def _step_aux(self, group: dict[str, Any]) -> None:
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            # elementwise, so an FSDP2 shard is updated on its own (its state is the shard's)
            p, grad = local_part(param), local_part(param.grad)
            if not state:
                state["step"] = 0
                # float32 moments for half-precision parameters: a float16 second moment underflows to 0
                state["exp_avg"] = torch.zeros_like(
                    p, dtype=compute_dtype(p.dtype), memory_format=torch.preserve_format
                )
                state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"], memory_format=torch.preserve_format)
            state["step"] += 1
            adamw_update(
                p,
                grad,
                state["exp_avg"],
                state["exp_avg_sq"],
                state["step"],
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )


class RiemannLoRA(Riemannion):
    """The SGD variant (docs/methods.md (Riemannion), "RiemannLoRA"): heavy-ball momentum on ``P_T(G)``, retraction,
    no Ortho.

    The learning rate is in Frobenius units (a plain gradient step on the manifold), so it is usually larger than
    Riemannion's. Every argument is :class:`Riemannion`'s; ``orthogonalize`` defaults to ``False``.
    """

    def __init__(self, params: ParamsT, *, orthogonalize: bool = False, **kwargs: Any) -> None:
        super().__init__(params, orthogonalize=orthogonalize, **kwargs)


def _grad_or_zeros(p: Tensor) -> Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


#: The fixed cost of one batched retraction call (QR, SVD and the orthogonalization of a stack of same-shaped
#: adapters), in units of one adapter's own share of it: profiled on CPU at r = 16 (a tiny Llama's 14 adapters, 4
#: calls a step): 1.5 ms a call against 0.46 ms an adapter, about 3.
CALL_COST = 3.0


def _owners(
    group: dict[str, Any], slots: list[int], split: Optional[tuple[Any, int, int]], has_momentum: bool
) -> tuple[list[int], list[int]]:
    """Which process steps each adapter in this step (by its ``slot``), and the positions of this process's.

    Under FSDP2 the adapters are owned by shape group (:func:`~peft_ext.distributed.owners_by_group`): the step
    stacks same-shaped adapters into one batched call, so owning whole groups halves each process's calls on 2
    processes, where owning every other adapter only halved each call's batch and left the calls' fixed cost whole.
    The owners are computed over every adapter of the group (not only those with gradients), so an adapter's owner,
    which keeps its momentum, never changes. A state saved by the earlier rule (every ``world``-th adapter: no
    ``"momentum_owners"`` in the group) keeps that rule, so its momentum stays with its adapters.
    """
    if split is None:
        return owned_by(slots, None)
    legacy = has_momentum and group.get("momentum_processes", 1) > 1 and "momentum_owners" not in group
    group["momentum_owners"] = "slots" if legacy else "groups"
    if legacy:
        return owned_by(slots, split)
    triples = list(_triples(group))
    keys = [(tuple(A.shape), tuple(B.shape), A.dtype) for A, B, _ in triples]
    costs = [float((A.shape[0] + B.shape[0]) * A.shape[-1]) for A, B, _ in triples]
    mean = sum(costs) / len(costs)
    by_slot = owners_by_group(keys, [c / mean for c in costs], CALL_COST, split[1])
    owners = [by_slot[slot] for slot in slots]
    return owners, [i for i, owner in enumerate(owners) if owner == split[2]]


def _triples(group: dict[str, Any]) -> Iterable[tuple[Tensor, Tensor, Tensor]]:
    params = group["params"]
    return zip(params[0::3], params[1::3], params[2::3])


def create_riemannion_optimizer(
    model: nn.Module,
    lr: float = 1e-3,
    *,
    variant: Literal["muon", "sgd"] = "muon",
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    aux_lr: Optional[float] = None,
    aux_betas: tuple[float, float] = (0.9, 0.999),
    aux_eps: float = 1e-8,
    aux_weight_decay: Optional[float] = None,
    nonfinite: Literal["raise", "skip"] = "raise",
) -> Riemannion:
    """Build a :class:`Riemannion` (or :class:`RiemannLoRA`) for all trainable parameters of a PEFT model.

    Args:
        model: A model with trainable Riemannion adapters (e.g. from ``get_peft_model``).
        lr: Manifold learning rate (spectral-norm units for ``"muon"``, Frobenius units for ``"sgd"``).
        variant: ``"muon"`` (Riemannion) or ``"sgd"`` (RiemannLoRA).
        momentum: Momentum coefficient.
        nesterov: Nesterov momentum.
        weight_decay: Decoupled weight decay of the adapters.
        aux_lr: AdamW learning rate for the other trainable parameters (default ``lr``).
        aux_betas: AdamW betas.
        aux_eps: AdamW eps.
        aux_weight_decay: AdamW weight decay (default ``weight_decay``).
        nonfinite: ``"raise"`` or ``"skip"``; see :class:`Riemannion`.
    """
    variants = {"muon": Riemannion, "sgd": RiemannLoRA}
    if variant not in variants:
        raise ValueError(f"`variant` must be one of {sorted(variants)}, got {variant!r}")
    if not any(ref.A.requires_grad for ref in find_fixed_rank_adapters(model)):
        raise ValueError(
            "create_riemannion_optimizer: the model has no trainable Riemannion adapter; build it with "
            "get_peft_model(model, RiemannionConfig(...)) and make sure the adapter is active"
        )
    return variants[variant](
        model,
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=weight_decay,
        aux_lr=aux_lr,
        aux_betas=aux_betas,
        aux_eps=aux_eps,
        aux_weight_decay=aux_weight_decay,
        nonfinite=nonfinite,
    )
