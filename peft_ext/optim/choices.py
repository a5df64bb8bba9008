"""The optimizers a continual method trains with, chosen by name in its ``optimizer:`` section.

A method's options hold ``optimizer: adamw`` or ``optimizer: {name: dct_adamw, rank: 8, scale: 4.0}``: a registered
:class:`OptimizerChoice` and its options. Each choice declares

- ``steps``, what it can step: any ``parameters`` (AdamW, GaLore, the subspace optimizers), the ``lora_factors`` of
  a LoRA model (Muon, PEFT's Riemannian preconditioner), or ``fixed_rank_adapters`` (Riemannion, RiemannLoRA); a
  method says which of these it offers (``optimizer_steps`` on its options class), so a config naming an optimizer
  the method cannot feed fails when it is read;
- its options, with their defaults read from the optimizer's own signature, validated by the optimizer itself
  (a constructor run on a probe parameter where the constructor checks values), so a wrong value fails when the
  config is read, with the optimizer's own message;
- ``build``, which makes the optimizer for the parameters it steps plus, beside them, the parameters outside its
  reach (a classifier head) trained by AdamW at their own learning rate, as one optimizer (one scheduler drives all).

A new optimizer is a subclass registered with :func:`register_optimizer`; methods, configs and the ``peft-ext``
listing find it there.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import torch
from torch import nn

from .dct_adamw import DCTAdamW
from .riemannion import create_riemannion_optimizer
from .riemannion_checks import check_group
from .subspace_adamw import SubspaceAdamW
from .subspace_checks import matches_target, positive_int

__all__ = [
    "OPTIMIZER_CHOICES",
    "STEPS",
    "OptimizerChoice",
    "OptimizerRequest",
    "StepTogether",
    "check_optimizer",
    "named_trainable",
    "optimizer_choice",
    "optimizer_spec",
    "register_optimizer",
]

#: What an optimizer can step (``OptimizerChoice.steps``).
STEPS = ("parameters", "lora_factors", "fixed_rank_adapters")

#: ``name -> choice class``: every optimizer a method's ``optimizer:`` section can name.
OPTIMIZER_CHOICES: dict[str, type[OptimizerChoice]] = {}

Spec = Union[str, Mapping[str, Any]]


@dataclass
class OptimizerRequest:
    """What a method hands an optimizer choice to build from.

    Args:
        model: The model being trained (choices that find their parameters in it: Riemannion, PEFT's preconditioner).
        params: ``(name, parameter)`` pairs the optimizer steps.
        lr: Their learning rate.
        weight_decay: Their decoupled weight decay.
        others: Trainable parameters outside the optimizer's reach (a classifier head), trained by AdamW.
        others_lr: AdamW learning rate of ``others`` (default ``lr``).
    """

    model: nn.Module
    params: list[tuple[str, nn.Parameter]]
    lr: float
    weight_decay: float = 0.0
    others: list[nn.Parameter] = field(default_factory=list)
    others_lr: float | None = None

    def others_optimizer(self) -> torch.optim.Optimizer | None:
        """AdamW for :attr:`others` at :attr:`others_lr`, or ``None`` when there are none."""
        if not self.others:
            return None
        lr = self.lr if self.others_lr is None else self.others_lr
        return torch.optim.AdamW(self.others, lr=lr, weight_decay=self.weight_decay)


class StepTogether(torch.optim.Optimizer):
    """Several optimizers stepped as one (their param groups are shared, so one LR scheduler drives them all).

    Args:
        optimizers: The optimizers, over disjoint parameters.
    """

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        super().__init__(params, {})
        self.optimizers = optimizers
        self.param_groups = [group for opt in optimizers for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def named_trainable(model: nn.Module, params: list[nn.Parameter]) -> list[tuple[str, nn.Parameter]]:
    """``params`` paired with their names in ``model``, in the given order."""
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [tuple(p.shape) for p in params if id(p) not in names]
    if missing:
        raise ValueError(f"{len(missing)} trainable parameters (shapes {missing[:3]}) are not parameters of the model")
    return [(names[id(p)], p) for p in params]


def _defaults_of(function: Callable[..., Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The defaults of ``keys`` in ``function``'s signature (the optimizer's own)."""
    parameters = inspect.signature(function).parameters
    return {key: parameters[key].default for key in keys}


def _probe() -> list[tuple[str, nn.Parameter]]:
    return [("probe.weight", nn.Parameter(torch.zeros(8, 8)))]


class OptimizerChoice:
    """An optimizer a method's ``optimizer:`` section can name (see the module docstring)."""

    #: The name a config gives.
    name: ClassVar[str]
    #: What it steps: one of :data:`STEPS`.
    steps: ClassVar[str]
    #: One line for listings.
    summary: ClassVar[str]
    #: Why it cannot step FSDP2 shards (it computes with whole matrices), or ``None`` when it can.
    whole_parameters: ClassVar[str | None] = None

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """``{option: default}``: what a config may set beside ``name`` (from the optimizer's own signature)."""
        raise NotImplementedError

    @classmethod
    def check(cls, options: dict[str, Any]) -> None:
        """Raise ``ValueError`` / ``TypeError`` for an invalid value (the keys are known options; default: build
        the optimizer on a probe parameter, whose constructor validates)."""
        request = OptimizerRequest(model=nn.Module(), params=_probe(), lr=1e-3)
        with warnings.catch_warnings():  # e.g. "target_modules matches no parameter": true of the probe, not a fault
            warnings.simplefilter("ignore")
            cls.build(request, {**cls.option_defaults(), **options})

    @classmethod
    def build(cls, request: OptimizerRequest, options: dict[str, Any]) -> torch.optim.Optimizer:
        """The optimizer for ``request`` (its :attr:`~OptimizerRequest.others` included) with ``options`` (every
        option present)."""
        raise NotImplementedError

    @classmethod
    def with_others(cls, optimizer: torch.optim.Optimizer, request: OptimizerRequest) -> torch.optim.Optimizer:
        """``optimizer`` and the AdamW of the request's other parameters, stepped as one."""
        others = request.others_optimizer()
        return optimizer if others is None else StepTogether(optimizer, others)


def register_optimizer(cls: type[OptimizerChoice]) -> type[OptimizerChoice]:
    """Register ``cls`` under its ``name`` (a decorator; a new name only)."""
    if cls.steps not in STEPS:
        raise ValueError(f"{cls.__name__}.steps must be one of {STEPS}, got {cls.steps!r}")
    if cls.name in OPTIMIZER_CHOICES and OPTIMIZER_CHOICES[cls.name] is not cls:
        raise ValueError(f"an optimizer named {cls.name!r} is already registered ({OPTIMIZER_CHOICES[cls.name]})")
    OPTIMIZER_CHOICES[cls.name] = cls
    return cls


def optimizer_choice(name: Any) -> type[OptimizerChoice]:
    """The registered choice ``name``; ``ValueError`` naming the valid ones otherwise."""
    if isinstance(name, str) and name in OPTIMIZER_CHOICES:
        return OPTIMIZER_CHOICES[name]
    close = difflib.get_close_matches(name, list(OPTIMIZER_CHOICES), n=1) if isinstance(name, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"`optimizer` must be one of {sorted(OPTIMIZER_CHOICES)}, got {name!r}{hint}")


def optimizer_spec(spec: Spec) -> tuple[type[OptimizerChoice], dict[str, Any]]:
    """The choice and every option (given ones over the defaults) of an ``optimizer`` value: a name, or a mapping
    with ``name`` and options. Unknown names and options fail here; values are checked by :func:`check_optimizer`."""
    if isinstance(spec, str):
        name, given = spec, {}
    elif isinstance(spec, Mapping) and "name" in spec:
        given = {k: v for k, v in spec.items() if k != "name"}
        name = spec["name"]
    else:
        raise ValueError(f"`optimizer` must be a name or a mapping with a `name` and options, got {spec!r}")
    cls = optimizer_choice(name)
    defaults = cls.option_defaults()
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(
            f"`optimizer.{unknown[0]}` is not an option of {cls.name!r}; its options: {', '.join(defaults) or 'none'}"
        )
    return cls, {**defaults, **given}


def check_optimizer(spec: Spec, steps: tuple[str, ...]) -> dict[str, Any]:
    """Refuse an ``optimizer`` value that names an unknown optimizer or option, has an invalid value, or steps what
    the method does not offer (``steps``: what the method can hand an optimizer); return its effective settings,
    ``{"name": ..., **every option}`` (what a run's fingerprint should hold: two spellings of one optimizer are one
    setting)."""
    cls, options = optimizer_spec(spec)
    if cls.steps not in steps:
        fits = sorted(n for n, c in OPTIMIZER_CHOICES.items() if c.steps in steps)
        raise ValueError(
            f"`optimizer` {cls.name!r} steps {cls.steps.replace('_', ' ')}, which this method does not offer; "
            f"it can train with {', '.join(fits)}"
        )
    try:
        cls.check(options)
    except (ValueError, TypeError) as err:
        raise ValueError(f"`optimizer` {cls.name!r}: {err}") from None
    return {"name": cls.name, **options}


# ----------------------------------------------------------------------------------------------------------------
# the shipped choices


@register_optimizer
class AdamWChoice(OptimizerChoice):
    name = "adamw"
    steps = "parameters"
    summary = "torch.optim.AdamW"

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        return _defaults_of(torch.optim.AdamW.__init__, ("betas", "eps", "amsgrad"))

    @classmethod
    def build(cls, request: OptimizerRequest, options: dict[str, Any]) -> torch.optim.Optimizer:
        groups = [{"params": [p for _, p in request.params], "lr": request.lr}]
        if request.others:  # one AdamW, the others in their own group at their lr
            lr = request.lr if request.others_lr is None else request.others_lr
            groups.append({"params": request.others, "lr": lr})
        betas = tuple(float(b) for b in options["betas"])
        return torch.optim.AdamW(
            groups, betas=betas, eps=options["eps"], amsgrad=options["amsgrad"], weight_decay=request.weight_decay
        )


class _SubspaceChoice(OptimizerChoice):
    """The subspace AdamW family: every keyword option of the optimizer's constructor, validated by it."""

    steps = "parameters"
    optimizer_cls: ClassVar[type[SubspaceAdamW]]
    #: Options exposed beside the constructor's own keywords (those of its basis and update rule).
    part_options: ClassVar[tuple[str, ...]] = ("dct_method", "error_feedback", "column_bias_correction")

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        own = _defaults_of(SubspaceAdamW.__init__, ("betas", "eps", "scale", "target_modules", "max_shape"))
        own |= _defaults_of(SubspaceAdamW.__init__, ("rotate_moments", "moments_8bit", "nonfinite"))
        own |= _defaults_of(cls.optimizer_cls.__init__, ("rank", "update_proj_gap"))
        return {**own, **{key: None for key in cls.part_options}}

    @classmethod
    def build(cls, request: OptimizerRequest, options: dict[str, Any]) -> torch.optim.Optimizer:
        options = {k: v for k, v in options.items() if not (k in cls.part_options and v is None)}
        options["betas"] = tuple(float(b) for b in options["betas"])
        if options["target_modules"] is not None and not isinstance(options["target_modules"], str):
            options["target_modules"] = list(options["target_modules"])
        optimizer = cls.optimizer_cls(request.params, lr=request.lr, weight_decay=request.weight_decay, **options)
        return cls.with_others(optimizer, request)


@register_optimizer
class DCTAdamWChoice(_SubspaceChoice):
    name = "dct_adamw"
    summary = "DCT-AdamW: AdamW with moments in a DCT subspace picked each refresh (no SVD)"
    optimizer_cls = DCTAdamW


@register_optimizer
class SubspaceAdamWChoice(_SubspaceChoice):
    name = "subspace_adamw"
    summary = "SubspaceAdamW: AdamW with low-rank moments, any registered basis and update rule"
    optimizer_cls = SubspaceAdamW

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        return {**super().option_defaults(), **_defaults_of(SubspaceAdamW.__init__, ("basis", "update"))}


@register_optimizer
class GaLoreAdamWChoice(OptimizerChoice):
    """GaLore's ``GaLoreAdamW`` (the galore-torch package) on the 2-D weights of ``target_modules`` below
    ``max_shape``; every other parameter gets AdamW in the same optimizer. Defaults are GaLore's own (README)."""

    name = "galore_adamw"
    steps = "parameters"
    summary = "GaLore-AdamW (galore-torch): AdamW with moments in an SVD subspace"
    whole_parameters = "GaLore's SVD needs each whole matrix"

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        # GaLore's group keys (its README's values) and the AdamW it extends (transformers' AdamW signature)
        return {
            "rank": 128,
            "update_proj_gap": 200,
            "scale": 0.25,
            "proj_type": "std",
            "target_modules": None,
            "max_shape": 32_000,
            "betas": (0.9, 0.999),
            "eps": 1e-6,
        }

    @classmethod
    def check(cls, options: dict[str, Any]) -> None:
        # the package is optional: its checks cannot run here, so the values it would refuse are refused by hand
        for key in ("rank", "update_proj_gap", "max_shape"):
            positive_int(key, options[key])
        if not (isinstance(options["scale"], (int, float)) and options["scale"] > 0):
            raise ValueError(f"`scale` must be > 0, got {options['scale']!r}")
        if options["proj_type"] not in ("std", "reverse_std", "left", "right", "full"):
            raise ValueError(
                f"`proj_type` must be std, reverse_std, left, right or full, got {options['proj_type']!r}"
            )
        betas = options["betas"]
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"`betas` must be two numbers in [0, 1), got {betas!r}")
        if not options["eps"] >= 0:
            raise ValueError(f"`eps` must be >= 0, got {options['eps']!r}")
        if options["target_modules"] is not None and not options["target_modules"]:
            raise ValueError("`target_modules` must name at least one module (or be unset: every 2-D weight)")

    @classmethod
    def projects(cls, name: str, p: torch.Tensor, options: dict[str, Any]) -> bool:
        """Whether parameter ``name`` is projected: a 2-D weight below ``max_shape`` in ``target_modules``."""
        module = name.rsplit(".", 1)[0]
        return (
            p.ndim == 2 and max(p.shape) < options["max_shape"] and matches_target(module, options["target_modules"])
        )

    @classmethod
    def build(cls, request: OptimizerRequest, options: dict[str, Any]) -> torch.optim.Optimizer:
        try:
            from galore_torch import GaLoreAdamW
        except ImportError as err:
            raise ImportError(
                "optimizer 'galore_adamw' needs the galore-torch package: `pip install galore-torch` "
                "(or `pip install 'peft-ext[dev]'`)"
            ) from err
        projected = [p for n, p in request.params if cls.projects(n, p, options)]
        rest = [p for n, p in request.params if not cls.projects(n, p, options)]
        groups = [{"params": rest}] if rest else []
        if projected:
            keys = ("rank", "update_proj_gap", "scale", "proj_type")
            groups.append({"params": projected, **{key: options[key] for key in keys}})
        betas = tuple(float(b) for b in options["betas"])
        optimizer = GaLoreAdamW(
            groups,
            lr=request.lr,
            betas=betas,
            eps=options["eps"],
            weight_decay=request.weight_decay,
            no_deprecation_warning=True,
        )
        return cls.with_others(optimizer, request)


@register_optimizer
class MuonChoice(OptimizerChoice):
    """``torch.optim.Muon`` on the 2-D LoRA factors; its learning rate is matched to AdamW's update RMS by default
    (``adjust_lr_fn: match_rms_adamw``), so one learning-rate grid serves both."""

    name = "muon"
    steps = "lora_factors"
    summary = "torch.optim.Muon on the LoRA factors"

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        keys = ("momentum", "nesterov", "ns_steps", "eps")
        return {**_defaults_of(torch.optim.Muon.__init__, keys), "adjust_lr_fn": "match_rms_adamw"}

    @classmethod
    def build(cls, request: OptimizerRequest, options: dict[str, Any]) -> torch.optim.Optimizer:
        params = [p for _, p in request.params]
        muon = torch.optim.Muon(params, lr=request.lr, weight_decay=request.weight_decay, **options)
        return cls.with_others(muon, request)


@register_optimizer
class RiemannianPreconditionerChoice(OptimizerChoice):
    """PEFT's ``create_riemannian_optimizer`` (scaled GD / RPrecAdamW) wrapping AdamW, on the LoRA pairs of the
    model; ``reg`` damps the preconditioner."""

    name = "riemannian_precond"
    steps = "lora_factors"
    summary = "PEFT's Riemannian preconditioner (RPrecAdamW) on the LoRA pairs"
    whole_parameters = "PEFT's Riemannian preconditioner computes with whole factors"

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        return {"reg": 1e-2}

    @classmethod
    def check(cls, options: dict[str, Any]) -> None:
        if not (isinstance(options["reg"], (int, float)) and options["reg"] >= 0):
            raise ValueError(f"`reg` must be >= 0, got {options['reg']!r}")

    @classmethod
    def build(cls, request: OptimizerRequest, options: dict[str, Any]) -> torch.optim.Optimizer:
        from peft.optimizers import create_riemannian_optimizer

        # PEFT's wrapper optimizes every trainable parameter of the model at one lr: the others (a head) are hidden
        # from it, so they get their own AdamW at their own lr; the preconditioner only touches LoRA pairs
        for p in request.others:
            p.requires_grad_(False)
        try:
            precond = create_riemannian_optimizer(
                request.model, torch.optim.AdamW, lr=request.lr, reg=options["reg"], weight_decay=request.weight_decay
            )
        finally:
            for p in request.others:
                p.requires_grad_(True)
        return cls.with_others(precond, request)


class _FixedRankChoice(OptimizerChoice):
    steps = "fixed_rank_adapters"
    variant: ClassVar[str]

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        return _defaults_of(create_riemannion_optimizer, ("momentum", "nesterov", "nonfinite"))

    @classmethod
    def check(cls, options: dict[str, Any]) -> None:
        group = {"lr": 0.0, "weight_decay": 0.0, "manifold": True, "rtol": None}
        check_group({**group, "momentum": options["momentum"], "nesterov": options["nesterov"]}, 0)
        if options["nonfinite"] not in ("raise", "skip"):
            raise ValueError(f"`nonfinite` must be 'raise' or 'skip', got {options['nonfinite']!r}")

    @classmethod
    def build(cls, request: OptimizerRequest, options: dict[str, Any]) -> torch.optim.Optimizer:
        # the optimizer finds the adapters in the model and trains every other trainable parameter by AdamW
        return create_riemannion_optimizer(
            request.model,
            lr=request.lr,
            variant=cls.variant,
            weight_decay=request.weight_decay,
            aux_lr=request.others_lr,
            aux_weight_decay=request.weight_decay,
            **options,
        )


@register_optimizer
class RiemannionChoice(_FixedRankChoice):
    name = "riemannion"
    variant = "muon"
    summary = "Riemannion: orthogonalized (Muon-style) steps on the fixed-rank manifold; lr in spectral-norm units"


@register_optimizer
class RiemannLoRAChoice(_FixedRankChoice):
    name = "riemannlora"
    variant = "sgd"
    summary = "RiemannLoRA: Riemannian gradient steps on the fixed-rank manifold; lr in Frobenius units"
