"""python -m benchmarks.splitlora_ablation --quick in a subprocess: the table, one row per variant, validation only,
and a re-run that trains nothing."""

from __future__ import annotations

import json

import pytest

from benchmarks.splitlora_ablation import HEAD, QUICK_VARIANTS

from .helpers import run_module


def _rows(stdout: str) -> dict[str, str]:
    """The ablation table's rows by variant (the first table: the one under HEAD)."""
    lines = stdout.splitlines()
    start = lines.index("| " + " | ".join(HEAD) + " |")
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        rows[line.split(" | ")[0][2:]] = line
    return rows


@pytest.mark.slow
def test_quick_ablation_has_one_row_per_variant_and_resumes(tmp_path):
    runs, summary = tmp_path / "runs.json", tmp_path / "summary.json"
    args = ("benchmarks.splitlora_ablation", "--quick", "--runs", runs, "--json", summary)
    first = run_module(*args, timeout=300, threads=1)
    rows = _rows(first.stdout)
    assert list(rows) == QUICK_VARIANTS
    assert "validation split" in first.stdout and f"{len(QUICK_VARIANTS)} run(s) trained" in first.stdout
    saved = json.loads(runs.read_text())
    assert sorted(saved["settings"]["variants"]) == sorted(QUICK_VARIANTS)
    # each SplitLoRA row reports the primary dimension of its split, InfLoRA-style none; every row but the adaptive
    # ones the accuracy within the task's own classes
    primary = next(i for i, h in enumerate(HEAD) if h.startswith("primary dims"))
    within = HEAD.index("within-task learning acc")
    cells = {name: line.split(" | ") for name, line in rows.items()}
    assert cells["inflora"][primary] == "—" and cells["base"][primary] != "—"
    assert "—" not in (cells["base"][within], cells["inflora"][within], cells["adaptive_norm"][within])
    # the learning-acc column is the job's learning_acc: the mean of the accuracy matrix's diagonal
    base = saved["runs"][json.dumps(["base", 0])]
    diagonal = [base["matrix"][t][t] for t in range(len(base["matrix"]))]
    assert f"| {100 * sum(diagonal) / len(diagonal):.1f} |" in rows["base"]
    assert base["metrics"]["learning_acc"] == pytest.approx(sum(diagonal) / len(diagonal))
    assert json.loads(summary.read_text())["rows"].keys() == set(QUICK_VARIANTS)

    again = run_module(*args, timeout=300, threads=1)
    assert "0 run(s) trained" in again.stdout
    assert _rows(again.stdout) == rows
