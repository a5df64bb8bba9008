"""python -m benchmarks.splitlora_scaling --quick: every part of the scaling benchmark in one small subprocess run."""

from __future__ import annotations

import json
import re

import pytest

from .helpers import run_module


@pytest.mark.slow
def test_quick_run_measures_every_part_and_prints_the_verdicts(tmp_path):
    out = tmp_path / "scaling.json"
    proc = run_module("benchmarks.splitlora_scaling", "--quick", "--json", out, threads=1)
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith("target: ")]
    assert len(verdicts) == 4 and all(re.search(r": (met|NOT met)$", v) for v in verdicts), verdicts
    data = json.loads(out.read_text())
    assert [r["width"] for r in data["widths"]] == [64, 128]
    for row in data["widths"]:
        assert row["statistics_ratio"] == row["statistics_pass_s"] / row["plain_forward_s"] > 1.0
        # the inference checkpoint holds B, A and one finished task's factors: no covariance (it is in the
        # sequence state, n x n per module, far larger at these shapes)
        assert row["checkpoint_bytes"] < 2.1 * row["lora_checkpoint_bytes"] < row["sequence_state_bytes"] * 2.1
        assert row["end_task_lora_steps"] == row["end_task_s"] / row["lora_step_s"]
    (toy,) = data["paper"]
    assert toy["projections"] == 14 and toy["statistics_pass_ratio"] > 1.0
    assert {(m["n"], m["out"]) for m in data["modules"]} == {(256, 256), (256, 64), (256, 512), (512, 256)}
