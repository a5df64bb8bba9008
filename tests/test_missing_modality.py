"""Missing-aware prompts (the MMP baseline), the BERT + ViT dual encoder MoRA pairs, and the ``job: missing_modality``
configs of ``peft-ext run`` (tiny sizes): results on disk after every grid cell, a failed cell recorded while the
others run, Ctrl-C then ``--resume`` ending with the rows of an uninterrupted run, a changed config refused."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import get_peft_model

from peft_ext import MoRAConfig
from peft_ext.fileperm import current_umask
from peft_ext.multimodal import experiment
from peft_ext.multimodal.dual_encoder import build_dual_encoder, mora_patterns
from peft_ext.multimodal.experiment import grid_specs
from peft_ext.multimodal.prompts import COMPLETE, IMAGE_MISSING, TEXT_MISSING, MissingAwarePrompts, missing_pattern
from peft_ext.tuners.mora import plan_targets
from peft_ext_cli import main

from .helpers import job_config, save_tiny_bert


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory) -> Path:
    """A tiny random 3-layer BERT (width 32) saved with MiniLM's real tokenizer, as a local text-tower directory."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=3)


# -- prompts ----------------------------------------------------------------------------------------------------------


def test_missing_pattern_ids_and_errors():
    text = np.array([False, True, False, False])
    image = np.array([False, False, True, False])
    assert missing_pattern(text, image).tolist() == [COMPLETE, TEXT_MISSING, IMAGE_MISSING, COMPLETE]
    with pytest.raises(ValueError, match="misses both"):
        missing_pattern(np.array([True]), np.array([True]))
    with pytest.raises(ValueError, match="equal length"):
        missing_pattern(np.array([True]), np.array([True, False]))


def test_prompts_are_selected_per_example_by_missing_pattern():
    prompts = MissingAwarePrompts(num_layers=2, length=3, width=5)
    pattern = torch.tensor([IMAGE_MISSING, COMPLETE, TEXT_MISSING, COMPLETE])
    for layer in range(2):
        out = prompts(pattern, layer)
        assert out.shape == (4, 3, 5)
        for row, p in enumerate(pattern.tolist()):
            assert torch.equal(out[row], prompts.prompts[p, layer])
    hidden, mask = torch.randn(4, 6, 5), torch.ones(4, 6, dtype=torch.long)
    mask[0, 4:] = 0
    joined, joined_mask = prompts.prepend(hidden, mask, pattern, 1)
    assert torch.equal(joined[:, 3:], hidden) and torch.equal(joined[:, :3], prompts(pattern, 1))
    assert joined_mask[:, :3].eq(1).all() and torch.equal(joined_mask[:, 3:], mask)
    with pytest.raises(ValueError, match="layer"):
        prompts(pattern, 2)
    with pytest.raises(ValueError, match="length"):
        MissingAwarePrompts(num_layers=1, length=0, width=4)


def test_prompt_gradients_reach_only_the_selected_patterns_and_layer():
    prompts = MissingAwarePrompts(num_layers=2, length=2, width=4)
    pattern = torch.tensor([TEXT_MISSING, TEXT_MISSING, COMPLETE])  # no example misses its image
    prompts(pattern, 1).square().sum().backward()
    grad = prompts.prompts.grad
    assert grad[COMPLETE, 1].abs().sum() > 0 and grad[TEXT_MISSING, 1].abs().sum() > 0
    assert grad[IMAGE_MISSING].abs().sum() == 0
    assert grad[:, 0].abs().sum() == 0


# -- the dual encoder -------------------------------------------------------------------------------------------------

# the tiny ViT and joint space of every dual encoder here (the text tower is the tiny BERT's)
TINY_TOWERS = {"vision_width": 24, "vision_layers": 2, "vision_heads": 2, "embed_dim": 8}


def _dual(tiny_text: Path):
    return build_dual_encoder(str(tiny_text), **TINY_TOWERS)


def test_dual_encoder_layers_match_the_hf_towers_and_cached_lower_layers(tiny_text):
    model, tok = _dual(tiny_text)
    enc = tok(["grinning face", "", "red apple"], padding="max_length", max_length=8, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    full = model.text_hidden(model.text_embeddings(ids), mask)
    keep = mask.bool()
    assert torch.allclose(full[keep], model.text(**enc).last_hidden_state[keep], atol=1e-6)
    low = model.text_hidden(model.text_embeddings(ids), mask, end=1)
    assert torch.equal(model.text_hidden(low, mask, start=1), full)
    px = torch.randn(3, 3, 32, 32)
    vision = model.vision_hidden(model.vision_embeddings(px))
    assert torch.allclose(model.vision.layernorm(vision), model.vision(px).last_hidden_state, atol=1e-6)
    # prompts change the output only through the prompted (top) layer; the pattern picks which prompts
    prompts = MissingAwarePrompts(num_layers=1, length=2, width=32, init_std=1.0)
    pattern = missing_pattern(np.array([False, True, False]), np.zeros(3, dtype=bool))
    prompted = model.text_hidden(low, mask, 1, prompts, pattern)
    assert prompted.shape == full.shape and not torch.allclose(prompted, full)


def test_mora_pairs_minilm_style_bert_with_a_narrower_vit(tiny_text):
    model, _ = _dual(tiny_text)
    plan = plan_targets(model, MoRAConfig(r=2, top_layers=2, **mora_patterns()))
    pairs = {(t.modality, t.pair_key, t.width) for t in plan.values()}
    assert pairs == {
        ("text", "t1_v0", 32),
        ("text", "t2_v1", 32),
        ("vision", "t1_v0", 24),
        ("vision", "t2_v1", 24),
    }
    assert len(plan) == 2 * 2 * 4  # 2 towers x 2 layers x (q, k, v, out)
    assert not any(name.endswith("layer.2.output.dense") for name in plan)  # the FFN output is not square
    peft_model = get_peft_model(model, MoRAConfig(r=2, top_layers=2, **mora_patterns()))
    shared = peft_model.base_model.shared_factors()
    assert shared["t2_v1"][0].shape == (32, 2) and shared["t2_v1"][1].shape == (24, 2)


def test_grid_runs_rate_zero_once():
    specs = grid_specs([0, 0.3, 0.7], ["text", "image", "both"])
    assert [(s.rate, s.kind) for s in specs] == [
        (0, "both"),
        (0.3, "text"),
        (0.3, "image"),
        (0.3, "both"),
        (0.7, "text"),
        (0.7, "image"),
        (0.7, "both"),
    ]


# -- the peft-ext job -------------------------------------------------------------------------------------------------


def _config(
    tmp_path: Path, tiny_text: Path, cache: Path | None = None, more: Callable[[dict], None] | None = None
) -> Path:
    """The shipped MoRA job at tiny sizes, written to ``tmp_path``; ``cache``: the backbone cache (default
    ``tmp_path / "cache"``); ``more``: further edits of the config document."""

    def edit(data: dict) -> None:
        data["model"].update(
            TINY_TOWERS,
            text=str(tiny_text),
            pretrain_epochs=1,
            train_limit=96,
            epochs=1,
            timing_batches=1,
            cache_dir=str(cache or tmp_path / "cache"),
        )
        data["methods"] = ["linear_probe", "lora", "mora", "prompts"]
        if more is not None:
            more(data)

    return job_config(tmp_path, "mora_emoji", edit)


def test_peft_ext_runs_a_missing_modality_job(tmp_path, tiny_text, capsys):
    cfg = _config(tmp_path, tiny_text)
    assert main(["check", str(cfg)]) == 0
    assert main(["run", str(cfg), "--set", "grid.rates=[0, 0.7]"]) == 0
    out = capsys.readouterr().out
    assert "| missing rate | type | method | accuracy |" in out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = results["results"]
    assert [(r["rate"], r["method"]) for r in rows][:4] == [
        (0, m) for m in ("linear_probe", "lora", "mora", "prompts")
    ]
    assert len(rows) == 8 and all(0 <= r["acc"] <= 1 and r["params"] > 0 for r in rows)
    params = {r["method"]: r["params"] for r in rows}
    assert params["linear_probe"] < params["lora"] < params["mora"]
    assert "| MoRA |" in (tmp_path / "out" / "results.md").read_text()
    assert len(list((tmp_path / "cache").glob("dual_*.pt"))) == 1
    # the output dir holds that run: a second run is refused unless told to resume or to start over
    assert main(["run", str(cfg), "--set", "methods=[mora]"]) == 2
    assert "holds an earlier run" in capsys.readouterr().err
    first = (tmp_path / "out" / "results.json").read_text()
    # --overwrite moves the first run aside, and loads the cached backbone instead of pretraining again
    assert main(["run", str(cfg), "--set", "methods=[mora]", "--overwrite"]) == 0
    assert "loaded the pretrained dual encoder" in capsys.readouterr().out
    (aside,) = (tmp_path / "out").glob("replaced-*")
    assert (aside / "results.json").read_text() == first and (aside / "results.md").is_file()
    assert {r["method"] for r in json.loads((tmp_path / "out" / "results.json").read_text())["results"]} == {"mora"}


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.vision_widht=8", "unknown key `model.vision_widht` (did you mean `vision_width`?)"),
        ("methods=[mora, lorra]", "(did you mean `lora`?)"),
        ("grid.kinds=[audio]", "`grid.kinds` must be a non-empty list"),
        ("job=missing_modalty", "(did you mean `missing_modality`?)"),
        ("model.r=0", "`model.r` must be a positive integer, got 0"),
    ],
)
def test_missing_modality_config_errors_exit_2(tmp_path, tiny_text, capsys, override, message):
    cfg = _config(tmp_path, tiny_text)
    assert main(["check", str(cfg), "--set", override]) == 2
    assert message in capsys.readouterr().err


# -- results after every grid cell, failures, --resume ----------------------------------------------------------------
# Two cells, linear probe then LoRA, under one missing setting and one seed: the cheapest grid with a cell after the
# one that fails or is interrupted. Every run of these tests shares one backbone cache.
RESUME_METHODS = ["linear_probe", "lora"]
TIMING_KEYS = {"train_s"}


def _two_cells(data: dict) -> None:
    data["grid"].update(rates=[0.7], kinds=["both"], seeds=[0])
    data["methods"] = RESUME_METHODS


@pytest.fixture(scope="module")
def backbone_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mm-cache")


def _rows(out: Path) -> list[dict]:
    """The result rows without timings (the only part an interruption may change)."""
    rows = json.loads((out / "results.json").read_text())["results"]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_text, backbone_cache) -> dict:
    """An uninterrupted run (it pretrains the shared backbone cache)."""
    cfg = _config(tmp_path_factory.mktemp("reference"), tiny_text, backbone_cache, _two_cells)
    assert main(["run", str(cfg)]) == 0
    out = cfg.parent / "out"
    return {"cfg": cfg, "out": out, "rows": _rows(out)}


def _count_cells(monkeypatch, fail_at: int | None = None, error: BaseException | None = None) -> list[tuple]:
    """Wrap :func:`experiment.run_method`: record each cell it runs; the ``fail_at``-th call (1-based) raises
    ``error`` instead."""
    calls: list[tuple] = []
    real = experiment.run_method

    def run_method(prep, method, spec, seed=0):
        calls.append((method, seed))
        if len(calls) == fail_at:
            raise error
        return real(prep, method, spec, seed)

    monkeypatch.setattr(experiment, "run_method", run_method)
    return calls


def test_reference_rows_are_written_with_the_config_hash_and_umask_modes(reference):
    out = reference["out"]
    assert [(r["method"], r["seed"]) for r in reference["rows"]] == [("linear_probe", 0), ("lora", 0)]
    payload = json.loads((out / "results.json").read_text())
    assert len(payload["meta"]["config_hash"]) == 16 and "failed" not in payload
    assert set(payload["meta"]["inference_ms_per_64"]) == set(RESUME_METHODS)
    assert "| LoRA (both towers) |" in (out / "results.md").read_text()
    for name in ("results.json", "results.md"):
        assert os.stat(out / name).st_mode & 0o777 == 0o666 & ~current_umask()
    assert not list(out.glob(".*.tmp"))  # no temporary left behind


def test_a_failed_cell_is_recorded_the_others_still_run_and_resume_retries_it(
    tmp_path, tiny_text, backbone_cache, reference, monkeypatch, capsys
):
    cfg = _config(tmp_path, tiny_text, backbone_cache, _two_cells)
    calls = _count_cells(monkeypatch, fail_at=1, error=ValueError("`r` 99 is above the width 24\nsecond line"))
    assert main(["run", str(cfg)]) == 1
    assert calls == [("linear_probe", 0), ("lora", 0)]  # the cell after the failed one ran
    err = capsys.readouterr().err
    label = "linear_probe (rate 0.7 both, seed 0)"
    assert f"peft-ext: method {label} failed: ValueError: `r` 99 is above the width 24\n" in err
    assert "second line" not in err and "Traceback" not in err
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert payload["failed"] == [
        {
            "rate": 0.7,
            "kind": "both",
            "method": "linear_probe",
            "seed": 0,
            "label": label,
            "error": "ValueError: `r` 99 is above the width 24",
        }
    ]
    # the other cell's row is on disk, equal to the uninterrupted run's: it does not depend on the cells before it
    assert _rows(tmp_path / "out") == reference["rows"][1:]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## failed" in md and f"- {label}: ValueError: `r` 99" in md
    assert set(payload["meta"]["inference_ms_per_64"]) == {"lora"}  # only a method that built is timed
    # --resume retries the failed cell only, and the failure is gone from the results
    monkeypatch.undo()
    calls = _count_cells(monkeypatch)
    assert main(["run", str(cfg), "--resume"]) == 0
    assert calls == [("linear_probe", 0)]
    assert _rows(tmp_path / "out") == reference["rows"]
    assert "failed" not in json.loads((tmp_path / "out" / "results.json").read_text())


def test_ctrl_c_then_resume_ends_with_the_rows_of_an_uninterrupted_run(
    tmp_path, tiny_text, backbone_cache, reference, monkeypatch, capsys
):
    cfg = _config(tmp_path, tiny_text, backbone_cache, _two_cells)
    out = tmp_path / "out"
    _count_cells(monkeypatch, fail_at=2, error=KeyboardInterrupt())
    assert main(["run", str(cfg)]) == 130
    assert f"peft-ext run {cfg} --resume" in capsys.readouterr().err
    assert _rows(out) == reference["rows"][:1]  # the cell that finished is on disk
    assert "| frozen + linear head |" in (out / "results.md").read_text()

    monkeypatch.undo()
    calls = _count_cells(monkeypatch)
    assert main(["run", str(cfg), "--resume"]) == 0
    stdout = capsys.readouterr().out
    assert "loaded the pretrained dual encoder" in stdout  # the cached backbone, not pretrained again
    assert "linear_probe seed 0: finished in an earlier run" in stdout
    assert calls == [("lora", 0)]  # only the cell not finished
    assert _rows(out) == reference["rows"]
    payload = json.loads((out / "results.json").read_text())
    assert set(payload["meta"]["inference_ms_per_64"]) == set(RESUME_METHODS)


def test_resume_with_a_changed_config_is_refused(reference, capsys):
    before = (reference["out"] / "results.json").read_text()
    assert main(["run", str(reference["cfg"]), "--set", "model.lr=0.02", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "peft-ext: config error: --resume: the results in" in err
    assert "were made with a different config (hash" in err
    assert "start over with --overwrite instead of --resume" in err
    assert (reference["out"] / "results.json").read_text() == before  # nothing touched


# -- the method registry ----------------------------------------------------------------------------------------------


def test_methods_come_from_the_registry_and_a_registered_one_runs(tiny_text):
    from peft_ext.multimodal.methods import (
        MISSING_MODALITY_METHODS,
        Built,
        MissingModalityMethod,
        get_missing_modality_method,
        job_methods,
        register_missing_modality_method,
    )
    from peft_ext.multimodal.missing import MissingSpec

    assert experiment.METHODS == ("linear_probe", "lora", "mora", "prompts")
    assert experiment.ALL_METHODS == (*experiment.METHODS, "lora_matched")
    with pytest.raises(ValueError, match=r"unknown method 'lorra' \(did you mean 'lora'\?\); choose from"):
        get_missing_modality_method("lorra")
    with pytest.raises(ValueError, match="already registered"):
        register_missing_modality_method(MISSING_MODALITY_METHODS["mora"])
    settings = experiment.ExperimentSettings(
        text=str(tiny_text), vision_width=32, vision_layers=3, vision_heads=2, embed_dim=16, pretrain_epochs=1,
        cache_dir=None, epochs=1, train_limit=64,
    )  # fmt: skip
    prep = experiment.prepare(settings, echo=lambda *_: None)
    # a frozen-backbone method built like the linear probe trains like it, to the bit
    probe = MissingModalityMethod("probe_again", lambda p, bb, seed: Built(bb), "test", frozen_backbone=True)
    register_missing_modality_method(probe)
    try:
        spec = MissingSpec(0.7, "both")
        again = experiment.run_method(prep, "probe_again", spec)
        reference = experiment.run_method(prep, "linear_probe", spec)
        assert {k: again[k] for k in ("acc", "f1", "auroc", "params")} == {
            k: reference[k] for k in ("acc", "f1", "auroc", "params")
        }
        assert job_methods()[-1] == "probe_again"  # the job offers it too
    finally:
        del MISSING_MODALITY_METHODS["probe_again"]
