"""``torch.compile`` of every adapter type: one graph (no graph break) for a training forward + backward, and the
compiled gradients equal to eager ones in float64 to 1e-10 relative.

Float64 removes rounding, so a compiled graph that computed another function than eager (a detach lost or added, a
routing decision taken on other values, a hand-written backward that disagrees with the recorded one) shows as a
difference far above 1e-10, where float32's tolerance (1e-5) would hide it. transformers' Llama computes its RMSNorm
and rotary tables in float32 whatever the model's dtype (``hidden_states.to(torch.float32)``, ``.float()``): a
float64 model converted by ``.double()`` still rounds there, and inductor's fused float32 kernels round differently
from eager ones (4e-7 relative on PEFT's own LoRA gradients). :func:`float64_throughout` swaps those two modules for
float64 ones, so the model is float64 end to end and eager and compiled agree to 1e-15.

Causal-LM adapters (PEFT's LoRA as the reference, Riemannion, SplitLoRA, PCLR) run on a tiny random Llama with all
7 projections of both layers adapted; MoRA, an adapter of dual encoders, on a tiny CLIP. The fast tests compile with
``aot_eager`` (dynamo's graph capture and AOTAutograd's joint graph, the parts that decide graph breaks and the
backward) and run in ``make test-fast``, one per adapter type; the ``slow`` ones with inductor, the default backend,
on the causal LM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from benchmarks._lib.graphs import GraphCounter  # the graph counter of benchmarks/compile_speed.py
from peft_ext import MoRAConfig, PCLRConfig, RiemannionConfig, SplitLoRAConfig
from peft_ext.models import tiny_clip, tiny_llama
from peft_ext.tuners.pclr import query_loss

VOCAB = 64
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Compiled against eager gradients in float64: reordered sums round at 1e-16 (inductor fuses and reorders; aot_eager
#: runs the same kernels and matches exactly); anything else is a different function.
RTOL, ATOL = 1e-10, 1e-14


class _Float64RMSNorm(LlamaRMSNorm):
    """Llama's RMSNorm in the input's dtype (transformers' own computes in float32)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class _Float64Rotary(LlamaRotaryEmbedding):
    """Llama's rotary tables in the input's dtype (transformers' own computes them in float32)."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(device=x.device, dtype=x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def float64_throughout(model: nn.Module) -> nn.Module:
    """``model`` in float64 with Llama's RMSNorm and rotary tables computing in float64 too."""
    for module in model.modules():
        if type(module) is LlamaRMSNorm:
            module.__class__ = _Float64RMSNorm
        elif type(module) is LlamaRotaryEmbedding:
            module.__class__ = _Float64Rotary
    return model.double()


def _pclr_mid_sequence(model: nn.Module) -> nn.Module:
    """The PCLR model as it trains a second task: static ranks of task 0 (whose prototype is stored, so prototype
    routing is on) and new ranks of task 1 (``b_i`` made non-zero, so every factor gets a gradient), a shared LoRA:
    every branch of the layer's forward in use."""
    g = torch.Generator().manual_seed(5)
    batches = [{"input_ids": torch.randint(0, VOCAB, (4, 8), generator=g)} for _ in range(2)]
    for task, batch in enumerate(batches):
        proto = model.query_prototype([batch])
        if task:
            model.begin_task(task, proto)
        else:
            model.end_task(task, proto)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".pclr_B." in name:
                p.normal_(0.0, 0.02, generator=g)
    return model


CAUSAL_LM: dict[str, tuple[Callable[[], Any], Callable[[nn.Module], nn.Module]]] = {
    "lora": (lambda: LoraConfig(r=4, target_modules=PROJECTIONS, init_lora_weights=False), lambda m: m),
    "riemannion": (lambda: RiemannionConfig(r=4, target_modules=PROJECTIONS, init_weights=False), lambda m: m),
    "splitlora": (lambda: SplitLoRAConfig(r=4, target_modules=PROJECTIONS, init_weights=False), lambda m: m),
    "pclr": (
        lambda: PCLRConfig(
            target_modules=PROJECTIONS,
            pool_size=16,
            ranks_schedule=[8],
            compress_schedule=[0.0],
            compress_rule="importance",
            top_k=6,
            alpha=6.0,
            shared_r=2,
            shared_alpha=0.5,
            init_weights=False,
        ),
        _pclr_mid_sequence,
    ),
}


def _causal_lm(name: str) -> nn.Module:
    make_config, prepare = CAUSAL_LM[name]
    base = tiny_llama(vocab_size=VOCAB, hidden_size=32)
    torch.manual_seed(1)
    return float64_throughout(prepare(get_peft_model(base, make_config()))).train()


def _lm_step(model: nn.Module, call: Callable[..., Any], ids: torch.Tensor) -> None:
    logits = call(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    extra = query_loss(model) if isinstance(model.peft_config["default"], PCLRConfig) else None
    (loss if extra is None else loss + extra).backward()


def _clip_step(model: nn.Module, call: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> None:
    call(**inputs, return_loss=True).loss.backward()


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _check_compiled(make_model: Callable[[], nn.Module], step: Callable[..., None], inputs: Any, backend: str) -> None:
    """Eager and compiled forward + backward of two identical models: one graph, the same gradients."""
    torch._dynamo.reset()
    eager, compiled = make_model(), make_model()
    step(eager, eager, inputs)
    expected = _gradients(eager)
    counter = GraphCounter(backend)
    torch._dynamo.utils.counters.clear()
    step(compiled, torch.compile(compiled, backend=counter), inputs)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert counter.graphs == 1 and not breaks, f"{counter.graphs} graphs; graph breaks: {breaks}"
    got = _gradients(compiled)
    assert got.keys() == expected.keys() and expected
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))


# One per adapter type in `make test-fast` (PEFT's own LoRA, the reference, only in `make test`).
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "lora" else n for n in sorted(CAUSAL_LM)]
)
def test_causal_lm_adapter_compiles_to_one_graph_with_eager_gradients(name):
    _check_compiled(lambda: _causal_lm(name), _lm_step, _ids(), "aot_eager")


def test_mora_compiles_to_one_graph_with_eager_gradients():
    def make() -> nn.Module:
        base = tiny_clip()
        torch.manual_seed(1)
        return get_peft_model(base, MoRAConfig(r=2, init_weights=False)).double().train()

    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(4, 3, 16, 16, generator=g, dtype=torch.float64)
    inputs = {"input_ids": torch.randint(3, 128, (4, 7), generator=g), "pixel_values": pixels}
    _check_compiled(make, _clip_step, inputs, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CAUSAL_LM))
def test_causal_lm_adapter_compiles_with_inductor(name):
    _check_compiled(lambda: _causal_lm(name), _lm_step, _ids(), "inductor")
