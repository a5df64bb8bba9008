"""benchmarks.continual_heads: the summary's arithmetic on made-up runs, and a ``--quick`` run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import continual_heads as bench
from peft_ext.continual.report import published_table

from .helpers import run_module


def _write(out: Path, seed: int, label: str, variant: str, final: float, heads: dict[str, float], head="linear"):
    result = {
        "label": label,
        "seed": seed,
        "variant": variant,
        "metrics": {"final_acc": final},
        "train_seconds": 10.0,
        "extras": {
            "head": {"name": head},
            "head_seconds": 1.0,
            "heads": {name: {"metrics": {"final_acc": v}} for name, v in heads.items()},
        },
    }
    path = out / "runs" / f"{seed}-{label}-{variant}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


def test_summary_pairs_draws_expands_the_baselines_run_and_judges_the_targets(tmp_path):
    for seed, shift in enumerate([0.0, 0.02, -0.01]):
        _write(
            tmp_path,
            seed,
            "ncm",
            "trained",
            0.60 + shift,
            {"lda": 0.61 + shift, "analytic": 0.62 + shift},
            head="prototype",
        )
        _write(tmp_path, seed, "splitlora", "trained", 0.50 + shift, {"analytic": 0.66 + shift})
        _write(tmp_path, seed, "splitlora", "first_task", 0.64 + shift, {"lda": 0.65 + shift}, head="prototype")
        _write(tmp_path, seed, "inflora", "trained", 0.45 + shift, {"analytic": 0.55 + shift + 0.01 * seed})
        _write(tmp_path, seed, "joint", "trained", 0.70 + shift, {})
    # a draw only some methods finished is left out of every row
    _write(tmp_path, 3, "ncm", "trained", 0.9, {}, head="prototype")
    summary = bench.summarize(tmp_path, "toy", "python -m benchmarks.continual_heads --config toy")
    assert summary["draws"] == [0, 1, 2]
    methods = summary["methods"]
    assert list(methods) == ["inflora", "splitlora", "joint", "ncm", "slda", "ranpac"]  # ORDER, then baselines
    assert methods["slda"]["heads"]["lda"]["values"] == pytest.approx([0.61, 0.63, 0.60])  # from ncm's run
    split = methods["splitlora"]
    assert split["best_head"] == "analytic" and split["best_mean"] == pytest.approx(66 + 1 / 3)
    assert split["vs_ncm"][0] == pytest.approx(6.0) and split["vs_ncm"][1] == pytest.approx(6.0)  # constant gap
    assert summary["best_training_free"] == "ranpac"
    floor = summary["targets"]["floor"]
    assert floor["methods"]["splitlora"]["met"] and not floor["methods"]["inflora"]["met"] and not floor["met"]
    moon = summary["targets"]["moonshot"]
    assert moon["method"] == "splitlora" and moon["share_of_gap_closed"] == pytest.approx(0.5) and moon["met"]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    table = published_table(tmp_path / "summary.json")
    assert "| splitlora | 50.3 ± " in table and "66.3 (analytic)" in table
    assert "beat it: splitlora (analytic, +6.0)" in table and "trail it: inflora" in table
    assert "3 class draws of `toy`" in table


@pytest.mark.slow  # real MiniLM-L6, 2 draws of 2 tiny tasks: about 40 s on 2 cores
def test_quick_run_end_to_end(tmp_path):
    out = tmp_path / "heads"
    text = run_module(
        "benchmarks.continual_heads", "--quick", "--out", out, "--methods", "seq_lora", "joint", "ncm"
    ).stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["draws"] == [0, 1]
    assert set(summary["methods"]) == {"seq_lora", "joint", "ncm", "slda", "ranpac"}
    heads = summary["methods"]["seq_lora"]["heads"]
    assert {"linear", "prototype", "lda", "analytic", "aligned", "cosine", "first_task+prototype"} <= set(heads)
    assert "floor" in summary["targets"] and "Targets:" in text
