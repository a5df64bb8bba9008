"""benchmarks/make_run.py and benchmarks/head_cost.py: where `make run`'s time goes, and what a head costs."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import make_run

from .helpers import run_module


def test_the_tables_account_for_every_second_of_the_job():
    payload = {
        "meta": {"wall_seconds": 100.0, "phase_seconds": {"model and data": 5.0, "saving adapters": 3.0}},
        "results": [
            {"label": "a", "train_seconds": 40.0, "head_seconds": 4.0, "eval_seconds": 10.0},
            {"label": "b", "train_seconds": 20.0, "head_seconds": 0.0, "eval_seconds": 6.0},
        ],
    }
    rows, phases, rest = make_run.tables(payload, wall=110.0)
    assert rows == [["a", "36.0", "4.0", "10.0", "50.0"], ["b", "20.0", "0.0", "6.0", "26.0"]]
    assert rest == pytest.approx(100.0 - 76.0 - 8.0)
    named = dict(phases)
    assert named["the methods (sum of the table above)"] == "76.0"
    assert named["interpreter start, imports, exit"] == "10.0" and named["the whole command"] == "110.0"


@pytest.mark.slow
def test_the_quick_run_times_a_real_job_and_prints_the_verdict(tmp_path):
    out = tmp_path / "make_run.json"
    proc = run_module("benchmarks.make_run", "--quick", "--out", out, timeout=600)
    assert "| seq_lora |" in proc.stdout and "| ncm |" in proc.stdout
    assert "- target: make run <= 4 minutes on 2 idle cores: " in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["wall_seconds"] > saved["results"]["meta"]["wall_seconds"] > 0
    assert saved["results"]["meta"]["phase_seconds"]["model and data"] >= 0  # to 0.1 s: not a timing test


@pytest.mark.slow
def test_head_cost_smoke_run_prints_each_head_against_the_target(tmp_path):
    out = tmp_path / "head_cost.json"
    proc = run_module("benchmarks.head_cost", "--quick", "--out", out, timeout=600)
    for head in ("prototype", "lda", "analytic", "aligned"):
        assert f"| {head} |" in proc.stdout
    assert "<= 5 %" in proc.stdout
    assert re.search(
        r"- target: every head <= 5 % of the task's training .*prototype \d+\.\d %.*: (met|NOT met)$",
        proc.stdout,
        re.M,
    )
    med = json.loads(out.read_text())["median"]
    assert med["train"] > med["pass"] > 0 and med["analytic"] > 0
