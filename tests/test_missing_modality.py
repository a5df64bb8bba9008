"""Missing-aware prompts (the MMP baseline), the BERT + ViT dual encoder MoRA pairs, and the ``job: missing_modality``
configs of ``peft-ext run`` (tiny sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import get_peft_model

from peft_ext import MoRAConfig
from peft_ext.cli import main
from peft_ext.multimodal.dual_encoder import build_dual_encoder, mora_patterns
from peft_ext.multimodal.experiment import grid_specs
from peft_ext.multimodal.prompts import COMPLETE, IMAGE_MISSING, TEXT_MISSING, MissingAwarePrompts, missing_pattern
from peft_ext.tuners.mora import plan_targets

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


def _dual(tiny_text: Path):
    return build_dual_encoder(str(tiny_text), vision_width=24, vision_layers=2, vision_heads=2, embed_dim=8)


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


def _config(tmp_path: Path, tiny_text: Path) -> Path:
    def edit(data: dict) -> None:
        data["model"].update(
            text=str(tiny_text),
            vision_width=24,
            vision_layers=2,
            vision_heads=2,
            embed_dim=8,
            pretrain_epochs=1,
            train_limit=96,
            epochs=1,
            timing_batches=1,
            cache_dir=str(tmp_path / "cache"),
        )
        data["methods"] = ["linear_probe", "lora", "mora", "prompts"]

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
