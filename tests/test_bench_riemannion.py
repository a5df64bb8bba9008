"""python -m benchmarks.riemannion --quick: every code path of the protocol benchmark in one small subprocess run."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from .helpers import run_module

METHODS = ["riemannion_loi", "riemannion_random", "lora_adamw", "lora_rprec", "lora_ga", "lora_muon"]


@pytest.mark.slow
def test_quick_run_tunes_on_validation_reports_test_curves_timing_and_verdicts(tmp_path):
    out, png = tmp_path / "riemannion.json", tmp_path / "lr.png"
    args = ["--quick", "--json", out, "--figure", png]
    args += ["--methods", *METHODS]  # LoRA-GA too (not in the default set): every code path
    text = run_module("benchmarks.riemannion", *args, timeout=900).stdout

    for method in METHODS:  # Study.table: every method with its 3-point grid, chosen lr and lr-range width
        row = rf"^\| {method} \| [^|]+ / [^|]+ / [^|]+ \| [0-9.e-]+ \| [0-9.]+ \| .* decades \|"
        assert re.search(row, text, re.M), method
    assert "test accuracy vs steps at the chosen lr" in text.lower() and "interleaved in one process" in text
    verdicts = [line for line in text.splitlines() if line.startswith("target: ")]
    assert len(verdicts) == 3 and all(re.search(r": (met|NOT met)$", v) for v in verdicts), verdicts
    assert "95 % CI" in verdicts[0] and "step time" in verdicts[1] and "LOI cost" in verdicts[2]
    assert "check: a plain re-run gives the cached run's mean training loss and test accuracy: PASS" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    data = json.loads(out.read_text())
    study, steps = data["study"], data["meta"]["steps"]
    assert study["protocol"] == {"tune_seeds": [0], "test_seeds": [0, 1]}
    for method in METHODS:
        grid = study["validation"][method]
        assert len(grid) == 3
        # chosen on validation: the first maximum of the grid's validation scores
        best = max(grid, key=lambda lr: statistics.mean(grid[lr]))
        assert f"{study['chosen'][method]:g}" == best
        assert len(study["test"][method]) == 2
    # 18 grid runs + 6 seed-1 test runs: seed 0 at the chosen lr is the grid's run, trained once
    assert len(data["runs"]) == 24
    for run in data["runs"]:
        assert list(run["curves"]) == ["validation", "test"]
        assert [int(s) for s in run["curves"]["test"]] == data["meta"]["checkpoints"]
        if run["seed"] == 0:
            assert run["curves"]["validation"][str(steps)] == study["validation"][run["method"]][f"{run['lr']:g}"][0]
    assert data["trajectory_check"]["equal"] is True
    timing = data["timing"]
    assert set(timing["median_step_ms"]) == set(METHODS) and set(timing["init"]) == {"riemannion_loi", "lora_ga"}
    loi = timing["init"]["riemannion_loi"]
    assert loi["steps_equivalent"] == pytest.approx(loi["seconds"] / (timing["median_step_ms"]["lora_adamw"] / 1e3))
    assert loi["share"] == pytest.approx(loi["steps_equivalent"] / steps)
    assert data["targets"] == verdicts
