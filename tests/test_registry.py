"""Tests of peft_ext.registry: extending PeftType, registering with PEFT, and PEFT's save/load path."""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_model_status, get_peft_model
from peft.mapping import (
    PEFT_TYPE_TO_CONFIG_MAPPING,
    PEFT_TYPE_TO_MIXED_MODEL_MAPPING,
    PEFT_TYPE_TO_PREFIX_MAPPING,
    PEFT_TYPE_TO_TUNER_MAPPING,
)
from peft.utils import PeftType
from safetensors.torch import load_file
from torch import nn

import peft_ext
from peft_ext import peft_type_enum, registry
from peft_ext.registry import register_peft_type, registered_peft_types

from .toy_tuner import TOYSCALE, ToyScaleConfig, ToyScaleLinear, ToyScaleModel

MAPPINGS = (
    PEFT_TYPE_TO_CONFIG_MAPPING,
    PEFT_TYPE_TO_TUNER_MAPPING,
    PEFT_TYPE_TO_MIXED_MODEL_MAPPING,
    PEFT_TYPE_TO_PREFIX_MAPPING,
)


class PrefixlessModel(nn.Module):
    """A model class without a ``prefix`` attribute, so that only the prefix argument is validated."""


class BrokenModel(ToyScaleModel):
    prefix = "toybroken_"


class OtherToyModel(ToyScaleModel):
    """Same prefix as ToyScaleModel, but a different class."""


@dataclass
class OtherConfig(PeftConfig):
    pass


def _enum_state() -> tuple:
    return (
        list(PeftType._member_names_),
        dict(PeftType._member_map_),
        dict(PeftType._value2member_map_),
        {k: v for k, v in vars(PeftType).items() if k.isupper()},
        list(PeftType),
    )


def _peft_state() -> tuple:
    return _enum_state(), tuple(dict(mapping) for mapping in MAPPINGS), registered_peft_types()


@pytest.fixture
def unchanged():
    """Assert that the test leaves PeftType, PEFT's mappings and peft_ext's record exactly as they were."""
    before = _peft_state()
    yield
    assert _peft_state() == before


def _assert_absent(upper: str) -> None:
    assert upper not in PeftType._member_map_
    assert upper not in PeftType._member_names_
    assert upper not in PeftType._value2member_map_
    assert upper not in vars(PeftType)
    assert upper not in [member.value for member in PeftType]
    assert all(upper not in mapping for mapping in MAPPINGS)
    assert upper.lower() not in registered_peft_types()


def _make_base() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_package_exports():
    assert peft_ext.__version__ == "0.1.0"
    assert peft_ext.register_peft_type is registry.register_peft_type
    assert peft_ext.registered_peft_types is registry.registered_peft_types


def test_member_behaves_like_builtin_members():
    assert isinstance(TOYSCALE, PeftType)
    assert PeftType["TOYSCALE"] is TOYSCALE
    assert PeftType("TOYSCALE") is TOYSCALE
    assert PeftType.TOYSCALE is TOYSCALE
    assert TOYSCALE in list(PeftType)
    assert TOYSCALE.name == TOYSCALE.value == "TOYSCALE"
    assert TOYSCALE == "TOYSCALE"
    assert repr(TOYSCALE) == "<PeftType.TOYSCALE: 'TOYSCALE'>"
    assert str(TOYSCALE) == str(PeftType.LORA).replace("LORA", "TOYSCALE")
    assert json.dumps({"peft_type": TOYSCALE}) == '{"peft_type": "TOYSCALE"}'
    assert PEFT_TYPE_TO_CONFIG_MAPPING["TOYSCALE"] is ToyScaleConfig
    assert PEFT_TYPE_TO_TUNER_MAPPING["TOYSCALE"] is ToyScaleModel
    assert PEFT_TYPE_TO_PREFIX_MAPPING[TOYSCALE] == "toyscale_"
    assert TOYSCALE not in PEFT_TYPE_TO_MIXED_MODEL_MAPPING


def test_registered_peft_types_lists_only_peft_ext_types():
    registered = registered_peft_types()
    assert registered["toyscale"] is TOYSCALE
    assert "lora" not in registered
    assert all(isinstance(member, PeftType) for member in registered.values())
    registered.clear()  # a copy: clearing it must not forget the registration
    assert registered_peft_types()["toyscale"] is TOYSCALE


def test_train_save_and_load_round_trip(tmp_path):
    x = torch.randn(5, 8)
    base = _make_base()
    with torch.no_grad():
        base_out = base(x)

    model = get_peft_model(base, ToyScaleConfig(target_modules=["0", "2"]))
    assert isinstance(model.base_model, ToyScaleModel)
    assert model.peft_config["default"].peft_type is TOYSCALE
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["base_model.model.0.toyscale_s.default", "base_model.model.2.toyscale_s.default"]
    with torch.no_grad():
        assert torch.equal(model(x), base_out)  # s starts at 0: the adapter starts as the identity

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss = (model(x) - 1.0).pow(2).mean()
    loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        trained_out = model(x)
    assert not torch.allclose(trained_out, base_out)

    model.save_pretrained(tmp_path)
    saved_config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved_config["peft_type"] == "TOYSCALE"
    assert sorted(saved_config["target_modules"]) == ["0", "2"]
    assert sorted(load_file(tmp_path / "adapter_model.safetensors")) == [
        "base_model.model.0.toyscale_s",
        "base_model.model.2.toyscale_s",
    ]

    loaded_config = PeftConfig.from_pretrained(tmp_path)
    assert type(loaded_config) is ToyScaleConfig
    assert loaded_config.peft_type is TOYSCALE
    assert loaded_config.target_modules == {"0", "2"}

    loaded = PeftModel.from_pretrained(_make_base(), tmp_path)
    assert isinstance(loaded.base_model, ToyScaleModel)
    assert loaded.peft_config["default"].peft_type is TOYSCALE
    with torch.no_grad():
        assert torch.equal(loaded(x), trained_out)

    # The second way PEFT resolves the type from adapter_config.json: load_adapter on an existing PeftModel.
    loaded.load_adapter(tmp_path, adapter_name="again")
    loaded.set_adapter("again")
    with torch.no_grad():
        assert torch.equal(loaded(x), trained_out)

    assert get_model_status(loaded).peft_types == {"default": "TOYSCALE", "again": "TOYSCALE"}


def test_merge_and_unload_matches_adapter_output():
    x = torch.randn(5, 8)
    model = get_peft_model(_make_base(), ToyScaleConfig(target_modules=["0", "2"], init_scale=0.25))
    with torch.no_grad():
        adapted = model(x)
        assert not torch.allclose(adapted, _make_base()(x))
        merged = model.merge_and_unload()
        assert not any(isinstance(m, ToyScaleLinear) for m in merged.modules())
        torch.testing.assert_close(merged(x), adapted, rtol=1e-5, atol=1e-6)


def test_unmerge_restores_base_weights():
    model = get_peft_model(_make_base(), ToyScaleConfig(target_modules=["0"], init_scale=0.5))
    layer = model.base_model.model[0]
    original = layer.base_layer.weight.detach().clone()
    layer.merge()
    assert torch.allclose(layer.base_layer.weight, original * 1.5)
    layer.unmerge()
    torch.testing.assert_close(layer.base_layer.weight, original)


def test_registering_again_is_harmless(unchanged):
    for _ in range(2):
        assert register_peft_type("toyscale", config_cls=ToyScaleConfig, model_cls=ToyScaleModel) is TOYSCALE
    assert register_peft_type("toyscale", config_cls=ToyScaleConfig, model_cls=ToyScaleModel, prefix="toyscale_") is (
        TOYSCALE
    )
    assert PeftType._member_names_.count("TOYSCALE") == 1


def test_reloading_the_registry_module_keeps_the_registration(unchanged):
    reloaded = importlib.reload(registry)
    assert reloaded.registered_peft_types() == {**registered_peft_types(), "toyscale": TOYSCALE}
    assert reloaded.register_peft_type("toyscale", config_cls=ToyScaleConfig, model_cls=ToyScaleModel) is TOYSCALE
    assert [member for member in PeftType if member.value == "TOYSCALE"] == [TOYSCALE]


def test_fresh_import_of_the_registry_module_keeps_the_registration(monkeypatch, unchanged):
    monkeypatch.delitem(sys.modules, "peft_ext.registry")
    monkeypatch.setattr(peft_ext, "registry", registry)  # the import below rebinds it; restore it afterwards
    fresh = importlib.import_module("peft_ext.registry")
    assert fresh is not registry
    assert fresh.registered_peft_types()["toyscale"] is TOYSCALE
    assert fresh.register_peft_type("toyscale", config_cls=ToyScaleConfig, model_cls=ToyScaleModel) is TOYSCALE
    with pytest.raises(ValueError, match="built into PEFT"):
        fresh.register_peft_type("lora", config_cls=ToyScaleConfig, model_cls=ToyScaleModel)
    assert PeftType._member_names_.count("TOYSCALE") == 1


def test_reimported_tuner_module_updates_peft_to_the_new_classes():
    toy_tuner = sys.modules[ToyScaleConfig.__module__]
    try:
        importlib.reload(toy_tuner)  # runs its register_peft_type call again, with new class objects
        assert toy_tuner.TOYSCALE is TOYSCALE
        assert toy_tuner.ToyScaleConfig is not ToyScaleConfig
        assert PEFT_TYPE_TO_CONFIG_MAPPING[TOYSCALE] is toy_tuner.ToyScaleConfig
        assert PEFT_TYPE_TO_TUNER_MAPPING[TOYSCALE] is toy_tuner.ToyScaleModel
        assert PeftType._member_names_.count("TOYSCALE") == 1
    finally:
        # The other tests hold the classes imported at the top; point PEFT back to them.
        register_peft_type("toyscale", config_cls=ToyScaleConfig, model_cls=ToyScaleModel)
    assert PEFT_TYPE_TO_CONFIG_MAPPING[TOYSCALE] is ToyScaleConfig


@pytest.mark.parametrize("name", ["lora", "LoRA", "Lora", "ia3", "prompt_tuning", "psoft"])
def test_names_of_builtin_types_are_refused(name, unchanged):
    with pytest.raises(ValueError, match=rf"PeftType\.{name.upper()}, a PEFT type built into PEFT"):
        register_peft_type(name, config_cls=ToyScaleConfig, model_cls=PrefixlessModel)
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.LORA] is LoraConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"config_cls": OtherConfig}, r"config_cls [\w.]*toy_tuner\.ToyScaleConfig != [\w.]*OtherConfig"),
        ({"model_cls": OtherToyModel}, r"model_cls [\w.]*toy_tuner\.ToyScaleModel != [\w.]*OtherToyModel"),
        ({"prefix": "toyscale2_", "model_cls": PrefixlessModel}, r"prefix 'toyscale_' != 'toyscale2_'"),
        ({"is_mixed_compatible": True}, r"is_mixed_compatible False != True"),
    ],
)
def test_conflicting_reregistration_is_refused(kwargs, message, unchanged):
    arguments = {"config_cls": ToyScaleConfig, "model_cls": ToyScaleModel, **kwargs}
    with pytest.raises(ValueError, match=r"'toyscale' is already registered by peft_ext with different") as info:
        register_peft_type("toyscale", **arguments)
    assert info.match(message)
    assert PEFT_TYPE_TO_CONFIG_MAPPING[TOYSCALE] is ToyScaleConfig
    assert PEFT_TYPE_TO_TUNER_MAPPING[TOYSCALE] is ToyScaleModel


@pytest.mark.parametrize("name", ["", "1abc", "toy-scale", "toy scale", "toynew_", "ToyNew", "TOYSCALE", "_toynew"])
def test_invalid_names_are_refused(name, unchanged):
    with pytest.raises(ValueError, match=rf"Invalid PEFT type name {name!r}"):
        register_peft_type(name, config_cls=ToyScaleConfig, model_cls=PrefixlessModel)


@pytest.mark.parametrize("prefix", ["toynew", "_", "_toynew_", "toy new_", "toy-new_", ""])
def test_invalid_prefixes_are_refused(prefix, unchanged):
    with pytest.raises(ValueError, match=rf"Invalid prefix {prefix!r}: .* ends with '_'"):
        register_peft_type("toynew", config_cls=ToyScaleConfig, model_cls=PrefixlessModel, prefix=prefix)


@pytest.mark.parametrize("prefix, owner", [("lora_", "ADALORA, LORA"), ("toyscale_", "TOYSCALE"), ("psoft_", "PSOFT")])
def test_prefixes_in_use_are_refused(prefix, owner, unchanged):
    with pytest.raises(ValueError, match=rf"prefix {prefix!r}: that prefix is already used by {owner};"):
        register_peft_type("toynew", config_cls=ToyScaleConfig, model_cls=PrefixlessModel, prefix=prefix)


def test_model_prefix_must_match(unchanged):
    with pytest.raises(ValueError, match=r"ToyScaleModel\.prefix is 'toyscale_' but prefix='toynew_' was passed"):
        register_peft_type("toynew", config_cls=ToyScaleConfig, model_cls=ToyScaleModel)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": b"toynew"}, "name must be a str"),
        ({"config_cls": LoraConfig()}, "config_cls must be a subclass of peft.PeftConfig"),
        ({"config_cls": dict}, "config_cls must be a subclass of peft.PeftConfig"),
        ({"model_cls": object}, "model_cls must be a torch.nn.Module subclass"),
        ({"prefix": 3}, "prefix must be a str or None, got int 3"),
        ({"is_mixed_compatible": "yes"}, "is_mixed_compatible must be a bool"),
    ],
)
def test_wrong_argument_types_are_refused(kwargs, message, unchanged):
    arguments = {"name": "toynew", "config_cls": ToyScaleConfig, "model_cls": PrefixlessModel, **kwargs}
    name = arguments.pop("name")
    with pytest.raises(TypeError, match=message):
        register_peft_type(name, **arguments)


def test_failed_verification_raises_and_rolls_back(monkeypatch, unchanged):
    # Simulate an interpreter whose by-value lookup reads a structure that peft_ext does not write: the new member
    # would then be reachable by name but not by PeftType("TOYBROKEN"), which is what loading from JSON needs.
    steps = tuple(step for step in peft_type_enum._INSTALL_STEPS if step is not peft_type_enum._map_value)
    assert len(steps) == len(peft_type_enum._INSTALL_STEPS) - 1
    monkeypatch.setattr(peft_type_enum, "_INSTALL_STEPS", steps)
    with pytest.raises(RuntimeError) as info:
        register_peft_type("toybroken", config_cls=ToyScaleConfig, model_cls=BrokenModel)
    message = str(info.value)
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}." in message
    assert "PeftType('TOYBROKEN') is the member" in message
    assert "JSON round trip of a PeftConfig's peft_type" in message
    _assert_absent("TOYBROKEN")


def test_failure_while_installing_rolls_back_the_steps_already_done(monkeypatch, unchanged):
    def boom(member: PeftType):
        raise AttributeError("simulated change of enum internals")

    steps = peft_type_enum._INSTALL_STEPS
    monkeypatch.setattr(peft_type_enum, "_INSTALL_STEPS", (*steps[:2], boom, *steps[2:]))
    with pytest.raises(RuntimeError, match=r"TOYBROKEN failed on Python 3\.\d+\.\d+ .*simulated change"):
        register_peft_type("toybroken", config_cls=ToyScaleConfig, model_cls=BrokenModel)
    _assert_absent("TOYBROKEN")


def test_unsupported_enum_internals_fail_before_changing_anything(monkeypatch, unchanged):
    monkeypatch.setattr(PeftType, "_member_type_", int)
    with pytest.raises(RuntimeError, match=r"Cannot extend peft.utils.PeftType on Python 3\.\d+.*_member_type_"):
        register_peft_type("toybroken", config_cls=ToyScaleConfig, model_cls=BrokenModel)


def test_config_that_does_not_set_its_peft_type_is_refused_and_rolled_back(unchanged):
    # ToyScaleConfig sets PeftType.TOYSCALE, so registering it as "toymismatch" must fail after PEFT's mappings were
    # already written; all of it has to be undone.
    with pytest.raises(ValueError, match=r"expected <PeftType\.TOYMISMATCH: 'TOYMISMATCH'>: set self\.peft_type"):
        register_peft_type("toymismatch", config_cls=ToyScaleConfig, model_cls=PrefixlessModel)
    _assert_absent("TOYMISMATCH")
