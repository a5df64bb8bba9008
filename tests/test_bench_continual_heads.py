"""benchmarks.continual_heads: the summary's arithmetic on made-up runs, and a ``--quick`` run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import continual_heads as bench
from peft_ext.continual.published import published_table

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


def test_sizes_places_each_method_between_the_best_baseline_and_joint(tmp_path):
    paths = []
    for n, (free, joint, split, inflora) in {200: (0.66, 0.80, 0.73, 0.60), 40: (0.62, 0.70, 0.66, 0.55)}.items():
        out = tmp_path / str(n)
        for seed in range(2):
            _write(out, seed, "ncm", "trained", free - 0.01, {"lda": free, "analytic": free - 0.02}, head="prototype")
            _write(out, seed, "splitlora", "trained", 0.5, {"analytic": split})
            _write(out, seed, "inflora", "trained", inflora, {})
            _write(out, seed, "joint", "trained", joint, {"lda": joint + 0.01})
        summary = bench.summarize(out, "toy", f"python -m benchmarks.continual_heads --train-per-class {n}", n)
        paths.append(out / "summary.json")
        paths[-1].write_text(json.dumps(summary))
    payload = bench.sizes(paths)
    assert [e["train_per_class"] for e in payload["sizes"]] == [40, 200]  # smallest first, whatever the order given
    first = payload["sizes"][0]
    assert first["best_free"] == {"method": "slda", "mean": pytest.approx(62.0)}
    assert first["joint"] == pytest.approx(70.0)  # joint's linear head, as the moonshot target reads it
    (tmp_path / "sizes.json").write_text(json.dumps(payload))
    table = published_table(tmp_path / "sizes.json")
    # splitlora: (66 - 62) / (70 - 62) = 50 % at 40; (73 - 66) / (80 - 66) = 50 % at 200; inflora below the baseline
    assert "| splitlora | 66.0 (analytic) | 50 % | 73.0 (analytic) | 50 % |" in table
    assert "| inflora | 55.0 (linear) | -87 % | 60.0 (linear) | -43 % |" in table
    assert "| best training-free | 62.0 (slda) | 0 % | 66.0 (slda) | 0 % |" in table
    assert "moves from 8.0 to 14.0 points" in table and "splitlora 50 % -> 50 %" in table
    assert "class draws: 2 at 40, 2 at 200" in table
    other = json.loads(paths[0].read_text()) | {"config": "other"}
    paths[0].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"one sequence at several sizes; got the configs \['other', 'toy'\]"):
        bench.sizes(paths)
    paths[0].write_text(json.dumps(other | {"train_per_class": None}))
    with pytest.raises(SystemExit, match="not a heads protocol summary that records its train_per_class"):
        bench.sizes(paths)


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
