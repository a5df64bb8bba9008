"""python -m benchmarks.continual_wordnet --quick: the benchmark protocol end to end (real MiniLM-L6, toy sizes).

One subprocess run of the script, then a ``--resume`` rerun with one run removed from the checkpoint: only that run
trains again and the study equals the uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks._lib import continual as bench

from .helpers import run_module

pytestmark = pytest.mark.slow  # a real pretrained model, about 70 s of CPU for the two runs
METHODS = ["seq_lora", "inflora", "olora", "osf", "splitlora", "pclr", "joint"]


def _run(out: Path, *extra: str) -> str:
    return run_module("benchmarks.continual_wordnet", "--quick", "--out", out, *extra).stdout


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("continual_quick")
    return out, _run(out), json.loads((out / "results.json").read_text())


def test_quick_run_prints_the_protocol_tables_and_verdicts(quick):
    _, stdout, _ = quick
    assert "learning rate chosen per method on the validation split (mean over seed(s) [0]), then test over " in stdout
    head = "| method | lr grid | chosen lr | val acc | test acc (mean ± sd) | lr range within 1 pt | vs inflora (95 %"
    assert head in stdout
    assert "| forgetting / seq_lora's (95 % CI) |" in stdout
    assert "data: the seed picks and orders the 4 classes: every seed draws a different class set" in stdout
    verdicts = [line for line in stdout.splitlines() if line.startswith("target: ")]
    assert len(verdicts) == 4, verdicts
    assert verdicts[0].startswith("target: SplitLoRA final acc >= +1 point over InfLoRA-style: ")
    assert verdicts[1].startswith("target: SplitLoRA forgetting <= 0.5x sequential LoRA's: ratio ")
    assert "pool within its cap of 64" in verdicts[2]
    assert verdicts[3].startswith("target: the baselines' epochs converge (seq_lora, joint: gain from doubling 1 -> 2")
    assert all(line.endswith((": met", ": NOT met")) for line in verdicts)
    assert "| seq_lora | " in stdout.split("Convergence of the baselines' epochs")[1]
    assert "| pclr pool ranks |" in stdout  # the PCLR growth table


def test_quick_run_keeps_the_grid_and_chooses_on_validation(quick):
    _, _, payload = quick
    study = payload["study"]
    assert study["protocol"] == {"tune_seeds": [0], "test_seeds": [0, 1]}
    assert list(study["validation"]) == METHODS
    for method in METHODS:
        grid = study["validation"][method]
        assert len(grid) == 3 and all(len(scores) == 1 for scores in grid.values())
        # the chosen lr is the validation maximum (first on ties), and the test figures are its runs' test scores
        best = max(grid, key=lambda lr: grid[lr][0])
        assert f"{study['chosen'][method]:g}" == best
        assert len(study["test"][method]) == 2
        extras = study["extras"][method][0]
        assert {"forgetting", "avg_incremental_acc", "bwt", "matrix", "cpu_seconds"} <= set(extras)
        key = f"{method}|lr={best}|seed=1|test|tasks=2|epochs=1"
        assert payload["runs"][key]["metrics"]["final_acc"] == study["test"][method][1]
    # the grid is centred on each method's constant, half a decade apart
    assert list(study["validation"]["splitlora"]) == ["0.00158", "0.005", "0.0158"]
    assert [row["method"] for row in payload["convergence"]] == ["seq_lora", "joint"]
    assert payload["data"]["draws_differ"] is True
    # every run scored each task after each later one, on its 2 x 2 test glosses. Whether a method learns is not
    # asked of this toy size: a task is one optimizer step, and with the adapter's update zeroed (tests/helpers.py
    # dead_adapter; each method at its grid centre) seq_lora, inflora, olora, splitlora and pclr score the first task
    # on both test draws exactly as they do live, so a bound on it would pass a dead adapter (it did: "at least
    # 0.75"). Learning through the adapter is checked with the head frozen: tests/test_dead_adapter.py, and on real
    # MiniLM tests/test_splitlora.py.
    for method in METHODS:
        for extras in study["extras"][method]:
            matrix = extras["matrix"]
            rows = [1] if method == "joint" else [0, 1]  # joint trains once, on both tasks
            for i in rows:
                assert all(4 * x == round(4 * x) for x in matrix[i][: i + 1]), (method, matrix)


def test_resume_trains_only_the_missing_run_and_reproduces_the_study(quick):
    out, _, payload = quick
    checkpoint = out / "checkpoint.json"
    record = json.loads(checkpoint.read_text())
    assert set(record["runs"]) == set(payload["runs"])
    missing = "splitlora|lr=0.005|seed=0|validation|tasks=2|epochs=1"
    del record["runs"][missing]
    # an O-LoRA run recorded before its penalty was restored reports no `old_A_rows`: it is trained again
    stale = next(key for key in record["runs"] if key.startswith("olora|"))
    del record["runs"][stale]["extras"]["old_A_rows"]
    checkpoint.write_text(json.dumps(record))
    stdout = _run(out, "--resume")
    assert "this invocation: " in stdout and ", 2 runs trained)" in stdout
    assert f"{stale}" in stdout and "recorded without O-LoRA's penalty: run again" in stdout
    trained = [line for line in stdout.splitlines() if line.startswith("  ") and "CPU)" in line]
    assert len(trained) == 2 and any(missing in line for line in trained) and any(stale in line for line in trained)
    again = json.loads((out / "results.json").read_text())
    assert again["study"]["validation"] == payload["study"]["validation"]
    assert again["study"]["test"] == payload["study"]["test"]


def test_resume_refuses_a_record_made_with_other_settings(tmp_path):
    args = bench.parse_args(["--quick", "--resume", "--out", str(tmp_path)])
    path = tmp_path / "checkpoint.json"
    # a record of the fixed-lr benchmark (before the protocol) has no format: refused, not mixed in
    path.write_text(json.dumps({"settings": {"train_per_class": 40, "options": {}}, "runs": {"5": {}}}))
    with pytest.raises(SystemExit, match=r"other settings \(differing: .*format.*\); drop --resume"):
        bench.checkpoint(args)
    other = bench.parse_args(["--quick", "--resume", "--out", str(tmp_path), "--set", "seq_lora.adapter.r=4"])
    path.write_text(json.dumps({"settings": bench.settings(other), "runs": {}}))
    with pytest.raises(SystemExit, match=r"other settings \(differing: options\.seq_lora\)"):
        bench.checkpoint(args)
    # a moved grid centre is not another setting: runs are keyed by their learning rate
    moved = bench.parse_args(["--quick", "--resume", "--out", str(tmp_path), "--set", "splitlora.lr=1e-2"])
    path.write_text(json.dumps({"settings": bench.settings(moved), "runs": {"k": {}}}))
    assert bench.checkpoint(args).runs == {"k": {}}
    # without --resume the record starts empty (and replaces the file at the first run)
    fresh = bench.parse_args(["--quick", "--out", str(tmp_path)])
    assert bench.checkpoint(fresh).runs == {}
