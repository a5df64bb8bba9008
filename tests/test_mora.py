"""The MoRA adapter type: PEFT's tuner contract on a tiny CLIP, plus what is specific to MoRA (docs/methods.md (MoRA)):
the Gram coupling across towers, the exact identity at init (in every dtype), one-tower forwards and the tie kept
through save/load."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import PeftConfig, PeftModel, get_peft_model
from peft.utils import PeftType
from safetensors.torch import load_file
from torch import nn

import peft_ext
from peft_ext import MoRAConfig
from peft_ext.models import tiny_clip
from peft_ext.tuners.mora import MORA, Linear, MoRAModel, magnitude_scale, plan_targets, row_norm

from .tuner_contract import CONTRACT_CHECKS, TunerCase


def _clip(text_hidden: int = 32, vision_hidden: int = 48) -> nn.Module:
    """tiny_clip with random LayerNorm affines: with CLIP's default (1, 0) the pooled outputs have a constant norm,
    so the contract's squared-output loss would have no gradient."""
    model = tiny_clip(text_hidden=text_hidden, vision_hidden=vision_hidden)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=gen))
                module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=gen))
    return model.eval()


def _inputs(rows: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "input_ids": torch.randint(3, 128, (rows, 7), generator=gen),
        "pixel_values": torch.randn(rows, 3, 16, 16, generator=gen),
    }


def _pooled(out) -> torch.Tensor:
    # per-row outputs of both towers (logits_per_image mixes rows, which the mixed-batch check cannot use)
    return torch.cat([out.text_model_output.pooler_output, out.vision_model_output.pooler_output], dim=1)


def _config(identity: bool) -> MoRAConfig:
    return MoRAConfig(r=2, init_weights=identity)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


CASE = TunerCase(
    name="tiny_clip",
    make_model=_clip,
    make_config=_config,
    make_inputs=_inputs,
    make_optimizer=_adamw,
    prefix="mora_",
    output=_pooled,
    # the adapted projections only: bitsandbytes 0.50's CPU repacking breaks backprop through other 4-bit layers
    quantize=("q_proj", "k_proj", "v_proj", "out_proj"),
    atol=1e-4,
)


_SLOW_CHECKS = ("check_bnb_8bit", "check_bnb_4bit", "check_bnb_4bit_bf16")


@pytest.mark.parametrize(
    "check",
    [pytest.param(c, marks=pytest.mark.slow) if c.__name__ in _SLOW_CHECKS else c for c in CONTRACT_CHECKS],
    ids=lambda c: c.__name__.removeprefix("check_"),
)
def test_tuner_contract(check, tmp_path):
    check(CASE, tmp_path)


def test_registered_with_peft():
    assert peft_ext.registered_peft_types()["mora"] is MORA is PeftType.MORA
    config = MoRAConfig(r=3, layers=[1])
    assert config.peft_type is MORA
    saved = {**config.to_dict(), "target_modules": sorted(config.target_modules)}
    loaded = PeftConfig.from_peft_type(**json.loads(json.dumps(saved)))
    assert type(loaded) is MoRAConfig and loaded.r == 3 and loaded.layers == [1]
    model = get_peft_model(_clip(), config)
    assert isinstance(model.base_model, MoRAModel)
    adapted = sorted(n for n, m in model.named_modules() if isinstance(m, Linear))
    assert len(adapted) == 8 and all(".layers.1." in n for n in adapted)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"r": 0}, "`r` must be a positive integer, got 0"),
        ({"alpha": float("nan")}, "`alpha` must be a finite number, got nan"),
        ({"top_layers": 0}, "`top_layers` must be a positive integer, got 0"),
        ({"layers": []}, r"`layers` must be a non-empty list of non-negative ints or None, got \[\]"),
        ({"layers": [1, 1]}, r"`layers` must not repeat an index, got \[1, 1\]"),
        ({"text_pattern": "text_model"}, "`text_pattern` needs a capturing group"),
        ({"vision_pattern": "(["}, "`vision_pattern` is not a valid regex"),
        ({"shared_init_std": -1.0}, "`shared_init_std` must be a positive finite number or None, got -1.0"),
        ({"init_weights": "yes"}, "`init_weights` must be True or False, got 'yes'"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoRAConfig(**kwargs)


def test_plan_pairs_top_layers_of_towers_of_different_depth():
    model = _clip()
    plan = plan_targets(model, MoRAConfig(top_layers=1))
    assert {t.pair_key for t in plan.values()} == {"t1_v1"}
    assert {(t.modality, t.width) for t in plan.values()} == {("text", 32), ("vision", 48)}
    # a 3-layer vision tower: its top layer (2) pairs with the text tower's top layer (1)
    deeper = tiny_clip()
    deeper.vision_model.encoder.layers.append(copy.deepcopy(deeper.vision_model.encoder.layers[1]))
    plan = plan_targets(deeper, MoRAConfig(top_layers=2))
    assert sorted({t.pair_key for t in plan.values()}) == ["t0_v1", "t1_v2"]


def test_plan_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"`layers` asks for layers \[5\] but the text tower has .* \[0, 1\]"):
        plan_targets(_clip(), MoRAConfig(layers=[5]))
    with pytest.raises(ValueError, match="`top_layers`=3 but the text tower has 2"):
        plan_targets(_clip(), MoRAConfig(top_layers=3))
    with pytest.raises(ValueError, match=r"adapts square projections only .* 'text_model.encoder.layers.1.mlp.fc1'"):
        plan_targets(_clip(), MoRAConfig(target_modules=["fc1"], top_layers=1))
    with pytest.raises(ValueError, match="no vision-tower module matches"):
        plan_targets(_clip(), MoRAConfig(vision_pattern=r"visual\.blocks\.(\d+)\."))


def test_generic_dual_encoder_through_patterns():
    """Any dual encoder: module names chosen freely, towers of widths 8 and 12."""

    class Tower(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(width, width)}) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.tanh(block["proj"](x))
            return x

    class DualEncoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words, self.pixels = Tower(8), Tower(12)

        def forward(self, t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.words(t), self.pixels(v)], dim=1)

    config = MoRAConfig(
        r=2,
        target_modules=["proj"],
        text_pattern=r"^words\.blocks\.(\d+)\.",
        vision_pattern=r"^pixels\.blocks\.(\d+)\.",
        layers=[0, 2],
    )
    model = get_peft_model(DualEncoder(), config)
    shared = model.base_model.shared_factors()
    assert sorted(shared) == ["t0_v0", "t2_v2"]
    assert shared["t2_v2"][0].shape == (8, 2) and shared["t2_v2"][1].shape == (12, 2)
    assert isinstance(model.base_model.model.words.blocks[2]["proj"], Linear)
    assert not isinstance(model.base_model.model.words.blocks[1]["proj"], Linear)


def _layer(model: PeftModel, tower: str, layer: int = 1, proj: str = "q_proj") -> Linear:
    return model.get_submodule(f"base_model.model.{tower}_model.encoder.layers.{layer}.self_attn.{proj}")


def test_composition_matches_the_formula_and_the_gram_coupling():
    """W' = m_sh rownorm(W + a S (G) S^T) + m_sp rownorm(W + a M_B M_A), computed independently here."""
    model = get_peft_model(_clip(), MoRAConfig(r=3, alpha=6.0, init_weights=False))
    s_a, s_b = model.base_model.shared_factors()["t1_v1"]
    for tower, own, other in (("text", s_a, s_b), ("vision", s_b, s_a)):
        layer = _layer(model, tower)
        w = layer.get_base_weight().clone()
        a = 6.0 / 3
        d_sh = own @ other.T @ other @ own.T
        d_sp = layer.mora_spec_B["default"] @ layer.mora_spec_A["default"]
        m_sh, m_sp = layer.mora_mag_shared["default"], layer.mora_mag_specific["default"]
        expected = (m_sh / (w + a * d_sh).norm(dim=1)).unsqueeze(1) * (w + a * d_sh) + (
            m_sp / (w + a * d_sp).norm(dim=1)
        ).unsqueeze(1) * (w + a * d_sp)
        torch.testing.assert_close(w + layer.get_delta_weight("default"), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.shared_delta("default"), d_sh)


def test_identity_at_init_is_exact_and_magnitudes_sum_to_the_weight_norm():
    base = _clip()
    with torch.no_grad():
        expected = _pooled(base(**_inputs()))
    model = get_peft_model(copy.deepcopy(base), MoRAConfig(r=4))
    with torch.no_grad():
        assert torch.equal(_pooled(model(**_inputs())), expected)
    for module in model.modules():
        if isinstance(module, Linear):
            assert torch.equal(
                module.get_delta_weight("default"), torch.zeros(module.out_features, module.in_features)
            )
            total = module.mora_mag_shared["default"] + module.mora_mag_specific["default"]
            torch.testing.assert_close(total, row_norm(module.get_base_weight()))


def _tower_outputs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(**inputs)
    return {
        f"{tower}.{key}": getattr(out, f"{tower}_model_output")[key]
        for tower in ("text", "vision")
        for key in ("last_hidden_state", "pooler_output")
    } | {"logits_per_image": out.logits_per_image}


def _base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name.replace(".base_layer", ""): p.detach().clone()
        for name, p in model.named_parameters()
        if "mora_" not in name
    }


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "no_autocast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_identity_at_init_is_exact_in_half_precision(dtype, autocast):
    """Both towers' outputs of a half-precision CLIP are bit-identical to the base model's at init, with PEFT's
    autocast_adapter_dtype either way; merging at init leaves every base weight bit-identical, and so does unmerging.
    (A bfloat16 m_sp = ||W|| rounded to the base dtype used to make s_sp = 1 +- 2^-9: outputs moved by up to 0.03.)"""
    base = _clip().to(dtype)
    inputs = _inputs()
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    expected, weights = _tower_outputs(base, inputs), _base_weights(base)
    model = get_peft_model(copy.deepcopy(base), MoRAConfig(r=4), autocast_adapter_dtype=autocast).eval()
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    want = torch.float32 if autocast else dtype
    assert {m.mora_mag_specific["default"].dtype for m in layers} == {want}
    for key, value in _tower_outputs(model, inputs).items():
        assert torch.equal(value, expected[key]), f"{key} moved at init by {(value - expected[key]).abs().max()}"
    for module in layers:
        assert not module.get_delta_weight("default").any()
    for action in (model.merge_adapter, model.unmerge_adapter):
        action()
        after = _base_weights(model.base_model.model)
        assert all(torch.equal(after[name], value) for name, value in weights.items()), action.__name__
        for key, value in _tower_outputs(model, inputs).items():
            assert torch.equal(value, expected[key]), f"{key} after {action.__name__}"


def test_half_magnitudes_divide_the_norm_at_their_precision():
    norm = torch.tensor([1.0 + 2**-10, 3.0, 0.0])
    # bfloat16 rounds 1 + 2^-10 to 1: the ratio is exactly 1, not 1 - 2^-10; an all-zero row stays at scale 0
    assert torch.equal(magnitude_scale(norm.bfloat16(), norm), torch.tensor([1.0, 1.0, 0.0]))
    magnitude = torch.tensor([2.0, 1.5, 0.0])
    assert torch.equal(magnitude_scale(magnitude, norm), torch.tensor([2.0 / (1.0 + 2**-10), 0.5, 0.0]))


def _shared_grads(model: PeftModel, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    s_a, s_b = model.base_model.shared_factors()["t1_v1"]
    return s_a.grad.clone(), s_b.grad.clone()


@pytest.mark.parametrize("tower", ["text", "vision"])
def test_one_tower_loss_reaches_the_other_towers_factor(tower):
    """Text-only inputs give S_B (the vision factor) a gradient through S_B^T S_B, and vice versa."""
    model = get_peft_model(_clip(), MoRAConfig(r=2, init_weights=False))
    inputs = _inputs()
    if tower == "text":
        out = model.get_text_features(input_ids=inputs["input_ids"])
    else:
        out = model.get_image_features(pixel_values=inputs["pixel_values"])
    out = getattr(out, "pooler_output", out)
    grad_a, grad_b = _shared_grads(model, out.pow(2).mean())
    assert grad_a.abs().sum() > 0 and grad_b.abs().sum() > 0
    # the other tower's specific parameters got nothing: the coupling is through the shared pair only
    other = "vision" if tower == "text" else "text"
    assert _layer(model, other).mora_spec_A["default"].grad is None


def test_one_tower_forwards_equal_the_full_forward():
    model = get_peft_model(_clip(), MoRAConfig(r=2, init_weights=False)).eval()
    inputs = _inputs()
    with torch.no_grad():
        full = model(**inputs)
        text = model.get_text_features(input_ids=inputs["input_ids"])
        image = model.get_image_features(pixel_values=inputs["pixel_values"])
    text = getattr(text, "pooler_output", text)
    image = getattr(image, "pooler_output", image)
    torch.testing.assert_close(text, full.text_embeds * text.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(image, full.image_embeds * image.norm(dim=-1, keepdim=True))


def test_identity_init_trains_the_shared_pair_after_the_first_step():
    model = get_peft_model(_clip(), MoRAConfig(r=2))
    optimizer = _adamw(model)
    s_a, s_b = (p.detach().clone() for p in model.base_model.shared_factors()["t1_v1"])
    for _ in range(2):
        optimizer.zero_grad()
        _pooled(model(**_inputs())).pow(2).mean().backward()
        optimizer.step()
    new_a, new_b = model.base_model.shared_factors()["t1_v1"]
    assert not torch.equal(new_a, s_a) and not torch.equal(new_b, s_b)
    assert _layer(model, "vision").mora_mag_shared["default"].abs().sum() > 0


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True], ids=["materialized", "low_cpu_mem_usage"])
def test_save_keeps_one_copy_and_the_tie_survives_loading(tmp_path, low_cpu_mem_usage):
    model = get_peft_model(_clip(), MoRAConfig(r=2, init_weights=False))
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    shared_keys = sorted(k for k in saved if "mora_shared" in k)
    assert shared_keys == [
        "base_model.mora_shared_text.t0_v0",
        "base_model.mora_shared_text.t1_v1",
        "base_model.mora_shared_vision.t0_v0",
        "base_model.mora_shared_vision.t1_v1",
    ]
    # nothing else stores a (d x r) factor: no per-layer copies of the shared pair
    assert sum(1 for k in saved if k.endswith("mora_spec_A")) == 16 and len(saved) == 4 + 16 * 4

    loaded = PeftModel.from_pretrained(_clip(), tmp_path, is_trainable=True, low_cpu_mem_usage=low_cpu_mem_usage)
    s_a, s_b = loaded.base_model.shared_factors()["t1_v1"]
    torch.testing.assert_close(s_b, saved["base_model.mora_shared_vision.t1_v1"], atol=0, rtol=0)
    vision = _layer(loaded, "vision", proj="v_proj")
    assert vision._mora_shared.pair("default", "t1_v1", "vision")[0] is s_b
    before = vision.get_delta_weight("default").detach().clone()
    optimizer = torch.optim.SGD([s_a, s_b], lr=0.1)
    text = loaded.get_text_features(input_ids=_inputs()["input_ids"])
    getattr(text, "pooler_output", text).pow(2).mean().backward()
    assert s_b.grad is not None and s_b.grad.abs().sum() > 0
    optimizer.step()
    assert not torch.allclose(vision.get_delta_weight("default"), before), "a text gradient must move the vision delta"


def test_merge_with_two_active_adapters_equals_the_unmerged_forward():
    model = get_peft_model(_clip(), MoRAConfig(r=2, init_weights=False)).eval()
    torch.manual_seed(5)
    model.add_adapter("other", MoRAConfig(r=3, init_weights=False))
    model.base_model.set_adapter(["default", "other"])
    model.eval()
    with torch.no_grad():
        both = _pooled(model(**_inputs()))
        weights = {n: p.clone() for n, p in model.named_parameters() if "base_layer.weight" in n}
        model.merge_adapter()
        torch.testing.assert_close(_pooled(model(**_inputs())), both, atol=1e-4, rtol=1e-4)
        model.unmerge_adapter()
    for name, p in model.named_parameters():
        if name in weights:
            torch.testing.assert_close(p, weights[name], atol=1e-4, rtol=1e-4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".other." in n or n.endswith(".other") for n in trainable)
    assert any(".default." in n or n.endswith(".default") for n in trainable)


def test_set_requires_grad_covers_the_shared_pair():
    model = get_peft_model(_clip(), MoRAConfig(r=2))
    s_a, s_b = model.base_model.shared_factors()["t1_v1"]
    model.base_model.set_requires_grad("default", requires_grad=False)
    assert not s_a.requires_grad and not s_b.requires_grad
    assert not _layer(model, "text").mora_spec_A["default"].requires_grad
    model.base_model.set_requires_grad("default", requires_grad=True)
    assert s_a.requires_grad and s_b.requires_grad


def test_inference_mode_load_freezes_the_shared_pair(tmp_path):
    get_peft_model(_clip(), MoRAConfig(r=2)).save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(_clip(), tmp_path)
    assert not any(p.requires_grad for p in loaded.parameters())


def test_delete_adapter_removes_its_shared_pair():
    model = get_peft_model(_clip(), MoRAConfig(r=2))
    model.add_adapter("other", MoRAConfig(r=2))
    model.delete_adapter("other")
    assert list(model.base_model.mora_shared_text.keys()) == ["default"]
    with pytest.raises(ValueError, match="unknown adapter 'other'"):
        model.base_model.shared_factors("other")
