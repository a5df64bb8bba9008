"""Every adapter type on the transformers architectures PEFT's LoRA covers, with `target_modules="all-linear"`.

For each architecture of tests/architectures.py and each of Riemannion, SplitLoRA and PCLR: a training step with
the type's optimizer moves the adapter and nothing else; a two-task cycle (SplitLoRA's statistics and split, PCLR's
prototypes, compression and integration); greedy ``generate()`` gives the same tokens with and without the KV cache;
``save_pretrained`` / ``PeftModel.from_pretrained`` reproduce the outputs; merging reproduces them too (PCLR: only
where its routing is static, by design). Both full-fine-tuning optimizers (DCT-AdamW, SubspaceAdamW) take steps on
every architecture. docs/architectures.md has the table.

GPT-2's ``Conv1D`` layers (weight stored ``in x out``) give exactly what the same model with ``nn.Linear`` layers
(weights transposed) gives: outputs, gradients, LOI, SplitLoRA's splits, merges.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import PeftModel, get_peft_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from peft_ext import DCTAdamW, PCLRConfig, Riemannion, RiemannionConfig, SplitLoRAConfig, SubspaceAdamW

from .architectures import ARCHS, Arch

TYPES = {
    "riemannion": lambda **kw: RiemannionConfig(r=4, target_modules="all-linear", **kw),
    "splitlora": lambda **kw: SplitLoRAConfig(r=4, target_modules="all-linear", **kw),
    "pclr": lambda **kw: PCLRConfig(target_modules="all-linear", pool_size=8, ranks_schedule=[4], top_k=4, **kw),
}
PREFIX = {"riemannion": "riemannion_", "splitlora": "splitlora_", "pclr": "pclr_"}


def _adapted(arch: Arch, kind: str) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Riemannion's note on the 3-class heads (tested in test_riemannion_tuner)
        return get_peft_model(arch.model(), TYPES[kind](init_weights=False))


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "riemannion":
        return Riemannion(model, lr=1e-2)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _logits(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def _train_task(model: nn.Module, kind: str, batch: dict, task: int) -> None:
    """One task of the type's cycle: begin, one optimizer step, end (statistics / prototypes from ``batch``)."""
    if kind == "splitlora":
        model.begin_task()
    if kind == "pclr":
        prototype = model.query_prototype([batch])
        model.begin_task(task, prototype)
    model.train()
    optimizer = _optimizer(model, kind)
    model(**batch).loss.backward()
    optimizer.step()
    model.eval()
    if kind == "splitlora":
        with torch.no_grad(), model.collect_statistics():
            model(**batch)
        model.end_task()
    if kind == "pclr":
        model.end_task(task, prototype, [batch])


#: the inner loop's share of the matrix (`make test-fast`): a decoder, an encoder, Conv1D and an encoder-decoder; the
#: rest runs in `make test`
FAST = ("llama", "bert", "gpt2", "t5")
ARCH_PARAMS = [pytest.param(a, id=a.name, marks=() if a.name in FAST else pytest.mark.slow) for a in ARCHS]


#: (architecture, type) pairs not working yet, each with why; strict: a pair that starts to pass fails until removed
NOT_YET: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize("kind", sorted(TYPES))
@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_adapter_type_on_architecture(arch, kind, tmp_path, request):
    if (arch.name, kind) in NOT_YET:
        request.applymarker(pytest.mark.xfail(reason=NOT_YET[(arch.name, kind)], strict=True))
    model = _adapted(arch, kind)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(PREFIX[kind] in n for n in names), names[:5]
    batch = arch.batch()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    _train_task(model, kind, batch, 0)
    moved = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert moved, "the step left every adapter parameter unchanged"
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    _train_task(model, kind, arch.batch(seed=1), 1)

    if arch.generates:
        prompt = batch["input_ids"][:, :4]
        with torch.no_grad():
            cached = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, use_cache=True)
            plain = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, use_cache=False)
        assert torch.equal(cached, plain)

    want = _logits(model, batch)
    with torch.no_grad(), model.disable_adapter():
        assert not torch.allclose(model(**batch).logits, want, atol=1e-4), "the adapter changes nothing"
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(arch.model(), tmp_path).eval()
    torch.testing.assert_close(_logits(loaded, batch), want, atol=1e-5, rtol=1e-5)

    if kind == "pclr":  # merging needs static routing (every input selects every rank): not after a task cycle
        return
    merged = model.merge_and_unload()
    torch.testing.assert_close(_logits(merged, batch), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("optimizer_cls", [DCTAdamW, SubspaceAdamW], ids=lambda c: c.__name__)
@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_full_fine_tuning_optimizers_on_architecture(arch, optimizer_cls):
    model = arch.model().train()
    named = [(n, p) for n, p in model.named_parameters()]
    optimizer = optimizer_cls(named, lr=1e-3, rank=4, update_proj_gap=1)
    before = [p.detach().clone() for _, p in named]
    for step in range(2):
        model(**arch.batch(seed=step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.isfinite(p).all() for _, p in named)
    assert sum(not torch.equal(p, b) for (_, p), b in zip(named, before)) > len(named) // 2
    matrices = [(n, p) for n, p in named if p.dim() == 2 and min(p.shape) > 4]
    assert matrices
    for name, p in matrices:  # every weight matrix (Conv1D's in x out ones too) keeps rank-4 moments
        assert optimizer.state[p]["exp_avg"].numel() <= 4 * max(p.shape), (name, optimizer.state[p]["exp_avg"].shape)


# --- Conv1D is nn.Linear with the weight transposed ---------------------------------------------------------------


def _linearized(model: nn.Module) -> nn.Module:
    """``model`` with every ``Conv1D`` replaced by the ``nn.Linear`` computing the same (weight transposed)."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                linear = nn.Linear(*child.weight.shape)
                linear.weight.data = child.weight.data.T.contiguous()
                linear.bias.data = child.bias.data.clone()
                setattr(parent, name, linear)
    return model


GPT2 = next(a for a in ARCHS if a.name == "gpt2")


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_conv1d_layers_equal_linear_layers_with_the_weight_transposed(kind):
    base = GPT2.model()
    assert any(isinstance(m, Conv1D) for m in base.modules())
    models = []
    for plain in (base, _linearized(base)):  # built first: nn.Linear's init draws from the generator
        torch.manual_seed(1)
        models.append(get_peft_model(plain, TYPES[kind](init_weights=False)))
    conv, linear = models
    assert any(isinstance(m.get_base_layer(), Conv1D) for m in conv.modules() if hasattr(m, "fan_in_fan_out"))
    assert all(m.fan_in_fan_out for m in conv.modules() if hasattr(m, "fan_in_fan_out"))
    batch = GPT2.batch()
    torch.testing.assert_close(_logits(conv, batch), _logits(linear, batch), atol=1e-6, rtol=1e-6)

    if kind == "riemannion":  # LOI reads the weight gradient's top singular directions through the layer
        from peft_ext.tuners.riemannion import initialize_loi

        for model in models:
            initialize_loi(model, [batch], seed=0)
    for model in models:
        torch.manual_seed(2)  # the same dropout masks and cycle draws
        _train_task(model, kind, batch, 0)
    conv_state = {k: v for k, v in conv.state_dict().items() if PREFIX[kind] in k}
    linear_state = {k: v for k, v in linear.state_dict().items() if PREFIX[kind] in k}
    assert conv_state.keys() == linear_state.keys() and conv_state
    for key, value in conv_state.items():
        torch.testing.assert_close(value, linear_state[key], atol=1e-5, rtol=1e-4, msg=key)
    if kind == "splitlora":
        assert conv.task_state() == linear.task_state()
    want = _logits(linear, batch)
    torch.testing.assert_close(_logits(conv, batch), want, atol=1e-5, rtol=1e-5)
    if kind != "pclr":
        conv.merge_adapter()
        torch.testing.assert_close(_logits(conv, batch), want, atol=1e-5, rtol=1e-5)
        c_attn = conv.base_model.model.transformer.h[0].attn.c_attn
        assert c_attn.get_base_layer().weight.shape == (32, 96)  # still stored in x out
        conv.unmerge_adapter()
        torch.testing.assert_close(c_attn.get_base_layer().weight, GPT2.model().transformer.h[0].attn.c_attn.weight)


def test_the_docs_table_lists_every_architecture_tested_here():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "architectures.md").read_text()
    table = text[text.index("| architecture |") :].split("\n\n")[0]
    rows = table.splitlines()[2:]
    assert len(rows) == len(ARCHS)
    for arch, row in zip(ARCHS, rows):
        assert f"(`{arch.name}`) | {arch.note} |" in row, row
        assert row.count("✓") == 4 and not NOT_YET  # a pair not working yet would need its cell changed
