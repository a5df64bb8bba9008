"""PyTorch's generic optimizer checks, run over every optimizer of the package and every basis / update rule.

These mirror the ``OptimizerInfo``-driven tests of PyTorch's ``test/test_optim.py`` (``TestOptimRenewed``). The
harness itself (``torch.testing._internal.common_optimizers`` and ``common_utils``) cannot be imported here: it needs
``expecttest``, a PyTorch development dependency that is not a dependency of this package. So :class:`OptimizerInfo`
below carries the same two inputs (the optimizer's option sets, and its error inputs with the expected exception and
message regex, e.g. torch's "lr as a Tensor is not supported" and "Invalid beta parameter at index 0"), plus how to
build a model for it (Riemannion needs a model with adapters), and each test mirrors one of torch's:

* ``test_errors``: torch's generic error inputs (``get_error_inputs_for_all_optims``) and Adam's;
* ``test_save_load_equality_with_weights_only``: ``torch.save`` + ``torch.load(weights_only=True)``, then a fresh
  optimizer that loads the state steps exactly like the original;
* ``test_deepcopy_copies_all_public_attrs``, and a deepcopy / a pickle that then steps like the original;
* ``test_step_pre_hook``, ``test_step_post_hook``, ``test_step_all_hooks`` (per optimizer and global);
* ``test_state_dict_pre_hook``, ``test_state_dict_post_hook``, ``test_load_state_dict_pre_hook_and_prepend``,
  ``test_load_state_dict_post_hook``;
* ``test_forloop_goes_right_direction`` (with and without an LR scheduler), ``test_optimizer_can_be_printed``,
  ``test_step_is_noop_when_params_have_no_grad``, ``test_state_dict_deterministic``.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from peft import get_peft_model
from torch import nn
from torch.nn import Parameter
from torch.optim.lr_scheduler import StepLR
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from peft_ext import RiemannionConfig
from peft_ext.optim import REGISTRY, DCTAdamW, Riemannion, RiemannLoRA, SubspaceAdamW

from .helpers import ContractMLP
from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")


@dataclass(frozen=True)
class ErrorInput:
    """torch's ``ErrorOptimizerInput``: constructor arguments, and the exception (or warning) and message they give."""

    params: Any
    kwargs: dict[str, Any]
    error_type: type[Exception] | type[Warning]
    error_regex: str


@dataclass(frozen=True)
class OptimizerInfo:
    """torch's ``OptimizerInfo``, for this package: the class, its option sets, its error inputs, its model."""

    name: str
    optim_cls: Callable[..., torch.optim.Optimizer]
    #: Option sets; each runs through every test.
    optim_inputs: list[dict[str, Any]]
    #: ``error_inputs(param)`` with a 1 x 1 parameter (torch's ``sample_param``).
    error_inputs: Callable[[Parameter, Parameter], list[ErrorInput]]
    #: A seeded model the optimizer trains.
    make_model: Callable[[], nn.Module]
    #: ``make(model, **options)``: the optimizer over the model's trainable parameters.
    make: Callable[..., torch.optim.Optimizer]
    base_options: dict[str, Any] = field(default_factory=dict)


def _plain_model() -> nn.Module:
    torch.manual_seed(0)
    return ContractMLP((6, 9, 5, 3)).double()


def _adapter_model() -> nn.Module:
    torch.manual_seed(0)
    config = RiemannionConfig(r=2, target_modules=["lin0", "lin1"], init_scale=0.5, modules_to_save=["head"])
    return get_peft_model(ContractMLP((6, 9, 5, 3)).double(), config)


def _generic_errors(cls: Callable[..., torch.optim.Optimizer]) -> Callable[[Parameter, Parameter], list[ErrorInput]]:
    """torch's ``get_error_inputs_for_all_optims`` and ``optim_error_inputs_func_adam`` with our messages where
    torch's are specific to its implementations (``foreach``, ``capturable``)."""

    def inputs(p: Parameter, q: Parameter) -> list[ErrorInput]:
        return [
            ErrorInput(p, {}, TypeError, "params argument given to the optimizer should be an iterable of Tensors"),
            ErrorInput([p, p], {}, UserWarning, ".*a parameter group with duplicate parameters.*"),
            ErrorInput([{"params": p}, {"params": p}], {}, ValueError, "some parameters appear in more than one"),
            ErrorInput([p], {"lr": torch.tensor([0.001, 0.001])}, ValueError, "Tensor lr must be 1-element"),
            ErrorInput([("weight", p), q], {}, ValueError, "all optimizer params should be with/without names"),
            ErrorInput(
                [{"params": [p], "lr": 1e-2}, {"params": [("weight", q)]}],
                {},
                ValueError,
                "all optimizer param groups should be with/without names",
            ),
            ErrorInput([p], {"lr": 1e-2, "betas": (1.0, 0.0)}, ValueError, "Invalid beta parameter at index 0: 1.0"),
            ErrorInput([p], {"lr": 1e-2, "weight_decay": -1}, ValueError, "Invalid weight_decay value: -1"),
            ErrorInput([p], {"lr": torch.tensor(0.001)}, ValueError, "lr as a Tensor is not supported"),
            ErrorInput([p], {"lr": -0.01}, ValueError, "Invalid learning rate: -0.01"),
            ErrorInput([p], {"eps": -1e-8}, ValueError, "Invalid epsilon value: -1e-08"),
            ErrorInput([p], {"betas": (0.9, torch.tensor(0.99))}, ValueError, "betas as Tensors are not supported"),
        ]

    return inputs


def _riemannion_errors(p: Parameter, q: Parameter) -> list[ErrorInput]:
    model = nn.Linear(1, 1)  # no adapters: every parameter goes to the auxiliary AdamW
    return [
        ErrorInput(p, {"model": model}, TypeError, "params argument given to the optimizer should be an iterable"),
        ErrorInput([p], {"model": model, "lr": torch.tensor([1e-3, 1e-3])}, ValueError, "Tensor lr must be 1-elem"),
        ErrorInput([p], {"model": model, "lr": torch.tensor(1e-3)}, ValueError, "lr as a Tensor is not supported"),
        ErrorInput([p], {"model": model, "lr": -1.0}, ValueError, "`lr` must be a finite number >= 0, got -1.0"),
        ErrorInput([p], {"model": model, "weight_decay": -1}, ValueError, "`weight_decay` must be a finite number"),
        ErrorInput([p], {"model": model, "aux_betas": (1.0, 0.9)}, ValueError, "`betas` must be a pair of numbers"),
        ErrorInput([p], {}, TypeError, "needs the model to find the Riemannion adapters"),
    ]


def _subspace_make(cls: Callable[..., torch.optim.Optimizer]) -> Callable[..., torch.optim.Optimizer]:
    def make(model: nn.Module, **options: Any) -> torch.optim.Optimizer:
        return cls(list(model.named_parameters()), **{"lr": 1e-2, "rank": 2, **options})

    return make


def _riemannion_make(cls: Callable[..., torch.optim.Optimizer]) -> Callable[..., torch.optim.Optimizer]:
    def make(model: nn.Module, **options: Any) -> torch.optim.Optimizer:
        return cls(model, **{"lr": 0.05, "aux_lr": 1e-2, **options})

    return make


_PAIRS = [{"basis": b, "update": u, "update_proj_gap": 2} for b in REGISTRY["basis"] for u in REGISTRY["update"]]

OPTIM_DB = [
    OptimizerInfo(
        "dct_adamw",
        DCTAdamW,
        [{}, {"weight_decay": 0.1, "error_feedback": True, "column_bias_correction": True}, {"update": "channel"}],
        _generic_errors(DCTAdamW),
        _plain_model,
        _subspace_make(DCTAdamW),
    ),
    OptimizerInfo(
        "subspace_adamw",
        SubspaceAdamW,
        _PAIRS + [{"rotate_moments": False, "side": "right", "scale": 2.0}],
        _generic_errors(SubspaceAdamW),
        _plain_model,
        _subspace_make(SubspaceAdamW),
    ),
    OptimizerInfo(
        "riemannion",
        Riemannion,
        [{}, {"nesterov": True, "weight_decay": 0.01}, {"momentum": 0.0}],
        _riemannion_errors,
        _adapter_model,
        _riemannion_make(Riemannion),
    ),
    OptimizerInfo("riemannlora", RiemannLoRA, [{}], _riemannion_errors, _adapter_model, _riemannion_make(RiemannLoRA)),
]

CASES = [
    pytest.param(info, options, id=f"{info.name}-{'-'.join(f'{k}={v}' for k, v in options.items()) or 'default'}")
    for info in OPTIM_DB
    for options in info.optim_inputs
]


def _batch(model: nn.Module, t: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + t)
    x = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    return model(x).sin().sum()


def _backward(model: nn.Module, t: int) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    loss = _batch(model, t)
    loss.backward()
    return loss


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for t in steps:
        _backward(model, t)
        optimizer.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def _model_and_optimizer(info: OptimizerInfo, options: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = info.make_model()
    return model, info.make(model, **options)


@pytest.mark.parametrize("info", OPTIM_DB, ids=[i.name for i in OPTIM_DB])
def test_errors(info):
    p = Parameter(torch.randn(1, 1))
    q = Parameter(torch.randn(1, 1))
    for case in info.error_inputs(p, q):
        if issubclass(case.error_type, Warning):
            with pytest.warns(case.error_type, match=case.error_regex):
                info.optim_cls(case.params, **case.kwargs)
        else:
            with pytest.raises(case.error_type, match=case.error_regex):
                info.optim_cls(case.params, **case.kwargs)


@pytest.mark.parametrize("info, options", CASES)
def test_save_load_equality_with_weights_only(info, options):
    model, optimizer = _model_and_optimizer(info, options)
    _train(model, optimizer, range(3))
    blob = io.BytesIO()
    torch.save(optimizer.state_dict(), blob)
    blob.seek(0)
    loaded = torch.load(blob, weights_only=True)
    twin = copy.deepcopy(model)
    fresh = info.make(twin, **options)
    fresh.load_state_dict(loaded)
    _train(model, optimizer, range(3, 7))
    _train(twin, fresh, range(3, 7))
    _assert_same_params(model, twin)


@pytest.mark.parametrize("info, options", CASES)
def test_state_dict_deterministic(info, options):
    model, optimizer = _model_and_optimizer(info, options)
    _train(model, optimizer, range(2))
    first, second = optimizer.state_dict(), optimizer.state_dict()
    assert first["param_groups"] == second["param_groups"]
    assert first["state"].keys() == second["state"].keys()
    for key, state in first["state"].items():
        for name, value in state.items():
            other = second["state"][key][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def _public_attrs(obj: object) -> set[str]:
    return {k for k in obj.__dict__ if not k.startswith("_")}


@pytest.mark.parametrize("info, options", CASES)
def test_deepcopy_copies_all_public_attrs(info, options):
    model, optimizer = _model_and_optimizer(info, options)
    _train(model, optimizer, range(3))
    assert _public_attrs(optimizer) == _public_attrs(copy.deepcopy(optimizer))


def _copy_by_pickle(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return pickle.loads(pickle.dumps(optimizer))


@pytest.mark.parametrize("how", [copy.deepcopy, _copy_by_pickle], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("info, options", CASES)
def test_a_copy_steps_like_the_original(info, options, how):
    """What a deepcopy or a pickle of the optimizer alone keeps (torch keeps ``defaults``, ``state`` and
    ``param_groups``) is enough to step: the copy's parameters take the original's steps."""
    model, optimizer = _model_and_optimizer(info, options)
    _train(model, optimizer, range(3))
    _backward(model, 3)
    twin = how(optimizer)
    assert {k: v for k, v in twin.defaults.items() if k != "differentiable"} == optimizer.defaults  # torch adds it
    ours = [p for g in optimizer.param_groups for p in g["params"]]
    theirs = [p for g in twin.param_groups for p in g["params"]]
    assert len(ours) == len(theirs)
    for p, q in zip(ours, theirs):  # a pickled tensor leaves its gradient behind
        q.grad = None if p.grad is None else p.grad.clone()
    optimizer.step()
    twin.step()
    for p, q in zip(ours, theirs):
        assert p is not q and torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("info, options", CASES[:: max(1, len(CASES) // 6)])
def test_step_pre_hook_post_hook_and_global_hooks(info, options):
    model, optimizer = _model_and_optimizer(info, options)
    calls: list[str] = []
    handles = [
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre")),
        optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post")),
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda opt, a, k: calls.append("global post")),
    ]
    try:
        _train(model, optimizer, range(2))
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["global pre", "pre", "post", "global post"] * 2
    _train(model, optimizer, range(2, 3))
    assert len(calls) == 8  # removed hooks stay removed


@pytest.mark.parametrize("info, options", CASES[:: max(1, len(CASES) // 6)])
def test_state_dict_and_load_state_dict_hooks(info, options):
    model, optimizer = _model_and_optimizer(info, options)
    _train(model, optimizer, range(2))
    calls: list[str] = []

    def post(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        calls.append("state_dict post")
        state_dict["extra"] = "kept"
        return state_dict

    optimizer.register_state_dict_pre_hook(lambda opt: calls.append("state_dict pre"))
    optimizer.register_state_dict_post_hook(post)
    saved = optimizer.state_dict()
    assert saved["extra"] == "kept" and calls == ["state_dict pre", "state_dict post"]

    fresh = info.make(copy.deepcopy(model), **options)
    order: list[str] = []

    def pre(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        order.append("pre")
        state_dict = dict(state_dict)
        state_dict.pop("extra")
        return state_dict

    fresh.register_load_state_dict_pre_hook(pre)
    fresh.register_load_state_dict_pre_hook(lambda opt, sd: order.append("prepended"), prepend=True)
    fresh.register_load_state_dict_post_hook(lambda opt: order.append("post"))
    fresh.load_state_dict(saved)
    assert order == ["prepended", "pre", "post"]


@pytest.mark.parametrize("with_scheduler", [False, True], ids=["plain", "steplr"])
@pytest.mark.parametrize("info, options", CASES)
def test_forloop_goes_right_direction(info, options, with_scheduler):
    model, optimizer = _model_and_optimizer(info, options)
    scheduler = StepLR(optimizer, step_size=2, gamma=0.5) if with_scheduler else None
    before = float(_batch(model, 0).detach())
    for _ in range(6):
        _backward(model, 0)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    assert float(_batch(model, 0).detach()) < before
    if scheduler is not None:  # the scheduler's keys in the param groups survive a weights_only round trip
        blob = io.BytesIO()
        torch.save(optimizer.state_dict(), blob)
        blob.seek(0)
        assert torch.load(blob, weights_only=True)["param_groups"][0]["initial_lr"] == optimizer.defaults["lr"]


@pytest.mark.parametrize("info", OPTIM_DB, ids=[i.name for i in OPTIM_DB])
def test_optimizer_can_be_printed(info):
    _, optimizer = _model_and_optimizer(info, {})
    text = repr(optimizer)
    assert text.startswith(type(optimizer).__name__) and "Parameter Group 0" in text


@pytest.mark.parametrize("info", OPTIM_DB, ids=[i.name for i in OPTIM_DB])
def test_step_is_noop_when_params_have_no_grad(info):
    model, optimizer = _model_and_optimizer(info, {})
    before = _params(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    after = _params(model)
    assert all(torch.equal(before[n], after[n]) for n in before) and not optimizer.state
