"""The Riemannion adapter type: registration, the PEFT tuner contract, and the layer's rank-2r gradient trick."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.utils import PeftType
from torch import nn

import peft_ext
from peft_ext import Riemannion, RiemannionConfig
from peft_ext.manifolds import right_basis
from peft_ext.models import tiny_llama
from peft_ext.optim import create_riemannion_optimizer
from peft_ext.tuners.riemannion import RIEMANNION, Linear, RiemannionModel, find_adapters

from .allocations import assert_no_allocation_of, record_allocations
from .helpers import ContractMLP as MLP
from .single_thread import single_thread  # noqa: F401  (fixture)
from .tuner_contract import TunerCase, contract_test

pytestmark = pytest.mark.usefixtures("single_thread")


def _mlp_config(identity: bool) -> RiemannionConfig:
    return RiemannionConfig(
        r=3,
        target_modules=["lin0", "lin1"],
        modules_to_save=["head"],
        init_weights=identity,
        init_scale=None if identity else 1.0,
    )


def _llama_config(identity: bool) -> RiemannionConfig:
    return RiemannionConfig(
        r=2, target_modules=["q_proj", "v_proj"], init_weights=identity, init_scale=None if identity else 1.0
    )


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return create_riemannion_optimizer(model, lr=0.05, aux_lr=1e-2)


CASES = {
    "mlp": TunerCase(
        name="mlp",
        make_model=MLP,
        make_config=_mlp_config,
        make_inputs=lambda: {"x": torch.randn(6, 64, generator=torch.Generator().manual_seed(3))},
        make_optimizer=_optimizer,
        prefix="riemannion_",
        modules_to_save=("head",),
    ),
    "tiny_llama": TunerCase(
        name="tiny_llama",
        make_model=lambda: tiny_llama(hidden_size=64),
        make_config=_llama_config,
        make_inputs=lambda: {"input_ids": torch.randint(0, 128, (4, 7), generator=torch.Generator().manual_seed(3))},
        make_optimizer=_optimizer,
        prefix="riemannion_",
        # only the adapted layers: bitsandbytes 0.50's CPU inference repacking breaks backprop through other 4-bit
        # layers after an eval forward (upstream; see peft_ext.disable_bnb_cpu_repacking)
        quantize=("q_proj", "v_proj"),
        atol=1e-4,
    ),
}


test_tuner_contract = contract_test(CASES)


def test_registered_with_peft():
    assert peft_ext.registered_peft_types()["riemannion"] is RIEMANNION is PeftType.RIEMANNION
    config = RiemannionConfig(r=4, target_modules=["lin0"])
    assert config.peft_type is RIEMANNION
    loaded = PeftConfig.from_peft_type(**json.loads(json.dumps({**config.to_dict(), "target_modules": ["lin0"]})))
    assert type(loaded) is RiemannionConfig and loaded.r == 4 and loaded.target_modules == {"lin0"}
    model = get_peft_model(MLP(), config)
    assert isinstance(model.base_model, RiemannionModel)
    assert isinstance(model.base_model.model.lin0, Linear)
    assert not isinstance(model.base_model.model.lin1, Linear)


def test_default_target_modules_follow_lora_for_known_architectures():
    model = get_peft_model(tiny_llama(), RiemannionConfig(r=2))
    adapted = {ref.layer_name.rsplit(".", 1)[-1] for ref in find_adapters(model)}
    assert adapted == {"q_proj", "v_proj"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"r": 0}, "`r` must be a positive integer, got 0"),
        ({"r": 2.5}, "`r` must be a positive integer, got 2.5"),
        ({"init_scale": -1.0}, "`init_scale` must be a positive finite number or None, got -1.0"),
        ({"init_scale": float("inf")}, "`init_scale` must be a positive finite number"),
        ({"riemannion_dropout": 1.0}, r"`riemannion_dropout` must be in \[0, 1\), got 1.0"),
        ({"init_weights": "loi"}, "`init_weights` must be True or False, got 'loi'"),
        ({"layers_pattern": "layers"}, "`layers_pattern` needs `layers_to_transform`"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RiemannionConfig(**kwargs)


def test_layers_narrower_than_r_get_their_largest_rank_with_one_warning(tmp_path):
    """`all-linear`-style configs include small heads: a rank-8 point does not exist on a 5 x 64 layer, so the
    layer gets rank 5 (named in one warning); the others keep r, and the adapter trains, saves and loads."""
    with pytest.warns(UserWarning, match=r"`r`=8 is larger .* of 1 layer\(s\).*: head \(5 x 64: rank 5\)\.") as caught:
        model = get_peft_model(MLP(), RiemannionConfig(r=8, target_modules=["lin0", "head"], init_weights=False))
    assert sum("is larger than min" in str(w.message) for w in caught) == 1
    layers = model.base_model.model
    assert layers.lin0.r["default"] == 8 and layers.head.r["default"] == 5
    assert layers.head.riemannion_A["default"].shape == (5, 5) and layers.head.riemannion_B["default"].shape == (64, 5)
    x = torch.randn(4, 64)
    optimizer = Riemannion(model, lr=1e-2)
    model(x).square().mean().backward()
    optimizer.step()
    A = layers.head.riemannion_A["default"].detach()
    torch.testing.assert_close(A.T @ A, torch.eye(5), atol=1e-5, rtol=0)  # still a rank-5 point
    with torch.no_grad():
        want = model(x)
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="head"):
        loaded = PeftModel.from_pretrained(MLP(), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), want)


def test_unsupported_target_is_refused():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"supports torch.nn.Linear, .* the target '0' is a Embedding"):
        get_peft_model(model, RiemannionConfig(r=2, target_modules=["0"]))


def test_layer_state_and_zero_delta_at_init():
    model = get_peft_model(MLP(), RiemannionConfig(r=3, target_modules=["lin0", "lin1"], init_scale=0.5))
    for ref in find_adapters(model):
        m, n = ref.layer.out_features, ref.layer.in_features
        assert ref.A.shape == (m, 3) and ref.B.shape == (n, 3) and ref.Z.shape == (m, 3)
        torch.testing.assert_close(ref.A.T @ ref.A, torch.eye(3), atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.linalg.svdvals(ref.B), torch.full((3,), 0.5), atol=1e-6, rtol=0)
        assert torch.equal(ref.Z, torch.zeros(m, 3))
        assert torch.equal(ref.layer.riemannion_X0_A["default"], ref.A.detach())
        assert torch.equal(ref.layer.riemannion_X0_B["default"], ref.B.detach())
        torch.testing.assert_close(ref.layer.get_delta_weight("default"), torch.zeros(m, n), atol=1e-7, rtol=0)
        assert {n for n, p in ref.layer.named_parameters() if p.requires_grad} == {
            "riemannion_A.default",
            "riemannion_B.default",
            "riemannion_Z.default",
        }


@pytest.mark.parametrize("b_scale", [1.0, 1e-6])
def test_one_backward_gives_g_times_b_r_and_g_transpose_times_a(b_scale):
    """dL/dZ = G B_R and dL/dB = G^T A exactly (G = dL/dW), also for a tiny B where inverting qr(B).R would fail."""
    torch.manual_seed(0)
    model = get_peft_model(MLP(), RiemannionConfig(r=3, target_modules=["lin1"], init_weights=False))
    (ref,) = find_adapters(model)
    with torch.no_grad():
        ref.B.mul_(b_scale)
    weight = ref.layer.base_layer.weight
    weight.requires_grad_(True)  # only to compute the reference G; the adapter path never needs it
    x = torch.randn(9, 64)
    model(x).pow(2).sum().backward()
    G = weight.grad.double()
    A, B = ref.A.detach().double(), ref.B.detach().double()
    B_R = right_basis(B)
    torch.testing.assert_close(ref.Z.grad.double(), G @ B_R, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ref.B.grad.double(), G.T @ A, atol=1e-5, rtol=1e-4)
    # the adapter's forward used B_R (not B) for the probe: same span, orthonormal
    torch.testing.assert_close(B_R.T @ B_R, torch.eye(3, dtype=torch.float64), atol=1e-9, rtol=0)

    # after B changes (an optimizer step, a state-dict load) the forward uses the new B's basis, not a stale one
    for change in ("step", "load"):
        if change == "step":
            optimizer = create_riemannion_optimizer(model, lr=0.1)
            optimizer.step()
        else:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            state[next(k for k in state if k.endswith("riemannion_B.default"))] *= 2
            model.load_state_dict(state)
        model.zero_grad()
        weight.grad = None
        model(x).pow(2).sum().backward()
        G = weight.grad.double()
        torch.testing.assert_close(ref.Z.grad.double(), G @ right_basis(ref.B.detach().double()), atol=1e-5, rtol=1e-4)


def test_merge_uses_the_offset_and_keeps_the_base_weight_otherwise():
    model = get_peft_model(MLP(), RiemannionConfig(r=3, target_modules=["lin0"], init_scale=0.3))
    (ref,) = find_adapters(model)
    before = ref.layer.base_layer.weight.detach().clone()
    optimizer = create_riemannion_optimizer(model, lr=0.1)
    model(torch.randn(5, 64)).sum().backward()
    optimizer.step()
    assert torch.equal(ref.layer.base_layer.weight, before), "training must never touch the base weight"
    expected = ref.A @ ref.B.T - ref.layer.riemannion_X0_A["default"] @ ref.layer.riemannion_X0_B["default"].T
    torch.testing.assert_close(ref.layer.get_delta_weight("default"), expected.detach(), atol=1e-7, rtol=0)
    assert expected.abs().max() > 1e-3


def test_forward_and_backward_never_allocate_an_out_by_in_matrix():
    m, n, tokens = 96, 80, 16
    model = get_peft_model(nn.Sequential(nn.Linear(n, m)), RiemannionConfig(r=4, target_modules=["0"]))
    x = torch.randn(tokens, n)

    def run() -> None:
        model(x).pow(2).sum().backward()

    recorder = record_allocations(run, existing=list(model.parameters()) + list(model.buffers()))
    # the base layer's own grad would be m x n; it is frozen, and the adapter path stays at rank 3r
    assert_no_allocation_of(recorder, m * n, "forward + backward of a Riemannion layer")
    assert any("mm" in op for op, _ in recorder.allocations), "backward matmuls were not observed"


def test_lora_and_riemannion_prefixes_do_not_collide():
    base = MLP()
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["lin0"]))
    assert not find_adapters(model)


def test_4bit_base_packed_by_an_earlier_inference_is_unpacked_and_stays_mergeable(bnb_cpu_bf16):
    """bitsandbytes 0.50 repacks 4-bit CPU weights on the first no-grad eval forward (AVX512-BF16 machines); the
    repacked weight dequantizes wrongly and cannot backpropagate. Wrapping undoes and prevents that. Run as on a CPU
    with and without AVX512-BF16 (the fixture), so the repacking happens on every machine in the first case."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from peft.utils.integrations import dequantize_bnb_weight

    def base4() -> nn.Module:
        model = MLP()
        for name in ("lin0", "lin1"):
            linear = getattr(model, name)
            q = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32, quant_type="nf4")
            q.load_state_dict(linear.state_dict())
            setattr(model, name, q.to("cpu"))  # bitsandbytes' defaults: CPU repacking allowed
        return model.eval()

    x = torch.randn(6, 64)
    base = base4()
    with torch.no_grad():
        base(x)  # repacks where bitsandbytes believes the CPU has AVX512-BF16; the adapter must cope either way
    assert getattr(base.lin0.weight.quant_state, "packing_format_for_cpu", False) == bnb_cpu_bf16
    reference = base4()
    reference.lin0.support_avx512bf16_for_cpu = reference.lin1.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        expected_base = reference(x)
    config = RiemannionConfig(r=3, target_modules=["lin0", "lin1"], init_weights=False, init_scale=1.0)
    model = get_peft_model(base, config)
    for ref in find_adapters(model):
        assert not getattr(ref.layer.base_layer.weight.quant_state, "packing_format_for_cpu", False)
        unpacked = getattr(reference, ref.layer_name.rsplit(".", 1)[-1]).weight
        expected = dequantize_bnb_weight(unpacked, state=unpacked.quant_state)
        # packing rounds the block scales to bf16, so unpacking is close but not exact; a still-packed weight would
        # dequantize to garbage (errors ~0.25 here)
        torch.testing.assert_close(ref.layer.get_base_weight(), expected, atol=2e-3, rtol=0)
    model.eval()
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(model(x), expected_base, atol=2e-3, rtol=0)
    _optimizer(model).zero_grad()
    model.train()
    model(x).pow(2).mean().backward()  # would fail on a repacked weight (its kernel has no autograd)
    model.eval()
    with torch.no_grad():
        adapted = model(x)
        model.merge_adapter()
        merged = model(x)
    assert (merged - adapted).norm() < 0.5 * (adapted - expected_base).norm()  # re-quantization error only


def test_low_cpu_mem_usage_loading_creates_on_meta_then_loads_the_point(tmp_path):
    """PEFT's ``low_cpu_mem_usage=True`` creates the adapter on the meta device and assigns the checkpoint's tensors:
    the loaded model equals the saved one (no re-orthonormalization of values that do not exist yet)."""
    model = get_peft_model(
        MLP().to(torch.bfloat16), RiemannionConfig(r=4, target_modules=["lin0"], init_weights=False)
    )
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(MLP().to(torch.bfloat16), tmp_path, low_cpu_mem_usage=True)
    layer = loaded.base_model.model.lin0
    assert not any(t.is_meta for t in layer.state_dict().values())
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), want)
