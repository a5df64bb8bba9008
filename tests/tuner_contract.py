"""The PEFT tuner contract as reusable checks, for every adapter type peft_ext ships.

A :class:`TunerCase` describes one adapter type on one base model (how to build the model, the config, an input
batch, and an optimizer that trains it). Each ``check_*`` function takes ``(case, tmp_path)`` and asserts one part of
the contract that PEFT's own tuners satisfy:

- only adapter parameters (and ``modules_to_save``) are trainable, and training changes nothing else;
- ``save_pretrained`` / ``PeftModel.from_pretrained`` / ``load_adapter`` round trip;
- merge / unmerge / ``merge_and_unload`` equal the unmerged adapter; safe merge refuses non-finite weights;
- ``disable_adapter`` gives the base model; several adapters switch; ``delete_adapter`` removes one;
- mixed-adapter batches (``adapter_names=`` in forward) equal per-adapter forwards, row by row;
- bitsandbytes 8-bit and 4-bit base layers: forward, backward, a training step, save/load and merge;
- half precision (PEFT's own fp16 / bf16 tuner tests, made quantitative): the adapter's effect in a float16 /
  bfloat16 model matches float32 with and without ``autocast_adapter_dtype``, whose meaning is PEFT's (True: the
  adapter's trainable weights are float32; False: they take the base's dtype); merging in half precision equals the
  unmerged output; training steps in half precision without autocast; a 4-bit base with bfloat16 compute.

Use it from a test module::

    CASE = TunerCase(name="mytuner", make_model=..., make_config=..., make_inputs=..., make_optimizer=...)

    @pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda c: c.__name__)
    def test_contract(check, tmp_path):
        check(CASE, tmp_path)
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from torch import nn


@dataclass
class TunerCase:
    """One adapter type on one base model.

    Args:
        name: Label for test ids.
        make_model: A fresh base model, the same weights on every call.
        make_config: ``make_config(identity: bool) -> PeftConfig``: with ``identity=True`` the adapter starts as
            the identity (the method's default init), with ``False`` it changes the output (e.g.
            ``init_weights=False``), so merge/switching/mixed batches are tested on a visible delta.
        make_inputs: A batch for ``model(**inputs)``.
        make_optimizer: The optimizer that trains the adapter (the method's own, e.g. Riemannion).
        prefix: The adapter parameters' name prefix, e.g. ``"riemannion_"``.
        output: Extracts the output tensor from the model's return value.
        modules_to_save: Names of modules the config marks trainable besides the adapters (empty if none).
        quantize: Names (suffixes) of the linear layers to quantize in the bitsandbytes checks; ``None`` quantizes
            every ``nn.Linear`` the config targets.
        atol: Absolute tolerance of float32 comparisons.
    """

    name: str
    make_model: Callable[[], nn.Module]
    make_config: Callable[[bool], PeftConfig]
    make_inputs: Callable[[], dict[str, torch.Tensor]]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    prefix: str
    output: Callable[[Any], torch.Tensor] = field(default=lambda out: getattr(out, "logits", out))
    modules_to_save: tuple[str, ...] = ()
    quantize: tuple[str, ...] | None = None
    atol: float = 1e-5


def _inputs(case: TunerCase, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    inputs = case.make_inputs()
    if dtype is None:
        return inputs
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def _out(case: TunerCase, model: nn.Module, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return case.output(model(**_inputs(case, dtype), **kwargs)).float()


def _peft(case: TunerCase, identity: bool, base: nn.Module | None = None, **kwargs: Any) -> PeftModel:
    torch.manual_seed(1)
    return get_peft_model(base if base is not None else case.make_model(), case.make_config(identity), **kwargs)


def _train_steps(case: TunerCase, model: nn.Module, steps: int = 2, dtype: torch.dtype | None = None) -> None:
    model.train()
    optimizer = case.make_optimizer(model)
    if dtype == torch.float16:
        # torch.optim.AdamW keeps float16 moments for float16 parameters: g^2 underflows to 0 and its eps=1e-8 is 0
        # in float16 too, so the step is 0/0. Pure-fp16 AdamW needs eps >= 1e-4 (peft-ext's optimizers keep float32
        # moments instead, for which a larger eps changes nothing here).
        for group in optimizer.param_groups:
            if "eps" in group:
                group["eps"] = max(group["eps"], 1e-4)
    for _ in range(steps):
        optimizer.zero_grad()
        # a loss that depends on every output: the squared output moves every adapter that is used
        out = case.output(model(**_inputs(case, dtype)))
        out.float().pow(2).mean().backward()
        optimizer.step()
    model.eval()


def _adapter_state(model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if prefix in k}


def _base_weights(model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if prefix not in k}


def _close(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    return torch.allclose(a, b, atol=atol, rtol=1e-4)


# -- checks ------------------------------------------------------------------------------------------------------


def check_identity_at_init(case: TunerCase, tmp_path: Path) -> None:
    """The default initialization leaves the model's output unchanged."""
    base = case.make_model().eval()
    expected = _out(case, base)
    model = _peft(case, identity=True, base=copy.deepcopy(base)).eval()
    torch.testing.assert_close(_out(case, model), expected, atol=case.atol, rtol=1e-5)


def check_only_adapter_params_trainable(case: TunerCase, tmp_path: Path) -> None:
    """Only adapter parameters (and modules_to_save copies) require grad, and training changes nothing else."""
    model = _peft(case, identity=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable, "no trainable parameters"
    for name in trainable:
        assert case.prefix in name or any(f"{m}.modules_to_save." in name for m in case.modules_to_save), name
    base_before = {k: v for k, v in _base_weights(model, case.prefix).items() if "modules_to_save" not in k}
    adapter_before = _adapter_state(model, case.prefix)
    _train_steps(case, model)
    base_after = _base_weights(model, case.prefix)
    for key, value in base_before.items():
        assert torch.equal(value, base_after[key]), f"training changed the frozen {key}"
    adapter_after = _adapter_state(model, case.prefix)
    assert any(not torch.equal(adapter_before[k], adapter_after[k]) for k in adapter_before), "adapters did not train"


def check_save_load_round_trip(case: TunerCase, tmp_path: Path) -> None:
    """save_pretrained -> PeftModel.from_pretrained / load_adapter reproduces the trained adapter exactly."""
    model = _peft(case, identity=True)
    _train_steps(case, model)
    expected = _out(case, model)
    assert not _close(expected, _out(case, case.make_model().eval()), case.atol), "training had no visible effect"
    model.save_pretrained(tmp_path)
    saved = sorted(load_file(tmp_path / "adapter_model.safetensors"))
    assert any(case.prefix in k for k in saved), saved
    # besides the adapter only the modules_to_save copies are saved, never the base weights
    others = [k for k in saved if case.prefix not in k]
    assert all(any(f".{m}." in k for m in case.modules_to_save) for k in others), others
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == model.peft_config["default"].peft_type.value

    loaded = PeftModel.from_pretrained(case.make_model(), tmp_path).eval()
    assert type(loaded.peft_config["default"]) is type(model.peft_config["default"])
    assert torch.equal(_out(case, loaded), expected)
    loaded.load_adapter(tmp_path, adapter_name="again")
    loaded.set_adapter("again")
    assert torch.equal(_out(case, loaded), expected)


def check_merge_unmerge(case: TunerCase, tmp_path: Path) -> None:
    """Merged output equals the adapter's; unmerging restores the base weights; merge_and_unload matches."""
    model = _peft(case, identity=False).eval()
    base_out = _out(case, case.make_model().eval())
    adapted = _out(case, model)
    assert not _close(adapted, base_out, case.atol), "the non-identity config must change the output"
    weights_before = _base_weights(model, case.prefix)
    model.merge_adapter()
    torch.testing.assert_close(_out(case, model), adapted, atol=case.atol, rtol=1e-4)
    model.unmerge_adapter()
    for key, value in _base_weights(model, case.prefix).items():
        torch.testing.assert_close(value, weights_before[key], atol=case.atol, rtol=1e-5)
    torch.testing.assert_close(_out(case, model), adapted, atol=case.atol, rtol=1e-4)
    merged = model.merge_and_unload()
    assert not any(case.prefix in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_out(case, merged), adapted, atol=case.atol, rtol=1e-4)


def check_safe_merge_refuses_nonfinite(case: TunerCase, tmp_path: Path) -> None:
    """safe_merge raises ValueError on non-finite merged weights and leaves the base weights untouched."""
    model = _peft(case, identity=False).eval()
    weights_before = _base_weights(model, case.prefix)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if case.prefix in name:
                p.fill_(float("nan"))
    with pytest.raises(ValueError, match="(?i)non-finite|nan"):
        model.merge_adapter(safe_merge=True)
    for key, value in _base_weights(model, case.prefix).items():
        assert torch.equal(value, weights_before[key]), f"a failed safe merge changed {key}"


def check_disable_adapter(case: TunerCase, tmp_path: Path) -> None:
    """Inside disable_adapter() the model is the base model, merged or not; outside it the adapter is back."""
    model = _peft(case, identity=False).eval()
    base_out = _out(case, case.make_model().eval())
    adapted = _out(case, model)
    with model.disable_adapter():
        torch.testing.assert_close(_out(case, model), base_out, atol=case.atol, rtol=1e-5)
    torch.testing.assert_close(_out(case, model), adapted, atol=case.atol, rtol=1e-5)
    model.merge_adapter()
    with model.disable_adapter():
        torch.testing.assert_close(_out(case, model), base_out, atol=case.atol, rtol=1e-4)


def _two_adapters(case: TunerCase) -> tuple[PeftModel, torch.Tensor, torch.Tensor]:
    model = _peft(case, identity=False).eval()
    first = _out(case, model)
    torch.manual_seed(2)
    model.add_adapter("other", case.make_config(False))
    model.eval()
    model.set_adapter("other")
    second = _out(case, model)
    model.set_adapter("default")
    return model, first, second


def check_multiple_adapters(case: TunerCase, tmp_path: Path) -> None:
    """A second adapter coexists; set_adapter switches outputs and trainable parameters."""
    model, first, second = _two_adapters(case)
    assert not _close(first, second, case.atol), "two randomly initialized adapters should differ"
    torch.testing.assert_close(_out(case, model), first, atol=0, rtol=0)
    model.set_adapter("other")
    torch.testing.assert_close(_out(case, model), second, atol=0, rtol=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and case.prefix in n]
    assert trainable and all(n.endswith(".other") or ".other." in n for n in trainable), trainable


def check_delete_adapter(case: TunerCase, tmp_path: Path) -> None:
    """delete_adapter removes the adapter's parameters and config; the remaining adapter is unchanged."""
    model, first, _ = _two_adapters(case)
    model.delete_adapter("other")
    assert "other" not in model.peft_config
    assert not any(".other" in n for n, _ in model.named_parameters())
    assert not any(".other" in k for k in model.state_dict())
    torch.testing.assert_close(_out(case, model), first, atol=0, rtol=0)


def check_mixed_adapter_batch(case: TunerCase, tmp_path: Path) -> None:
    """adapter_names=[...] in forward applies a different adapter (or none: "__base__") to each row."""
    model, first, second = _two_adapters(case)
    base_out = _out(case, case.make_model().eval())
    rows = first.shape[0]
    assert rows >= 3, "the contract needs a batch of at least 3 rows"
    names = [("default", "other", "__base__")[i % 3] for i in range(rows)]
    mixed = _out(case, model, adapter_names=names)
    for i, name in enumerate(names):
        expected = {"default": first, "other": second, "__base__": base_out}[name][i]
        torch.testing.assert_close(mixed[i], expected, atol=case.atol, rtol=1e-4)
    with pytest.raises(ValueError, match="nknown|non-existing"):
        _out(case, model, adapter_names=["nope"] * rows)


def quantize_linears(
    model: nn.Module, bits: int, names: tuple[str, ...], compute_dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Replace the ``nn.Linear`` modules whose names end with one of ``names`` by bitsandbytes layers, in place.

    Args:
        model: The model.
        bits: 8 (``Linear8bitLt``, int8 weights) or 4 (``Linear4bit``, NF4 weights).
        names: Module-name suffixes to quantize.
        compute_dtype: The 4-bit layers' compute dtype (``bnb_4bit_compute_dtype``).
    """
    import bitsandbytes as bnb

    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(name == s or name.endswith("." + s) for s in names)
    ]
    assert targets, f"no nn.Linear named {names} to quantize"
    for name, linear in targets:
        has_bias = linear.bias is not None
        if bits == 8:
            q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False)
        else:
            q = bnb.nn.Linear4bit(
                linear.in_features, linear.out_features, bias=has_bias, compute_dtype=compute_dtype, quant_type="nf4"
            )
        q.load_state_dict(linear.state_dict())
        q = q.to("cpu")  # quantizes the weights (bitsandbytes quantizes on the first device move)
        # The same 4-bit CPU kernel with and without the adapter, so "disabled == base" compares like with like:
        # adapter layers opt out of bitsandbytes' AVX512-BF16 inference repacking (see the Riemannion layer).
        if hasattr(q, "support_avx512bf16_for_cpu"):
            q.support_avx512bf16_for_cpu = False
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, q)
    return model


def _check_bnb(case: TunerCase, tmp_path: Path, bits: int) -> None:
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    layer_cls = bnb.nn.Linear8bitLt if bits == 8 else bnb.nn.Linear4bit
    names = case.quantize or tuple(case.make_config(True).target_modules)

    def make_base() -> nn.Module:
        return quantize_linears(case.make_model(), bits, names).eval()

    base_out = _out(case, make_base())
    model = _peft(case, identity=False, base=make_base())
    wrapped = [m for m in model.modules() if hasattr(m, "base_layer") and isinstance(m.base_layer, layer_cls)]
    assert wrapped, f"no adapter layer wraps a {layer_cls.__name__}"

    model.eval()
    adapted = _out(case, model)  # an inference forward first: training must still work after it
    assert torch.isfinite(adapted).all()
    assert not _close(adapted, base_out, case.atol), "the adapter has no effect on the quantized base"
    with model.disable_adapter():
        torch.testing.assert_close(_out(case, model), base_out, atol=case.atol, rtol=1e-5)

    # a training step: gradients reach the adapters through the quantized layers; the base weights stay put
    before = [layer.get_base_weight().clone() for layer in wrapped]
    _train_steps(case, model, steps=1)
    trained = _out(case, model)
    assert not _close(trained, adapted, case.atol), "training did not change the output"
    for layer, weight in zip(wrapped, before):
        assert torch.equal(layer.get_base_weight(), weight), "training changed a quantized base weight"

    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(make_base(), tmp_path).eval()
    assert torch.equal(_out(case, loaded), trained)

    # merging re-quantizes W + delta: it must land near the adapted output, far closer than the base output is
    loaded.merge_adapter()
    merged = _out(case, loaded)
    gap = (trained - base_out).norm()
    assert (merged - trained).norm() < 0.5 * gap, f"merge error {(merged - trained).norm():.3g} vs delta {gap:.3g}"


def check_bnb_8bit(case: TunerCase, tmp_path: Path) -> None:
    """The adapter on bitsandbytes Linear8bitLt base layers (int8 weights; CPU backend of bitsandbytes >= 0.45)."""
    _check_bnb(case, tmp_path, bits=8)


def check_bnb_4bit(case: TunerCase, tmp_path: Path) -> None:
    """The adapter on bitsandbytes Linear4bit base layers (NF4 weights, float32 compute)."""
    _check_bnb(case, tmp_path, bits=4)


# -- half precision ------------------------------------------------------------------------------------------------

HALF = (torch.float16, torch.bfloat16)
# Relative error allowed in an adapter's effect computed in half precision, on top of the noise floor below.
HALF_RTOL = {torch.float16: 0.05, torch.bfloat16: 0.2}


def _half_peft(case: TunerCase, dtype: torch.dtype, autocast: bool, identity: bool = False) -> PeftModel:
    # the base is built first: make_model may seed the global RNG, and the adapters' init must equal _peft's
    return _peft(case, identity, base=case.make_model().to(dtype), autocast_adapter_dtype=autocast)


def _assert_effect_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, noise: float, what: str) -> None:
    """``|actual - expected| <= rtol |expected| + 2 noise``, where ``noise`` is how far the base model's own output
    moves under the same change of precision or quantization: an adapter's effect is only comparable above it."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err, size = (actual - expected).norm().item(), expected.norm().item()
    assert err <= rtol * size + 2 * noise, f"{what}: error {err:.3g} > {rtol} * {size:.3g} + 2 * noise {noise:.3g}"


def _base_noise(case: TunerCase, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """The base model's output in ``dtype`` and its distance to the float32 output."""
    base = _out(case, case.make_model().to(dtype).eval(), dtype)
    return base, (base - _out(case, case.make_model().eval())).norm().item()


def adapter_weight_dtypes(model: nn.Module, prefix: str) -> dict[str, torch.dtype]:
    """The dtype of every floating adapter parameter (``prefix`` in the name) of ``model``.

    Args:
        model: The PEFT model.
        prefix: The adapter parameters' name prefix.
    """
    return {n: p.dtype for n, p in model.named_parameters() if prefix in n and p.is_floating_point()}


def check_half_forward(case: TunerCase, tmp_path: Path) -> None:
    """fp16 / bf16 models, with and without autocast_adapter_dtype, and float32 PEFT models cast with ``.to``:
    adapter dtypes follow PEFT's rule, and the adapter changes the output as it does in float32 (visibly so at least
    in float16)."""
    effect32 = _out(case, _peft(case, identity=False, base=case.make_model()).eval()) - _out(case, case.make_model())
    for dtype in HALF:
        base, noise = _base_noise(case, dtype)
        if dtype == torch.float16:
            assert effect32.norm() > 4 * noise, "the case's adapter effect is within float16 noise: nothing is tested"
        for autocast in (True, False):
            model = _half_peft(case, dtype, autocast).eval()
            dtypes = adapter_weight_dtypes(model, case.prefix)
            assert dtypes, "no adapter parameters"
            want = torch.float32 if autocast else dtype
            wrong = {n: d for n, d in dtypes.items() if d != want}
            assert not wrong, f"autocast_adapter_dtype={autocast} on a {dtype} model: want {want}, got {wrong}"
            effect = _out(case, model, dtype) - base
            _assert_effect_close(effect, effect32, HALF_RTOL[dtype], noise, f"effect, {dtype}, autocast={autocast}")
        # a float32 PEFT model cast afterwards (model.to(dtype)): everything is in dtype, the adapter included
        model = _peft(case, identity=False, base=case.make_model()).to(dtype).eval()
        assert set(adapter_weight_dtypes(model, case.prefix).values()) == {dtype}
        effect = _out(case, model, dtype) - base
        _assert_effect_close(effect, effect32, HALF_RTOL[dtype], noise, f"effect, float32 model cast to {dtype}")


def check_half_merge(case: TunerCase, tmp_path: Path) -> None:
    """Merging into a half-precision base: merged output equals the unmerged adapter's; unmerge restores the base
    weights (to the rounding of one add and subtract); merge_and_unload matches."""
    for dtype, autocast in ((torch.float16, True), (torch.bfloat16, False)):
        model = _half_peft(case, dtype, autocast).eval()
        base, noise = _base_noise(case, dtype)
        adapted = _out(case, model, dtype)
        weights = _base_weights(model, case.prefix)
        model.merge_adapter()
        what = f"{dtype}, autocast={autocast}"
        noise *= 2  # the merged weight W + delta is rounded to the half dtype once more
        _assert_effect_close(_out(case, model, dtype), adapted, 0, noise, f"merged, {what}")
        model.unmerge_adapter()
        for key, value in _base_weights(model, case.prefix).items():
            assert value.dtype == weights[key].dtype, f"unmerge changed the dtype of {key}"
            if value.is_floating_point():
                torch.testing.assert_close(value, weights[key], atol=4 * torch.finfo(dtype).eps, rtol=0.02)
        merged = model.merge_and_unload()
        _assert_effect_close(_out(case, merged, dtype), adapted, 0, noise, f"merge_and_unload, {what}")


def check_half_training(case: TunerCase, tmp_path: Path) -> None:
    """Training steps (the case's optimizer) on fp16 / bf16 adapters without autocast: the adapters train, keep
    their dtype and stay finite; the base weights do not change."""
    for dtype in HALF:
        model = _half_peft(case, dtype, autocast=False, identity=True)
        dtypes = adapter_weight_dtypes(model, case.prefix)
        base_before = {k: v for k, v in _base_weights(model, case.prefix).items() if "modules_to_save" not in k}
        before = _adapter_state(model, case.prefix)
        _train_steps(case, model, dtype=dtype)
        assert adapter_weight_dtypes(model, case.prefix) == dtypes, "training changed an adapter's dtype"
        after = _adapter_state(model, case.prefix)
        assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point()), f"non-finite, {dtype}"
        assert any(not torch.equal(before[k], after[k]) for k in before), f"adapters did not train in {dtype}"
        base_after = _base_weights(model, case.prefix)
        for key, value in base_before.items():
            assert torch.equal(value, base_after[key]), f"training in {dtype} changed the frozen {key}"


def check_bnb_4bit_bf16(case: TunerCase, tmp_path: Path) -> None:
    """A QLoRA-style base: bf16 model whose adapted linears are bitsandbytes NF4 with bf16 compute. Forward,
    backward and a training step; the adapter's effect matches the same adapter on the dequantized bf16 base."""
    pytest.importorskip("bitsandbytes")
    bf16 = torch.bfloat16
    names = case.quantize or tuple(case.make_config(True).target_modules)
    base_model = quantize_linears(case.make_model().to(bf16), 4, names, bf16).eval()
    base = _out(case, base_model, bf16)
    model = _peft(case, identity=False, base=base_model)
    dtypes = adapter_weight_dtypes(model, case.prefix)
    assert dtypes and all(d == torch.float32 for d in dtypes.values()), f"autocast keeps float32 adapters: {dtypes}"
    model.eval()
    adapted = _out(case, model, bf16)
    reference = _peft(case, identity=False, base=case.make_model().to(bf16)).eval()
    base_ref = _out(case, case.make_model().to(bf16).eval(), bf16)
    # the NF4 base differs from the bf16 one by its quantization error, which the adapter's input inherits
    noise = (base - base_ref).norm().item()
    _assert_effect_close(adapted - base, _out(case, reference, bf16) - base_ref, 0.2, noise, "effect on a 4-bit base")
    _train_steps(case, model, steps=1, dtype=bf16)
    trained = _out(case, model, bf16)
    assert torch.isfinite(trained).all() and not _close(trained, adapted, case.atol), "the training step did nothing"


HALF_PRECISION_CHECKS: tuple[Callable[[TunerCase, Path], None], ...] = (
    check_half_forward,
    check_half_merge,
    check_half_training,
    check_bnb_4bit_bf16,
)

CONTRACT_CHECKS: tuple[Callable[[TunerCase, Path], None], ...] = (
    check_identity_at_init,
    check_only_adapter_params_trainable,
    check_save_load_round_trip,
    check_merge_unmerge,
    check_safe_merge_refuses_nonfinite,
    check_disable_adapter,
    check_multiple_adapters,
    check_delete_adapter,
    check_mixed_adapter_batch,
    check_bnb_8bit,
    check_bnb_4bit,
    *HALF_PRECISION_CHECKS,
)


def contract_test(cases: dict[str, TunerCase]) -> Callable[[TunerCase, Callable[[TunerCase, Path], None], Path], None]:
    """A test of every check in :data:`CONTRACT_CHECKS` on every case of ``cases`` (ids ``<case>-<check>``): a test
    module with several cases binds it as ``test_tuner_contract = contract_test(CASES)``."""

    @pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
    @pytest.mark.parametrize("case", cases.values(), ids=cases.keys())
    def test_tuner_contract(case: TunerCase, check: Callable[[TunerCase, Path], None], tmp_path: Path) -> None:
        check(case, tmp_path)

    return test_tuner_contract
