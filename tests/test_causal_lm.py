"""Causal LMs as a user trains them: Riemannion, SplitLoRA and LoRA + DCT-AdamW on tiny Llama and Qwen2.

Each case targets every attention and MLP projection, trains with ``transformers.Trainer`` on left-padded batches
(the method's own optimizer; SplitLoRA runs a full task cycle so its frozen old delta is non-zero too), and then
checks what generation needs: a left-padded row gives the logits of the row alone, greedy ``generate()`` with the KV
cache equals ``generate(use_cache=False)``, merged equals unmerged, and a save / load round trip is exact. The
bitsandbytes 4-bit base (bf16 compute) and the bf16 model run a training step and generation; per-row adapters in
``generate(adapter_names=...)`` and gradient checkpointing are checked for the two peft-ext adapter types.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

from peft_ext import RiemannionConfig, SplitLoRAConfig
from peft_ext.integrations import optimizer_for_trainer
from peft_ext.models import tiny_llama, tiny_qwen2

from .single_thread import one_thread, single_thread  # noqa: F401  (fixture)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {"llama": tiny_llama, "qwen2": tiny_qwen2}
METHODS = ("riemannion", "splitlora", "lora_dct")
PAD = 0
STEPS = 8


def adapter_config(method: str, identity: bool = True) -> PeftConfig:
    """Each method's config on every projection; ``identity=False`` starts with a visible (random) delta."""
    if method == "riemannion":
        # random start: X0 = 0 and the delta is the point itself, with singular values as large as LoRA's random delta
        return RiemannionConfig(
            r=4, target_modules=TARGETS, init_weights=identity, init_scale=None if identity else 0.5
        )
    if method == "splitlora":
        return SplitLoRAConfig(r=4, target_modules=TARGETS, init_weights=identity)
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=identity)


def optimizer_pair(method: str, model: torch.nn.Module) -> tuple[type, dict]:
    """The ``(class, kwargs)`` of each method's optimizer, for ``Trainer(optimizer_cls_and_kwargs=...)``."""
    if method == "riemannion":
        return optimizer_for_trainer("riemannion", model, lr=0.05)
    if method == "splitlora":
        return torch.optim.AdamW, {"lr": 3e-2}
    # LoRA factors are r x in and out x r: rank 2 of 4 keeps half of each factor's moments
    return optimizer_for_trainer("dct_adamw", model, lr=3e-2, rank=2, target_modules=TARGETS)


def make_optimizer(method: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer Trainer would build from :func:`optimizer_pair`, for hand-written steps."""
    cls, kwargs = optimizer_pair(method, model)
    kwargs = dict(kwargs)
    for key in ("model", "params"):  # what Trainer pops in place of its parameter groups
        if key in kwargs:
            return cls(kwargs.pop(key), **kwargs)
    return cls([p for p in model.parameters() if p.requires_grad], **kwargs)


def sequences(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Arithmetic runs ``s, s + d, s + 2d, ...`` of 4 to 10 tokens: learnable in a few steps, lengths differ."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 11, (), generator=gen))
        start, step = int(torch.randint(3, 60, (), generator=gen)), int(torch.randint(1, 4, (), generator=gen))
        rows.append({"input_ids": [start + step * i for i in range(length)]})
    return rows


def left_pad(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Left-padded ``input_ids`` / ``attention_mask`` / ``labels``.

    Labels are -100 on padding and on each row's first real token: shifted by the loss, that token would otherwise
    be predicted from the last pad position, a prefix the row does not have.
    """
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row["input_ids"]) :] = torch.tensor(row["input_ids"])
        mask[i, width - len(row["input_ids"]) :] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(len(rows)), width - mask.sum(1)] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train_args(out: Path, steps: int, **overrides) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        max_steps=steps,
        lr_scheduler_type="constant",
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        **overrides,
    )


def train(model: torch.nn.Module, method: str, data: list, out: Path, steps: int = STEPS) -> list[float]:
    """Train with Trainer on left-padded batches; returns the logged training losses."""
    trainer = Trainer(
        model=model,
        args=train_args(out, steps),
        train_dataset=data,
        data_collator=left_pad,
        optimizer_cls_and_kwargs=optimizer_pair(method, model),
    )
    trainer.train()
    model.eval()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def mean_loss(model: torch.nn.Module, data: list) -> float:
    """The causal-LM loss of ``model`` on all of ``data`` as one left-padded batch."""
    model.eval()
    with torch.no_grad():
        return float(model(**left_pad(data)).loss)


def prompts() -> dict[str, torch.Tensor]:
    """Two prompts of different lengths, left-padded, without labels."""
    batch = left_pad(sequences(2, seed=99)[:1] + [{"input_ids": [10, 12, 14]}])
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def greedy(model: torch.nn.Module, use_cache: bool = True, new_tokens: int = 8) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            **prompts(), max_new_tokens=new_tokens, do_sample=False, use_cache=use_cache, pad_token_id=PAD
        )


@pytest.fixture(scope="module")
def module_one_thread() -> Iterator[None]:
    # tiny matrices: a second OpenMP thread only adds synchronization (see tests/single_thread.py)
    with one_thread():
        yield


@pytest.fixture(scope="module", params=[(f, m) for f in FAMILIES for m in METHODS], ids=lambda p: "-".join(p))
def trained(request, module_one_thread, tmp_path_factory) -> dict:
    """A model of each family with each method, trained with Trainer on left-padded batches."""
    family, method = request.param
    out = tmp_path_factory.mktemp(f"{family}-{method}")
    torch.manual_seed(0)
    model = get_peft_model(FAMILIES[family](), adapter_config(method))
    data = sequences(64, seed=0)
    if method == "splitlora":
        model.begin_task()
    before = mean_loss(model, data)
    losses = train(model, method, data, out)
    after = mean_loss(model, data)
    if method == "splitlora":
        # a full task cycle: the statistics skip padding, the task folds into dW_old, and a second task trains B
        batch = left_pad(data[:16])
        with torch.no_grad(), model.collect_statistics():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        model.end_task()
        state = next(iter(model.task_state().values()))
        assert state["tokens"] == int(batch["attention_mask"].sum()) and state["old_rank"] == 4
        model.begin_task()
        train(model, method, sequences(32, seed=1), out, steps=3)
    return {"family": family, "method": method, "model": model, "losses": losses, "loss_drop": (before, after)}


def test_training_on_left_padded_batches_lowers_the_loss(trained):
    losses = trained["losses"]
    assert len(losses) == STEPS and torch.isfinite(torch.tensor(losses)).all()
    before, after = trained["loss_drop"]
    # The frozen random lm_head (std 0.02) caps how far any adapter can move the logits of the tiny models, so the
    # loss starts at ln(128) and 8 steps lower it by ~0.1 (measured: 0.09 to 0.13 for every case); a broken
    # gradient path lowers it by nothing.
    assert after < before - 0.05, (before, after, losses)


def test_left_padded_row_equals_the_row_alone(trained):
    model = trained["model"]
    batch = left_pad(sequences(3, seed=5))
    with torch.no_grad():
        padded = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        for i, mask in enumerate(batch["attention_mask"].bool()):
            alone = model(input_ids=batch["input_ids"][i, mask][None]).logits[0]
            torch.testing.assert_close(padded[i, mask], alone, atol=2e-5, rtol=1e-4)
        # the training loss of the padded batch is the token mean of the rows' own losses
        loss = model(**batch).loss
        total, count = 0.0, 0
        for i, mask in enumerate(batch["attention_mask"].bool()):
            ids = batch["input_ids"][i, mask][None]
            total += model(input_ids=ids, labels=ids).loss * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    torch.testing.assert_close(loss, total / count, atol=1e-5, rtol=1e-5)


def test_generate_with_kv_cache_equals_without(trained):
    model = trained["model"]
    with_cache = greedy(model)
    assert torch.equal(with_cache, greedy(model, use_cache=False))
    with model.disable_adapter():
        base = greedy(model)
    assert not torch.equal(with_cache, base), "the trained adapter does not change generation (test is vacuous)"


def test_merged_generation_equals_unmerged(trained):
    model = trained["model"]
    expected = greedy(model)
    with torch.no_grad():
        logits = model(**prompts()).logits
    # on copies: unmerging restores the base weights only up to rounding, which later exact checks would see
    merged = copy.deepcopy(model)
    merged.merge_adapter()
    assert torch.equal(greedy(merged), expected)
    with torch.no_grad():
        torch.testing.assert_close(merged(**prompts()).logits, logits, atol=1e-4, rtol=1e-4)
    unloaded = copy.deepcopy(model).merge_and_unload()
    assert not isinstance(unloaded, PeftModel)
    assert torch.equal(greedy(unloaded), expected)


def test_save_load_round_trip_generates_the_same(trained, tmp_path):
    model = trained["model"]
    model.save_pretrained(tmp_path)
    torch.manual_seed(123)  # a fresh adapter draw must not leak into the loaded one
    loaded = PeftModel.from_pretrained(FAMILIES[trained["family"]](), tmp_path).eval()
    assert torch.equal(greedy(loaded), greedy(model))
    with torch.no_grad():
        assert torch.equal(loaded(**prompts()).logits, model(**prompts()).logits)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def one_step(method: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One training step of ``model`` with the method's optimizer; returns the trainable tensors from before it."""
    model.train()
    optimizer = make_optimizer(method, model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    optimizer.step()
    model.eval()
    params = dict(model.named_parameters())
    for name in before:
        assert torch.isfinite(params[name]).all(), name
    changed = [name for name, value in before.items() if not torch.equal(params[name], value)]
    assert changed, "the step changed no adapter parameter"
    return before


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.usefixtures("single_thread")
def test_bf16_model_trains_and_generates(family, method):
    """The whole model and its adapters in bf16 (``autocast_adapter_dtype=False``): the logits match the fp32 model
    with the same adapter to bf16 precision, a step trains, the KV cache and merging stay consistent."""
    torch.manual_seed(0)
    reference = get_peft_model(FAMILIES[family](), adapter_config(method, identity=False)).eval()
    torch.manual_seed(0)
    base = FAMILIES[family]().to(torch.bfloat16)
    model = get_peft_model(base, adapter_config(method, identity=False), autocast_adapter_dtype=False).eval()
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}
    batch = left_pad(sequences(8, seed=0))
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**batch).logits[real]
        # bf16 rounds to 2^-9 relative per operation; measured 0.6% to 1.8% relative error in the logits, while the
        # adapter alone moves them by 60% to 140%: a wrong half-precision delta would show
        assert relative_error(model(**batch).logits[real], expected) < 0.03
        with reference.disable_adapter():
            assert relative_error(reference(**batch).logits[real], expected) > 0.3
    one_step(method, model, batch)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}
    assert torch.equal(greedy(model), greedy(model, use_cache=False))
    with torch.no_grad():
        logits = model(**batch).logits[real]
        merged = copy.deepcopy(model)
        merged.merge_adapter()
        # W + delta is rounded to bf16 once more than W x + delta x (measured 0.7% to 1.8%)
        assert relative_error(merged(**batch).logits[real], logits) < 0.03


@pytest.fixture(scope="module")
def saved_bases(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny model saved to disk, for ``from_pretrained`` with a quantization config."""
    paths = {}
    for family, factory in FAMILIES.items():
        paths[family] = tmp_path_factory.mktemp(f"base-{family}")
        factory().save_pretrained(paths[family])
    return paths


def load_4bit(path: Path) -> torch.nn.Module:
    """The saved model at ``path`` with NF4 projections computing in bf16, the rest bf16 (QLoRA's setting)."""
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_type="nf4"
    )
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, dtype=torch.bfloat16, device_map="cpu"
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.usefixtures("single_thread", "bnb_cpu_bf16")
def test_bnb_4bit_base_trains_and_generates(family, method, saved_bases):
    """QLoRA's setting: NF4 base with bf16 compute, the rest of the model bf16, float32 adapters (PEFT's default
    ``autocast_adapter_dtype``): a step trains only the adapters, generation with the KV cache equals without.

    As on a CPU with and without AVX512-BF16: there, bitsandbytes would repack each 4-bit weight at generation and
    refuse these widths (hidden 32) with a shape error. peft-ext's adapters opt their bases out; PEFT's LoRA is opted
    out by ``optimizer_for_trainer``, through which the DCT-AdamW step is built."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = get_peft_model(load_4bit(saved_bases[family]), adapter_config(method, identity=False)).eval()
    wrapped = [m for m in model.modules() if isinstance(getattr(m, "base_layer", None), bnb.nn.Linear4bit)]
    assert len(wrapped) == len(TARGETS) * 2, "every projection of both layers is a 4-bit base under an adapter"
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    weights = [layer.base_layer.weight.detach().clone() for layer in wrapped]
    one_step(method, model, left_pad(sequences(8, seed=0)))
    for layer, weight in zip(wrapped, weights):
        assert torch.equal(layer.base_layer.weight, weight), "the step changed a quantized base weight"
    generated = greedy(model)
    assert torch.equal(generated, greedy(model, use_cache=False))
    with model.disable_adapter():
        assert not torch.equal(generated, greedy(model)), "the adapter does not change generation (test is vacuous)"


@pytest.mark.usefixtures("single_thread", "bnb_cpu_bf16")
def test_lora_on_a_4bit_base_trains_alike_with_and_without_evaluations(tmp_path):
    """PEFT's LoRA + DCT-AdamW with Trainer on a 4-bit base of widths bitsandbytes' fused CPU kernel accepts (hidden
    64), adapters on q_proj / v_proj only: evaluating after every step (eval mode, no_grad) leaves the training run
    exactly as it is without evaluations, and merging afterwards lands on the adapted model.

    As on a CPU with and without AVX512-BF16. With it, bitsandbytes would repack each 4-bit layer at the first
    evaluation; the repacked kernel has no autograd, so every later step would get no gradient through those layers
    (all adapter gradients None here: the adapters' outputs reach the loss through unadapted 4-bit layers such as
    o_proj), and the merge would read the repacked weights as garbage (merged logits measured 47% off the adapted
    ones, against 12% from re-quantizing W + delta alone; the adapter moves them by 94%).
    """
    tiny_llama(hidden_size=64).save_pretrained(tmp_path / "base")
    data = sequences(16, seed=0)

    def run(evaluate: bool) -> tuple[torch.nn.Module, list[dict]]:
        torch.manual_seed(0)
        config = adapter_config("lora_dct", identity=False)
        config.target_modules = {"q_proj", "v_proj"}
        model = get_peft_model(load_4bit(tmp_path / "base"), config)
        every_step = {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 8} if evaluate else {}
        trainer = Trainer(
            model=model,
            args=train_args(tmp_path / f"out-{evaluate}", steps=3, **every_step),
            train_dataset=data,
            eval_dataset=data[:8] if evaluate else None,
            data_collator=left_pad,
            optimizer_cls_and_kwargs=optimizer_pair("lora_dct", model),
        )
        trainer.train()
        return model.eval(), trainer.state.log_history

    plain, _ = run(evaluate=False)
    model, history = run(evaluate=True)
    assert sum("eval_loss" in entry for entry in history) == 3, "Trainer did not evaluate after every step"
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for name, param in plain.named_parameters():
        if param.requires_grad:
            assert torch.equal(trained[name], param), name
    batch = prompts()
    with torch.no_grad():
        logits = model(**batch).logits
        merged = copy.deepcopy(model)
        merged.merge_adapter()
        with model.disable_adapter():
            base = model(**batch).logits
        error = relative_error(merged(**batch).logits, logits)
    assert error < 0.25 * relative_error(base, logits), f"merge error {error:.3g} (re-quantization alone: 0.12)"


@pytest.mark.parametrize("method", ["riemannion", "splitlora"])
@pytest.mark.usefixtures("single_thread")
def test_generate_with_one_adapter_per_row_equals_each_adapter_alone(method):
    """``generate(adapter_names=[...])`` routes every decoding step (prefill and cached steps) to the row's adapter."""
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), adapter_config(method, identity=False))
    torch.manual_seed(1)
    model.add_adapter("other", adapter_config(method, identity=False))
    model.eval()
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": PAD}
    with torch.no_grad():
        mixed = model.generate(**prompts(), adapter_names=["default", "other"], **kwargs)
        alone = {}
        for name in ("default", "other"):
            model.set_adapter(name)
            alone[name] = model.generate(**prompts(), **kwargs)
    assert not torch.equal(alone["default"], alone["other"]), "the two adapters generate alike (test is vacuous)"
    assert torch.equal(mixed[0], alone["default"][0]) and torch.equal(mixed[1], alone["other"][1])


@pytest.mark.parametrize("method", ["riemannion", "splitlora"])
@pytest.mark.usefixtures("single_thread")
def test_gradient_checkpointing_gives_the_same_gradients(method):
    """Trainer's ``gradient_checkpointing=True`` path (PEFT's input-grad hook, reentrant recomputation): the
    recomputed forward (Riemannion's cached right basis included) gives the loss and gradients of a plain pass."""
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), adapter_config(method, identity=False)).train()
    batch = left_pad(sequences(8, seed=0))
    plain = model(**batch).loss
    plain.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    checkpointed = model(**batch).loss
    checkpointed.backward()
    assert torch.equal(checkpointed, plain)
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, expected[name], atol=1e-7, rtol=1e-5)
