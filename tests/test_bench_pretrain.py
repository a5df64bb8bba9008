"""benchmarks/pretrain_llama.py: the pretraining benchmark's setup and its ``--quick`` run end to end."""

from __future__ import annotations

import json
import math

import pytest

from .helpers import run_module


@pytest.fixture(scope="module")
def bench():
    from benchmarks import pretrain_llama

    return pretrain_llama


def test_every_low_rank_optimizer_projects_the_same_matrices(bench):
    """Same matrices at the same rank and gap for GaLore, APOLLO and the DCT family; the rest plain AdamW."""
    from argparse import Namespace

    from peft_ext.models import tiny_llama

    model = tiny_llama(vocab_size=bench.VOCAB, hidden_size=32, num_layers=2)
    args = Namespace(rank=4, gap=3)
    expected = {n for n, _ in model.named_parameters() if n.split(".")[-2] in bench.TARGETS}
    assert len(expected) == 7 * 2
    by_id = {id(p): n for n, p in model.named_parameters()}
    for name in ("galore", "apollo"):
        groups = bench.build_optimizer(name, model, 1e-3, args).param_groups
        low = [g for g in groups if "rank" in g]
        assert len(low) == 1 and low[0]["rank"] == 4 and low[0]["update_proj_gap"] == 3
        assert {by_id[id(p)] for p in low[0]["params"]} == expected
    for name in bench.OURS:
        optimizer = bench.build_optimizer(name, model, 1e-3, args)
        plan = optimizer.projection_plan()
        assert {n for n, _, r in plan if r is not None} == expected, name
        assert {r for _, _, r in plan if r is not None} == {4}
        assert optimizer.param_groups[0]["update_proj_gap"] == 3
    with pytest.raises(ValueError, match="unknown optimizer"):
        bench.build_optimizer("sgd", model, 1e-3, args)


def test_schedule_and_splits(bench):
    # warmup reaches the full lr, cosine ends at 10 %
    assert bench.lr_factor(0, 100, 10) == pytest.approx(0.1)
    assert bench.lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert bench.lr_factor(100, 100, 10) == pytest.approx(0.1)
    assert bench.lr_factor(55, 100, 10) == pytest.approx(0.55)
    from peft_ext.data.wordnet import read_gloss_file

    train = [r.synset for r in read_gloss_file() if r.split == "train"]
    share = sum(map(bench._validation, train)) / len(train)
    assert 0.08 < share < 0.12  # validation is ~10 % of the training synsets, test stays WordNet's own split


@pytest.mark.slow
def test_quick_run(tmp_path):
    """``--quick`` end to end: every optimizer tuned and tested, the table, the verdicts, the PNG and the JSON."""
    png, out = tmp_path / "loss.png", tmp_path / "pretrain.json"
    args = ("benchmarks.pretrain_llama", "--quick", "--png", png, "--json", out, "--runs", tmp_path / "runs.json")
    text = run_module(*args, timeout=900).stdout
    result = json.loads(out.read_text())
    # a re-started job trains nothing: every run comes from --runs, and it reports the same figures
    again = run_module(*args, timeout=900).stdout
    assert "21 finished run(s) saved" in again and "[round seed" not in again
    assert json.loads(out.read_text())["test"] == result["test"]
    names = ("adamw", "galore", "apollo", "dct_adamw", "subspace_adamw", "dct_channel", "subspace_channel")
    assert set(result["chosen"]) == set(names)
    for name in names:
        runs = result["extras"][name]
        assert len(runs) == 2 and all(r["diverged"] is None for r in runs)
        # 8 steps from a random init: better than the uniform byte model, still far from trained
        assert all(2.0 < r["test"] < math.log(256) for r in runs), name
        # the reported test figure is the test loss of the run at the lr validation chose
        assert result["test"][name] == [pytest.approx(-r["test"]) for r in runs]
        grid = result["validation"][name]
        assert max(grid, key=lambda lr: grid[lr][0]) == f"{result['chosen'][name]:g}"
        assert f"| {name} |" in text
    # AdamW's state counted independently: two float32 moments per parameter plus a 4-byte step per tensor
    from peft_ext.models import tiny_llama

    model = tiny_llama(vocab_size=256, hidden_size=32, num_layers=2)
    adamw = sum(8 * p.numel() + 4 for p in model.parameters())
    assert result["extras"]["adamw"][0]["state_bytes"] == adamw
    for name in names[1:]:
        assert result["extras"][name][0]["state_bytes"] < adamw, name
    assert text.count("target: ") == 3
    assert "DCT-AdamW ~ GaLore" in text and "min(GaLore, APOLLO)" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
