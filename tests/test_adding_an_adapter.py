"""docs/adding_an_adapter.md, proven: the test-only adapter in tests/sixth_adapter (built only through the documented
steps) passes the PEFT tuner contract, round-trips through save/load, and gets half precision from the skeleton."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.utils import PeftType
from torch import nn

import peft_ext

from .helpers import ContractMLP as MLP
from .single_thread import single_thread  # noqa: F401  (fixture)
from .sixth_adapter import SCALEDLR, Linear, ScaledLowRankConfig, ScaledLowRankModel
from .tuner_contract import CONTRACT_CHECKS, TunerCase

pytestmark = pytest.mark.usefixtures("single_thread")


def _config(identity: bool) -> ScaledLowRankConfig:
    return ScaledLowRankConfig(r=3, target_modules=["lin0", "lin1"], modules_to_save=["head"], init_weights=identity)


def _inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(6, 64, generator=torch.Generator().manual_seed(3))}


CASE = TunerCase(
    name="scaledlr",
    make_model=MLP,
    make_config=_config,
    make_inputs=_inputs,
    make_optimizer=lambda model: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
    prefix="scaledlr_",
    modules_to_save=("head",),
)


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_tuner_contract(check, tmp_path):
    check(CASE, tmp_path)


def test_registered_and_wrapped():
    assert peft_ext.registered_peft_types()["scaledlr"] is SCALEDLR is PeftType.SCALEDLR
    model = get_peft_model(MLP(), _config(identity=True))
    assert isinstance(model.base_model, ScaledLowRankModel)
    assert isinstance(model.base_model.model.lin0, Linear)
    assert repr(model.base_model.model.lin0).startswith("scaledlr.Linear(")
    with pytest.raises(ValueError, match=r"ScaledLowRank supports torch.nn.Linear, .* target 'emb' is a Embedding"):
        get_peft_model(nn.ModuleDict({"emb": nn.Embedding(4, 4)}), ScaledLowRankConfig(target_modules=["emb"]))
    with pytest.raises(ValueError, match="`r` must be a positive integer, got 0"):
        ScaledLowRankConfig(r=0)


def test_save_load_round_trip_keeps_the_trained_adapter(tmp_path):
    model = get_peft_model(MLP(), _config(identity=False))
    optimizer = CASE.make_optimizer(model)
    model(**_inputs()).square().mean().backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        expected = model(**_inputs())
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(MLP(), tmp_path).eval()
    assert type(loaded.peft_config["default"]) is ScaledLowRankConfig
    for name in ("scaledlr_A", "scaledlr_B"):
        saved = getattr(model.base_model.model.lin0, name)["default"]
        assert torch.equal(getattr(loaded.base_model.model.lin0, name)["default"], saved)
    with torch.no_grad():
        assert torch.equal(loaded(**_inputs()), expected)


def test_half_precision_base_comes_from_the_skeleton():
    """A bf16 base: the adapter runs in float32 (PEFT's autocast), the layer returns bf16, merging stays close."""
    model = get_peft_model(MLP().to(torch.bfloat16), _config(identity=False)).eval()
    layer = model.base_model.model.lin0
    assert layer.scaledlr_A["default"].dtype == torch.float32
    x = _inputs()["x"].to(torch.bfloat16)
    with torch.no_grad():
        out = layer(x)
        expected = layer.base_layer(x).float() + layer.adapter_output(x.float(), "default")
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
        layer.merge()
        torch.testing.assert_close(layer(x).float(), expected, atol=5e-2, rtol=5e-2)
