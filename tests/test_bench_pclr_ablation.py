"""python -m benchmarks.pclr_ablation --quick in a subprocess: the ablation table, the new-task column and resuming."""

from __future__ import annotations

import json

import pytest

from .helpers import run_module


@pytest.mark.slow
def test_quick_ablation_reports_every_variant_and_a_rerun_trains_nothing(tmp_path):
    args = ("benchmarks.pclr_ablation", "--quick", "--out", tmp_path)
    first = run_module(*args)
    head = "| variant | change | final acc | avg incr acc | forgetting | new-task acc | first task |"
    assert head in first.stdout
    rows = {line.split(" | ")[0][2:]: line for line in first.stdout.splitlines() if line.startswith("| ")}
    assert {"base", "no_proto", "seq_lora"} <= set(rows)
    assert "3 run(s) trained" in first.stdout
    record = json.loads((tmp_path / "checkpoint.json").read_text())
    runs = record["runs"]
    assert len(runs) == 3 and all("|validation|" in key for key in runs)  # ablations choose on validation only
    # the new-task column is the mean of the accuracy matrix's diagonal after the first task
    base = next(v for k, v in runs.items() if k.startswith("base|"))
    diag = [base["matrix"][t][t] for t in range(1, len(base["matrix"]))]
    assert f"| {100 * sum(diag) / len(diag):.1f} |" in rows["base"]
    assert record["settings"]["options"]["no_proto"]["adapter"]["prototype_routing"] is False

    again = run_module(*args)
    assert "0 run(s) trained" in again.stdout
    assert [line for line in again.stdout.splitlines() if line.startswith("| ")] == list(rows.values())
