"""peft_ext.disable_bnb_cpu_repacking: bitsandbytes 4-bit layers stay trainable and mergeable on CPU.

The repacking branch runs on every machine: the ``bnb_cpu_bf16`` fixture fakes bitsandbytes' CPU detection, and
weights that an earlier inference would have repacked are packed here with bitsandbytes' own (pure torch) routine.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import peft_ext
from peft_ext import disable_bnb_cpu_repacking

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import _convert_weight_packed_for_cpu, dequantize_4bit  # noqa: E402


def linear4bit(in_features: int, out_features: int) -> nn.Module:
    """A bitsandbytes NF4 layer with double-quantized scales (bitsandbytes' default), quantized on CPU."""
    layer = bnb.nn.Linear4bit(in_features, out_features, compute_dtype=torch.float32, quant_type="nf4")
    return layer.to("cpu")  # bitsandbytes quantizes on the first device move


def four_bit_mlp() -> nn.Module:
    """Two 4-bit layers, one nested a level down, and a plain head; widths the fused CPU kernel accepts."""
    torch.manual_seed(0)
    return nn.Sequential(linear4bit(64, 128), nn.Sequential(nn.Tanh(), linear4bit(128, 64)), nn.Linear(64, 3))


def four_bit_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def is_packed(layer: nn.Module) -> bool:
    return getattr(layer.weight.quant_state, "packing_format_for_cpu", False)


def test_is_exported_and_leaves_plain_layers_alone():
    assert peft_ext.disable_bnb_cpu_repacking is disable_bnb_cpu_repacking
    layer = nn.Linear(3, 3)
    before = layer.weight.detach().clone()
    disable_bnb_cpu_repacking(layer)
    assert torch.equal(layer.weight, before)


def test_weights_repacked_anywhere_in_the_model_are_unpacked():
    """A weight an earlier inference repacked (on an AVX512-BF16 CPU) dequantizes to wrong values; every 4-bit layer
    of the model, nested ones included, gets its standard layout back and no longer repacks."""
    model = four_bit_mlp()
    originals = []
    for layer in four_bit_layers(model):
        weight = layer.weight
        originals.append((weight.data.clone(), dequantize_4bit(weight.data, weight.quant_state).clone()))
        layer.support_avx512bf16_for_cpu = True
        weight.data, weight.quant_state = _convert_weight_packed_for_cpu(weight.data, weight.quant_state)
        packed = dequantize_4bit(weight.data, weight.quant_state)
        assert (packed - originals[-1][1]).abs().max() > 0.05, "a packed weight dequantizes correctly (vacuous test)"
    head = model[2].weight.detach().clone()

    disable_bnb_cpu_repacking(model)

    for layer, (data, dense) in zip(four_bit_layers(model), originals):
        assert not layer.support_avx512bf16_for_cpu
        assert not is_packed(layer)
        assert torch.equal(layer.weight.data, data)
        # packing rounded the block scales to bf16 (and re-quantized the double-quantized ones): close, not exact
        unpacked = dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        torch.testing.assert_close(unpacked, dense, atol=1e-3, rtol=0)
    assert torch.equal(model[2].weight, head)


def test_training_after_an_evaluation_gets_the_gradients_of_training_alone(bnb_cpu_bf16):
    """On an AVX512-BF16 CPU an eval no-grad forward would repack every 4-bit layer, and the repacked kernel has no
    autograd: the next backward would give the input no gradient. With the opt-out the gradient equals a model's that
    never evaluated; without AVX512-BF16 the opt-out changes nothing."""
    x = torch.randn(5, 64)

    def input_grad(model: nn.Module) -> torch.Tensor | None:
        model.train()
        leaf = x.clone().requires_grad_()
        model(leaf).pow(2).sum().backward()
        return leaf.grad

    expected = input_grad(four_bit_mlp())
    model = four_bit_mlp()
    assert all(layer.support_avx512bf16_for_cpu == bnb_cpu_bf16 for layer in four_bit_layers(model))
    disable_bnb_cpu_repacking(model)
    model.eval()
    with torch.no_grad():
        model(x)
    assert not any(is_packed(layer) for layer in four_bit_layers(model))
    torch.testing.assert_close(input_grad(model), expected)
