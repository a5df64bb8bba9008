"""The interface between the Riemannion optimizer and the layers it steps (:mod:`peft_ext.optim.adapters`): the
optimizer imports no tuner, ``RiemannionLayer`` implements the interface, and an optimizer copied or unpickled keeps
its adapters and the names its messages use."""

from __future__ import annotations

import ast
import copy
import pickle
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_ext import RiemannionConfig
from peft_ext.optim import NonFiniteGradientError, Riemannion
from peft_ext.optim.adapters import FixedRankAdapters, find_fixed_rank_adapters
from peft_ext.tuners.riemannion import RiemannionLayer, find_adapters

from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

OPTIM = Path(__file__).resolve().parents[1] / "peft_ext" / "optim"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(6, 8)
        self.lin1 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin1(torch.tanh(self.lin0(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return get_peft_model(MLP(), RiemannionConfig(r=2, target_modules=["lin0", "lin1"], init_scale=0.5))


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_no_optimizer_module_imports_a_tuner():
    for path in sorted(OPTIM.glob("*.py")):
        tuners = [m for m in _imported_modules(path) if "tuners" in m.split(".")]
        assert not tuners, f"{path.name} imports {tuners}"


def test_the_riemannion_layer_implements_the_interface():
    model = _model()
    layers = [m for m in model.modules() if isinstance(m, RiemannionLayer)]
    assert layers and all(isinstance(layer, FixedRankAdapters) for layer in layers)
    found = find_fixed_rank_adapters(model)
    assert [(h.layer_name, h.adapter_name) for h in found] == [
        (r.layer_name, r.adapter_name) for r in find_adapters(model)
    ]
    for handle, ref in zip(found, find_adapters(model)):
        assert handle.A is ref.A and handle.B is ref.B and handle.Z is ref.Z and str(handle) == str(ref)
    layer = layers[0]
    assert torch.equal(layer.cached_right_basis("default"), layer.get_right_basis("default"))
    layer.stop_caching_right_basis()
    assert layer.cached_right_basis("default") is None and not layer.cache_right_basis
    layer.store_right_basis("default", torch.zeros(1))  # ignored: the layer keeps no cache now


def test_a_model_without_the_interface_gets_plain_adamw_only():
    model = MLP()
    optimizer = Riemannion(model, lr=1e-2)
    assert [g["manifold"] for g in optimizer.param_groups] == [False]


@pytest.mark.parametrize("how", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"])
def test_a_copied_optimizer_keeps_its_adapters_and_names(how):
    model = _model()
    optimizer = Riemannion(model, lr=0.05)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    twin = how(optimizer)
    params = [p for group in twin.param_groups for p in group["params"]]
    assert {id(h.A) for h in twin._adapters} <= {id(p) for p in params}  # the copy's own tensors
    bad = twin.param_groups[-1]["params"][0]
    for p in params:
        p.grad = torch.zeros_like(p)
    bad.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"lin0"):
        twin.step()
