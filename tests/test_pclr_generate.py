"""PCLR on causal LMs: routing by the prompt during generation (KV cache or not, left padding, beam search, sampling,
successive calls, hand-written decoding), arguments reaching the query function by name, Trainer training on a
causal-LM loss, save / load, merging, and a 4-bit base; on tiny Llama and tiny Qwen2.

Every model here has non-trivial adapters (random ``b_i``, ``init_weights=False``) and routing that changes the
generated tokens (checked), so a step routed by anything but its prompt shows up as different tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model
from torch import nn
from transformers import Trainer

from peft_ext import PCLRConfig
from peft_ext.integrations import pclr_loss_func
from peft_ext.models import tiny_llama, tiny_qwen2
from peft_ext.tuners.pclr import default_query, forward_arguments, group_layers, routed_as

from .single_thread import single_thread  # noqa: F401  (fixture)
from .test_dct_integration import args as trainer_args
from .tuner_contract import quantize_linears

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models; see tests/single_thread.py

VOCAB = 128
PAD = 0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {"llama": tiny_llama, "qwen2": tiny_qwen2}


def _config(**kwargs) -> PCLRConfig:
    defaults = dict(target_modules=TARGETS, pool_size=16, ranks_schedule=[8], top_k=3, alpha=12.0)
    return PCLRConfig(**{**defaults, "init_weights": False, **kwargs})


def _model(family: str = "llama", base: nn.Module | None = None, **kwargs) -> PeftModel:
    # hidden width 64: bitsandbytes' CPU 4-bit kernel needs multiples of 64 input columns (tests/helpers.py)
    base = base if base is not None else FAMILIES[family](vocab_size=VOCAB, hidden_size=64)
    return get_peft_model(base, _config(**kwargs)).eval()


def _prompts(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]


def _left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


def _generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """The new tokens only (the prompt, padded or not, cut off)."""
    mask = torch.ones_like(ids) if mask is None else mask
    options = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **{**options, **kwargs})
    return out[:, ids.shape[1] :]


class _QueryLog:
    """The routing query of every forward pass of the wrapped model, in order."""

    def __init__(self, model: PeftModel) -> None:
        self.state = model.base_model.routing_state
        self.queries: list[torch.Tensor] = []
        self.handle = model.base_model.model.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: tuple, output) -> None:
        self.queries.append(self.state.query.clone())

    def __enter__(self) -> _QueryLog:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def _prompt_query(model: PeftModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return default_query(model.base_model.model, (), {"input_ids": ids, "attention_mask": mask})


# -- generation routes by the prompt --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_with_cache_equals_without_and_every_step_routes_by_the_prompt(family):
    model = _model(family)
    ids, mask = _left_pad(_prompts([7, 7], seed=1))
    with _QueryLog(model) as log:
        cached = _generate(model, ids, use_cache=True)
    # Without the kept prompt query each decoding step would route by its one new token (that token's embedding as
    # the query), and the cached tokens below would diverge from the uncached ones after the first.
    assert len(log.queries) == 12
    for query in log.queries:
        torch.testing.assert_close(query, _prompt_query(model, ids, mask), atol=0, rtol=0)
    uncached = _generate(model, ids, use_cache=False)
    assert torch.equal(cached, uncached), f"{cached}\n{uncached}"
    # the routing matters: the same prompts routed as another query generate other tokens
    other = group_layers(model)["model.layers.0"][0].keys("default")[0].detach()
    with routed_as(model, other):
        assert not torch.equal(_generate(model, ids), cached)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_left_padded_rows_generate_as_they_do_alone(family):
    model = _model(family)
    prompts = _prompts([7, 3, 5], seed=2)
    ids, mask = _left_pad(prompts)
    batched = _generate(model, ids, mask)
    assert torch.equal(batched, _generate(model, ids, mask, use_cache=False))
    for row, prompt in zip(batched, prompts):
        alone = _generate(model, prompt[None])
        assert torch.equal(row, alone[0]), f"row {row} vs alone {alone[0]}"


def test_beam_search_routes_each_sample_by_its_prompt():
    model = _model("llama")
    prompts = _prompts([6, 6], seed=3)
    ids = torch.stack(prompts)
    options = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
    with _QueryLog(model) as log:
        batched = _generate(model, ids, **options)
    # generate expands each prompt to its beams before the prefill; beams are reordered within a sample only, so
    # the rows of one sample keep the same (its prompt's) query at every step
    expected = _prompt_query(model, ids, torch.ones_like(ids)).repeat_interleave(3, dim=0)
    assert all(torch.equal(q, expected) for q in log.queries)
    assert torch.equal(batched, _generate(model, ids, use_cache=False, **options))
    for i, prompt in enumerate(prompts):
        assert torch.equal(batched[2 * i : 2 * i + 2], _generate(model, prompt[None], **options))


def test_sampling_several_sequences_per_prompt_routes_by_the_prompt():
    model = _model("llama")
    ids, mask = _left_pad(_prompts([6, 4], seed=4))
    options = dict(do_sample=True, num_return_sequences=3, top_k=20)
    torch.manual_seed(0)
    with _QueryLog(model) as log:
        cached = _generate(model, ids, mask, **options)
    expected = _prompt_query(model, ids, mask).repeat_interleave(3, dim=0)
    assert len(log.queries) == 12 and all(torch.equal(q, expected) for q in log.queries)
    torch.manual_seed(0)
    assert torch.equal(cached, _generate(model, ids, mask, use_cache=False, **options))


def test_successive_calls_and_hand_written_decoding_route_by_their_own_prompt():
    model = _model("llama")
    first, second = torch.stack(_prompts([5, 5], seed=5)), torch.stack(_prompts([6], seed=6))
    fresh = _generate(copy.deepcopy(model), second)
    _generate(model, first)
    _generate(model, first[1:])  # the same batch size as `second`: a kept query would fit it silently
    assert torch.equal(_generate(model, second), fresh), "the second call routed by an earlier call's prompt"
    with _QueryLog(model) as log:
        _generate(model, second)
    assert torch.equal(log.queries[-1], _prompt_query(model, second, torch.ones_like(second)))

    # A hand-written greedy loop on the base model (no PeftModel call around it): the KV cache keeps its prefill's
    # query, another forward in between does not disturb it.
    base = model.base_model.model
    with torch.no_grad():
        out = base(input_ids=second, use_cache=True)
        tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
        model(input_ids=first)  # another prompt in between
        for _ in range(11):
            out = base(input_ids=tokens[-1], cache=out.cache, use_cache=True)
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
        assert torch.equal(torch.cat(tokens, 1), fresh)
        with pytest.raises(ValueError, match="computed for 1 sequences, but the forward passes 2"):
            base(input_ids=first[:, :1], cache=out.cache, use_cache=True)

    # without a cache, a base-model loop routes by the prompt inside a session
    with torch.no_grad(), model.base_model.routing_state.session():
        seq = second
        for _ in range(12):
            seq = torch.cat([seq, base(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(seq[:, second.shape[1] :], fresh)


# -- the query function sees the forward's arguments by name --------------------------------------------------------


def test_the_query_function_gets_every_argument_by_name():
    model = _model("llama")
    base = model.base_model.model
    ids, mask = _left_pad(_prompts([5, 3], seed=7))
    seen = []

    def query_fn(m, args, kwargs):
        seen.append(sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor)))
        return default_query(m, args, kwargs)

    model.base_model.set_query_fn(query_fn)
    with _QueryLog(model) as log, torch.no_grad():
        positional = base(ids, mask).logits
        keyword = base(input_ids=ids, attention_mask=mask).logits
        embeds = base(inputs_embeds=base.get_input_embeddings()(ids), attention_mask=mask).logits
    assert seen == [["attention_mask", "input_ids"]] * 2 + [["attention_mask", "inputs_embeds"]]
    assert torch.equal(positional, keyword)
    torch.testing.assert_close(embeds, keyword)
    for query in log.queries:  # the padded positions are left out of every one
        torch.testing.assert_close(query, _prompt_query(model, ids, mask))
    assert forward_arguments(base, (ids, mask), {"use_cache": False}) == {
        "input_ids": ids,
        "attention_mask": mask,
        "use_cache": False,
    }


class _FeatureNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin0, self.lin1 = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, features: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin1(torch.tanh(self.lin0(features))) * scale


def test_a_feature_model_called_with_keywords_gets_a_query():
    # before, the default query only looked at positional arguments: a keyword call found nothing and failed
    model = get_peft_model(_FeatureNet(), PCLRConfig(target_modules=["lin0"], query_dim=8, init_weights=False))
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(model(features=x), model(x))
    torch.testing.assert_close(model.base_model.routing_state.query, F.normalize(x, dim=-1))


# -- training, save / load, merging, a 4-bit base -------------------------------------------------------------------


def _lm_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    # left-padded rows of 4-8 tokens, each an arithmetic progression mod VOCAB (learnable), pads ignored by the loss
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        start, step, length = (int(v) for v in torch.randint(1, 9, (3,), generator=gen))
        prompts.append((start + step * torch.arange(max(length, 4))) % (VOCAB - 1) + 1)
    ids, mask = _left_pad(prompts)
    return [{"input_ids": i, "attention_mask": m, "labels": i.masked_fill(m == 0, -100)} for i, m in zip(ids, mask)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_causal_lm_trainer_then_generation_save_load(family, tmp_path):
    model = _model(family)
    keys = {name: p.detach().clone() for name, p in model.named_parameters() if "pclr_keys" in name}

    data = _lm_data(16, seed=8)
    trainer = Trainer(
        model=model,
        args=trainer_args(tmp_path / "run", per_device_train_batch_size=8, max_steps=6, learning_rate=1e-2),
        train_dataset=data,
        # the causal-LM loss plus PCLR's query-key loss (what trains the keys)
        compute_loss_func=pclr_loss_func(model),
    )
    before = trainer.evaluate(data)["eval_loss"]
    trainer.train()
    assert trainer.evaluate(data)["eval_loss"] < before
    assert any(not torch.equal(p, keys[n]) for n, p in model.named_parameters() if n in keys), "keys did not learn"

    model.eval()
    prompts = _prompts([6, 3], seed=9)
    ids, mask = _left_pad(prompts)
    trained = _generate(model, ids, mask)
    assert torch.equal(trained, _generate(model, ids, mask, use_cache=False))
    assert torch.equal(trained[1], _generate(model, prompts[1][None])[0])

    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(FAMILIES[family](vocab_size=VOCAB, hidden_size=64), tmp_path / "adapter")
    assert torch.equal(_generate(loaded.eval(), ids, mask), trained)


def test_merging_generates_the_same_tokens_when_routing_is_static_and_is_refused_otherwise():
    # top_k covers the 8 ranks: every input selects all of them, one weight delta reproduces the adapter
    model = _model("llama", top_k=8)
    ids, mask = _left_pad(_prompts([6, 4], seed=10))
    unmerged = _generate(model, ids, mask)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        model.merge_adapter()
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(_generate(model, ids, mask), unmerged)

    routed = _model("llama")  # top-3 of 8 per sample: no single weight reproduces it
    weight = routed.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    with pytest.raises(ValueError, match="routes each input to its own 3 of 8 ranks"):
        routed.merge_adapter()
    assert torch.equal(routed.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, weight)


def test_4bit_base_forward_and_generation():
    pytest.importorskip("bitsandbytes")
    base = quantize_linears(tiny_llama(vocab_size=VOCAB, hidden_size=64), 4, tuple(TARGETS))
    model = _model(base=base)
    ids, mask = _left_pad(_prompts([6, 4], seed=11))
    with torch.no_grad():
        adapted = model(input_ids=ids, attention_mask=mask).logits
        with model.disable_adapter():
            plain = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(adapted).all() and not torch.allclose(adapted, plain, atol=1e-3)
    cached = _generate(model, ids, mask)
    assert torch.equal(cached, _generate(model, ids, mask, use_cache=False))


def test_pclr_loss_func_is_the_model_loss_plus_the_query_key_loss():
    model = _model("llama").train()
    batch = _lm_data(4, seed=11)
    ids = torch.stack([b["input_ids"] for b in batch])
    mask = torch.stack([b["attention_mask"] for b in batch])
    labels = torch.stack([b["labels"] for b in batch])
    loss_func = pclr_loss_func(model)
    # the reference: transformers' own causal-LM loss of the same forward (labels shifted inside the model)
    total = loss_func(model(input_ids=ids, attention_mask=mask, labels=labels), labels)
    outputs = model(input_ids=ids, attention_mask=mask, labels=labels)  # the same forward again
    keys = model.query_loss()
    assert keys is not None and keys.item() > 0
    torch.testing.assert_close(total, outputs.loss + keys)
    with torch.no_grad():  # evaluation: no key gradient, the task loss alone
        outputs = model(input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(loss_func(outputs, labels), outputs.loss)
    with pytest.raises(ValueError, match=r"cannot infer the task loss.*task_loss="):
        loss_func(outputs, labels[:, :3])
    with pytest.raises(TypeError, match="PCLR"):
        pclr_loss_func(tiny_llama())
