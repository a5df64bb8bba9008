"""SplitLoRA's ``end_task`` is all-or-nothing: a module that cannot finish (non-finite ``B`` or inputs)
is found before any module changes, so nothing is folded, advanced or counted, and a retry after the fix gives
exactly what a clean run gives."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_ext import SplitLoRAConfig
from peft_ext.tuners.splitlora import SplitLoRALayer

WIDTH = 16


class Stack(nn.Module):
    """Three adapted linears in a row (and an unadapted head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin0, self.lin1, self.lin2 = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin2(torch.tanh(self.lin1(torch.tanh(self.lin0(x)))))))


def _model(statistics: str):
    config = SplitLoRAConfig(r=2, target_modules=["lin0", "lin1", "lin2"], statistics=statistics, sketch_rank=6)
    model = get_peft_model(Stack(), config)
    layers = {layer.seed_key: layer for layer in model.modules() if isinstance(layer, SplitLoRALayer)}
    assert list(layers) == ["lin0", "lin1", "lin2"]
    return model, layers


def _task(model, layers, seed: int) -> torch.Tensor:
    """Begin a task, give every B values (as training would) and collect statistics; returns the inputs."""
    model.begin_task()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, WIDTH, generator=g)
    with torch.no_grad():
        for layer in layers.values():
            layer.splitlora_B["default"].copy_(torch.randn(WIDTH, 2, generator=g) * 0.1)
        with model.collect_statistics():
            model(x)
    return x


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


def _assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key


@pytest.mark.parametrize("statistics", ["dense", "sketch"])
def test_non_finite_B_in_the_second_module_changes_nothing_and_a_retry_matches_a_clean_run(statistics):
    clean, clean_layers = _model(statistics)
    model, layers = _model(statistics)
    for seed in (0, 1):  # the second task: the running statistics and dW_old are non-trivial
        for net, net_layers in ((clean, clean_layers), (model, layers)):
            _task(net, net_layers, seed)
        if seed == 0:
            clean.end_task()
            model.end_task()
    expected = clean.end_task()
    good_B = layers["lin1"].splitlora_B["default"].detach().clone()
    with torch.no_grad():
        layers["lin1"].splitlora_B["default"][1, 0] = float("inf")
    before = _snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"B of SplitLoRA adapter 'default' on 'lin1' has non-finite values \(1 of "
        r"32, e.g. inf at index \[1, 0\]\); end_task changed nothing",
    ):
        model.end_task()
    _assert_same(_snapshot(model), before)  # lin0 (before the bad module) and lin2 (after it) alike
    assert model.finished_tasks() == 1
    assert all(layer.has_pending_statistics("default") for layer in layers.values())
    with torch.no_grad():
        layers["lin1"].splitlora_B["default"].copy_(good_B)
    assert model.end_task() == expected
    # the same statistics (counted once), folds, next A and counters as the run that never failed
    _assert_same(_snapshot(model), _snapshot(clean))
    assert model.finished_tasks() == 2


def test_non_finite_inputs_are_refused_before_any_module_changes():
    model, layers = _model("dense")
    _task(model, layers, 0)
    model.end_task()
    model.begin_task()
    before = _snapshot(model)
    x = torch.randn(4, WIDTH)
    x[2, 5] = float("nan")
    with torch.no_grad(), model.collect_statistics():
        model(x)
    with pytest.raises(
        ValueError,
        match=r"input statistics of SplitLoRA adapter 'default' \(the task's inputs had "
        r"inf/nan\) on 'lin0' has non-finite values .* end_task changed nothing",
    ):
        model.end_task()
    _assert_same(_snapshot(model), before)
    assert model.finished_tasks() == 1
