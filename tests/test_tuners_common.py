"""The pieces the tuners share (peft_ext.tuners._common): target checks, rank checks, adapter_names routing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_ext import MoRAConfig
from peft_ext.models import tiny_bert, tiny_clip
from peft_ext.tuners import (
    AdapterLayer,
    AdapterLinear,
    delta_matmul,
    require_linear_target,
    require_positive_int,
    validate_target_selection,
)

from .helpers import ADAPTER_CONFIGS


def test_require_linear_target_names_the_module_and_its_type():
    require_linear_target(nn.Linear(3, 3), "a.b", "X")  # no error
    with pytest.raises(ValueError, match=r"X supports torch.nn.Linear, .* the target 'a.emb' is a Embedding"):
        require_linear_target(nn.Embedding(4, 3), "a.emb", "X")


@pytest.mark.parametrize("name", sorted(ADAPTER_CONFIGS))
def test_non_linear_targets_are_refused_by_every_tuner(name):
    config = ADAPTER_CONFIGS[name]()
    config.target_modules = ["word_embeddings"]
    with pytest.raises(ValueError, match="word_embeddings"):
        get_peft_model(tiny_bert(), config)


def test_mora_refuses_a_rank_above_the_projection_width():
    with pytest.raises(ValueError, match=r"`r`=100 is larger than the width 32 of .*Use r <= 32"):
        get_peft_model(tiny_clip(), MoRAConfig(r=100, top_layers=1))


@pytest.mark.parametrize("name", sorted(ADAPTER_CONFIGS))
def test_adapter_names_errors_name_what_exists(name):
    model = get_peft_model(tiny_bert(), ADAPTER_CONFIGS[name]())
    ids = torch.randint(0, 100, (2, 5))
    with pytest.raises(
        ValueError, match=r"^Cannot pass `adapter_names` when the model is in training mode\..*inference only"
    ):
        model.train()(input_ids=ids, adapter_names=["default", "default"])
    model.eval()
    with pytest.raises(
        ValueError, match=r"^Trying to infer with non-existing adapter\(s\): other \(known: \['default'\] and"
    ):
        model(input_ids=ids, adapter_names=["default", "other"])
    with torch.no_grad():
        mixed = model(input_ids=ids, adapter_names=["__base__", "default"])[0]
        with model.disable_adapter():
            base = model(input_ids=ids)[0]
    torch.testing.assert_close(mixed[0], base[0])
    if name != "pclr":  # PCLR merges only with static routing
        model.merge_adapter()
        with pytest.raises(
            ValueError, match=r"^Cannot pass `adapter_names` when there are merged adapters, please call"
        ):
            model(input_ids=ids, adapter_names=["default", "default"])


# --- the adapter skeleton (peft_ext.tuners: AdapterLayer / AdapterLinear / AdapterTuner) ----------------------------


def test_config_checks_shared_by_every_adapter_config():
    config = SimpleNamespace(target_modules=["a", "b"], exclude_modules=("c",), layers_to_transform=None)
    validate_target_selection(config)
    assert config.target_modules == {"a", "b"} and config.exclude_modules == {"c"}
    with pytest.raises(ValueError, match="`layers_to_transform` cannot be used when `target_modules` is a regex"):
        validate_target_selection(SimpleNamespace(target_modules=".*q", layers_to_transform=[0]))
    with pytest.raises(ValueError, match="`layers_pattern` cannot be used when `target_modules` is a regex"):
        validate_target_selection(SimpleNamespace(target_modules=".*q", layers_pattern="layers"))
    with pytest.raises(ValueError, match="`layers_pattern` needs `layers_to_transform`"):
        validate_target_selection(SimpleNamespace(target_modules=["q"], layers_pattern="layers"))
    require_positive_int(SimpleNamespace(r=3), "r")
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=rf"`r` must be a positive integer, got {bad!r}"):
            require_positive_int(SimpleNamespace(r=bad), "r")


def test_delta_matmul_computes_half_precision_in_float32_on_cpu():
    left, right = torch.randn(8, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    for dtype in (torch.float16, torch.bfloat16):
        out = delta_matmul(left.to(dtype), right.to(dtype))
        assert out.dtype == dtype
        assert torch.equal(out, (left.to(dtype).float() @ right.to(dtype).float()).to(dtype))
    assert torch.equal(delta_matmul(left, right), left @ right)


class _Scale(AdapterLayer):
    """A minimal skeleton user: ``delta = diag(s)``, with an after_forward hook that counts calls."""

    method_name = "Scale"
    adapter_dict_name = "scale_s"
    adapter_layer_names = ("scale_s",)

    def __init__(self, base_layer: nn.Module) -> None:
        AdapterLayer.__init__(self, base_layer)
        self.scale_s = nn.ParameterDict({})
        self.calls = 0

    def adapter_output(self, x, adapter_name, rows=None):
        return x * self.scale_s[adapter_name]

    def get_delta_weight(self, adapter_name):
        return torch.diag(self.scale_s[adapter_name])

    def after_forward(self, x, result):
        self.calls += 1
        return result


class _ScaleLinear(AdapterLinear, _Scale):
    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        _Scale.__init__(self, base_layer)
        for name, value in (("a", 0.5), ("b", -2.0)):
            self.scale_s[name] = nn.Parameter(torch.full((4,), value))
        self._active_adapter = ["a", "b"]


def test_adapter_linear_dispatch_merge_and_mixed_batch():
    torch.manual_seed(0)
    layer = _ScaleLinear(nn.Linear(4, 4))
    x = torch.randn(3, 4)
    base = layer.base_layer(x)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), base + 0.5 * x - 2.0 * x)
        mixed = layer(x, adapter_names=["a", "__base__", "b"])
        torch.testing.assert_close(mixed, torch.stack([base[0] + 0.5 * x[0], base[1], base[2] - 2.0 * x[2]]))
        with pytest.raises(
            ValueError, match=r"^Length of `adapter_names` should be the same as the number of inputs, but got 2 and 3"
        ):
            layer(x, adapter_names=["a", "b"])
        weight = layer.base_layer.weight.clone()
        layer.merge(adapter_names=["a"])
        assert layer.merged_adapters == ["a"]
        torch.testing.assert_close(layer(x), base + 0.5 * x)  # merged: the base layer alone
        layer.enable_adapters(False)
        torch.testing.assert_close(layer(x), base)  # disabling unmerges
        assert not layer.merged and torch.allclose(layer.base_layer.weight, weight)
        layer.enable_adapters(True)
        layer.scale_s["b"].fill_(float("nan"))
        with pytest.raises(ValueError, match="Merging Scale adapter 'b' gives non-finite weights"):
            layer.merge(safe_merge=True, adapter_names=["b"])
        assert torch.equal(layer.base_layer.weight, weight)
    assert layer.calls == 4  # after_forward ran in every branch: plain, mixed, merged, disabled
    assert repr(layer).startswith("scale._ScaleLinear(")
    assert layer.carried_adapters() == ["a", "b"] and layer.carries_adapter("a") and not layer.carries_adapter("c")
