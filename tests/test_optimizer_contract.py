"""The contract every peft-ext optimizer keeps, in the spirit of PyTorch's ``OptimizerInfo`` tests: one list of
cases (:data:`CASES`), one test per promise, each run for every optimizer.

Promises: ``state_dict()`` survives ``torch.save`` / ``torch.load(weights_only=True)`` and loads back to the same
state; a resumed run equals an uninterrupted one bit for bit; ``zero_grad(set_to_none=True)`` changes nothing about
the trajectory, and a step without gradients changes nothing; several param groups each use their own options;
``step(closure)`` returns the closure's loss; a non-finite gradient raises naming the parameter before anything
changes, or under ``nonfinite="skip"`` skips the step and counts it in a counter that is saved; bfloat16 parameters
take a step and stay bfloat16.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_ext import RiemannionConfig
from peft_ext.optim import DCTAdamW, NonFiniteGradientError, Riemannion, SubspaceAdamW
from peft_ext.tuners.riemannion import find_adapters

from .helpers import ContractMLP
from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")


def _plain_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return ContractMLP((10, 24, 16, 3)).to(dtype)


def _riemannion_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    config = RiemannionConfig(r=3, target_modules=["lin0", "lin1"], init_scale=0.5, modules_to_save=["head"])
    # autocast off: a bf16 model keeps bf16 adapters, which is what the bf16 promise is about
    return get_peft_model(ContractMLP((10, 24, 16, 3)).to(dtype), config, autocast_adapter_dtype=False)


def _named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _plain_observed(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in _named(model)}


def _riemannion_observed(model: nn.Module) -> dict[str, torch.Tensor]:
    # the adapter's delta A B^T is the point on the manifold; its factors are one of many splits
    deltas = {f"delta{i}": (ref.A @ ref.B.T).detach().clone() for i, ref in enumerate(find_adapters(model))}
    return deltas | {n: p.detach().clone() for n, p in _named(model) if "riemannion_" not in n}


def _plain_groups(model: nn.Module) -> list[dict[str, Any]]:
    named = _named(model)
    return [{"params": [np for np in named if np[0].startswith("lin0.")], "lr": 0.0}] + [
        {"params": [np for np in named if not np[0].startswith("lin0.")]}
    ]


def _riemannion_groups(model: nn.Module) -> list[dict[str, Any]]:
    named = _named(model)
    return [{"params": [p for n, p in named if ".lin0." in n], "lr": 0.0}] + [
        {"params": [p for n, p in named if ".lin0." not in n]}
    ]


@dataclass(frozen=True)
class OptimizerCase:
    """One optimizer as the contract sees it.

    Attributes:
        name: Test id.
        make_model: A seeded model in the given dtype.
        make: ``make(model, params_or_groups, **options)``: the optimizer (``params_or_groups=None``: the default
            parameters of the model).
        groups: Two param groups of a model, the first with ``lr=0``.
        observed: What a step changes, by name (for Riemannion the adapters' ``A B^T``).
        frozen: The prefix of the names in ``observed`` that belong to the ``lr=0`` group.
        nonfinite_error: The exception type ``nonfinite="raise"`` gives.
        bad_param: The parameter given a nan gradient, and how the error names it.
    """

    name: str
    make_model: Callable[[torch.dtype], nn.Module]
    make: Callable[..., torch.optim.Optimizer]
    groups: Callable[[nn.Module], list[dict[str, Any]]]
    observed: Callable[[nn.Module], dict[str, torch.Tensor]]
    frozen: str
    nonfinite_error: type[Exception]
    bad_param: tuple[str, str]


def _plain_case(name: str, cls: Callable[..., torch.optim.Optimizer]) -> OptimizerCase:
    """A projected AdamW on the plain MLP (every parameter its own, named): ``cls(named_params, **options)``."""

    def make(model: nn.Module, params: Any = None, **options: Any) -> torch.optim.Optimizer:
        return cls(_named(model) if params is None else params, **{"lr": 1e-2, "rank": 3, **options})

    bad_param = ("lin1.weight", "`lin1.weight`")
    return OptimizerCase(
        name, _plain_model, make, _plain_groups, _plain_observed, "lin0.", NonFiniteGradientError, bad_param
    )


def _make_riemannion(model: nn.Module, params: Any = None, **options: Any) -> torch.optim.Optimizer:
    return Riemannion(model if params is None else params, model=model, **{"lr": 0.05, "aux_lr": 1e-2, **options})


CASES = [
    _plain_case("dct_adamw", DCTAdamW),
    _plain_case("subspace_adamw", lambda params, **o: SubspaceAdamW(params, update_proj_gap=2, **o)),
    OptimizerCase(
        "riemannion",
        _riemannion_model,
        _make_riemannion,
        _riemannion_groups,
        _riemannion_observed,
        "delta0",
        # Riemannion adopts the shared policy (peft_ext.optim.nonfinite: NonFiniteGradientError, a ValueError too)
        # later; until then it raises a plain ValueError under the same argument name `nonfinite`.
        NonFiniteGradientError,
        ("base_model.model.lin1.riemannion_B.default", "lin1.riemannion_B.default"),
    ),
]


def _batches(n: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(42)
    return [(torch.randn(8, 10, generator=gen).to(dtype), torch.randint(0, 3, (8,), generator=gen)) for _ in range(n)]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches, set_to_none: bool = True) -> None:
    for batch in batches:
        optimizer.zero_grad(set_to_none=set_to_none)
        _loss(model, batch).backward()
        optimizer.step()


def _roundtrip(obj: Any) -> Any:
    blob = io.BytesIO()
    torch.save(obj, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal structure, and tensors equal bit for bit in the same dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _get(model: nn.Module, name: str) -> nn.Parameter:
    return dict(model.named_parameters())[name]


contract = pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)


@contract
def test_state_dict_round_trips_through_weights_only_load(case):
    model = case.make_model(torch.float32)
    optimizer = case.make(model)
    _train(model, optimizer, _batches(3))
    saved = optimizer.state_dict()
    loaded = _roundtrip(saved)
    _assert_same(saved, loaded, "saved")
    fresh = case.make(model)
    fresh.load_state_dict(loaded)
    _assert_same(saved, fresh.state_dict(), "reloaded")


@contract
def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(case):
    batches = _batches(6)
    model = case.make_model(torch.float32)
    optimizer = case.make(model)
    _train(model, optimizer, batches)

    first = case.make_model(torch.float32)
    first_optimizer = case.make(first)
    _train(first, first_optimizer, batches[:3])
    checkpoint = _roundtrip({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()})
    resumed = case.make_model(torch.float32)  # as a new process would start
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer = case.make(resumed)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    _train(resumed, resumed_optimizer, batches[3:])

    _assert_same(model.state_dict(), resumed.state_dict(), "model")
    _assert_same(optimizer.state_dict(), resumed_optimizer.state_dict(), "optimizer")


@contract
def test_zero_grad_set_to_none(case):
    batches = _batches(3)
    model = case.make_model(torch.float32)
    optimizer = case.make(model)
    _train(model, optimizer, batches, set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    zeroed = case.make_model(torch.float32)
    _train(zeroed, case.make(zeroed), batches, set_to_none=False)
    _assert_same(zeroed.state_dict(), model.state_dict(), "set_to_none=False vs True")

    fresh = case.make_model(torch.float32)
    before = case.observed(fresh)
    assert case.make(fresh).step() is None  # no gradient at all: nothing to do
    for key, value in case.observed(fresh).items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)


@contract
def test_several_param_groups_each_use_their_own_options(case):
    model = case.make_model(torch.float32)
    optimizer = case.make(model, case.groups(model))
    assert len(optimizer.param_groups) >= 2 and optimizer.param_groups[0]["lr"] == 0.0
    before = case.observed(model)
    _train(model, optimizer, _batches(3))
    after = case.observed(model)
    for key in before:
        if key.startswith(case.frozen):
            # lr 0 keeps the values (Riemannion re-factors the point in its retraction: equal up to rounding)
            torch.testing.assert_close(after[key], before[key], rtol=1e-5, atol=1e-6, msg=key)
        else:
            assert not torch.equal(after[key], before[key]), f"{key} (default lr) did not move"
    _assert_same(_roundtrip(optimizer.state_dict())["param_groups"], optimizer.state_dict()["param_groups"])


@contract
def test_step_with_a_closure_returns_its_loss(case):
    batch = _batches(1)[0]
    model = case.make_model(torch.float32)
    optimizer = case.make(model)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert isinstance(loss, torch.Tensor) and torch.equal(loss, _loss(case.make_model(torch.float32), batch))
    manual = case.make_model(torch.float32)
    _train(manual, case.make(manual), [batch])
    _assert_same(manual.state_dict(), model.state_dict(), "closure vs backward + step")


@contract
def test_a_nonfinite_gradient_raises_naming_the_parameter_and_changes_nothing(case):
    model = case.make_model(torch.float32)
    optimizer = case.make(model)
    _train(model, optimizer, _batches(2))
    _loss(model, _batches(1)[0]).backward()
    name, shown = case.bad_param
    _get(model, name).grad.view(-1)[1] = float("nan")
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    with pytest.raises(case.nonfinite_error) as caught:
        optimizer.step()
    assert shown in str(caught.value)
    if case.nonfinite_error is NonFiniteGradientError:  # both former types still catch it
        assert isinstance(caught.value, FloatingPointError) and isinstance(caught.value, ValueError)
    _assert_same(weights, model.state_dict(), "model")
    _assert_same(state, optimizer.state_dict(), "optimizer")


@contract
def test_skip_policy_counts_skipped_steps_and_saves_the_count(case):
    # `nonfinite` is the shared policy's argument; Riemannion already has it (it adopts the shared module later)
    model = case.make_model(torch.float32)
    optimizer = case.make(model, nonfinite="skip")
    _train(model, optimizer, _batches(2))
    _loss(model, _batches(1)[0]).backward()
    _get(model, case.bad_param[0]).grad.view(-1)[0] = float("inf")
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()["state"])
    with pytest.warns(UserWarning, match="skipping this optimizer step"):
        optimizer.step()
    assert optimizer.skipped_steps == 1
    _assert_same(weights, model.state_dict(), "model")
    _assert_same(state, optimizer.state_dict()["state"], "optimizer state")
    fresh = case.make(model, nonfinite="skip")
    fresh.load_state_dict(_roundtrip(optimizer.state_dict()))
    assert fresh.skipped_steps == 1
    optimizer.zero_grad()
    _loss(model, _batches(1)[0]).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a finite step neither warns nor counts
        optimizer.step()
    assert optimizer.skipped_steps == 1


@contract
def test_bf16_parameters_take_a_step(case):
    model = case.make_model(torch.bfloat16)
    trainable = _named(model)
    assert all(p.dtype == torch.bfloat16 for _, p in trainable)
    optimizer = case.make(model)
    before = case.observed(model)
    _train(model, optimizer, _batches(3, torch.bfloat16))
    after = case.observed(model)
    assert all(p.dtype == torch.bfloat16 and bool(torch.isfinite(p).all()) for _, p in trainable)
    assert all(not torch.equal(before[key], after[key]) for key in before), "every trainable tensor must move"
    assert _loss(model, _batches(1, torch.bfloat16)[0]).isfinite()
