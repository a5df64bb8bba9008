"""python -m benchmarks.mora_missing_modality --quick in a subprocess: the protocol's tables, verdict lines and JSON (a
tiny random BERT as the text tower keeps it short; the real MiniLM run is the script's own --quick)."""

from __future__ import annotations

import json

import pytest

from .helpers import run_module, save_tiny_bert

METHODS = ["linear_probe", "lora", "mora", "prompts", "lora_matched"]


@pytest.mark.slow
def test_quick_run_tunes_on_validation_and_reports_test(tmp_path):
    text = save_tiny_bert(tmp_path / "tiny-bert", num_layers=3)
    out = tmp_path / "mora.json"
    log = run_module("benchmarks.mora_missing_modality", "--quick", "--text", text, "--json", out).stdout
    assert "train / 293 validation / 363 test" in log
    assert (
        "learning rate chosen per method on the validation split (mean over seed(s) [0]), then test over seeds [0, 1]"
        in log
    )
    for key in ("0.7 both", "0 -"):
        assert f"### missing rate {key}: test accuracy" in log
    assert (
        "| method | lr grid | chosen lr | val acc | test acc (mean ± sd) | lr range within 1 pt | vs lora (95 % CI) |"
        in log
    )
    verdicts = [line for line in log.splitlines() if line.startswith("target: MoRA best at missing rate 0.7 both")]
    assert len(verdicts) == 1 and verdicts[0].endswith(("(lower end > 0): met", "(lower end > 0): NOT met"))
    assert "over 2 seeds" in verdicts[0]
    assert "equal parameters, missing rate 0.7 both: MoRA vs LoRA at MoRA's parameter count (lora_matched)" in log
    assert "target: MoRA inference time / prompt baseline" in log

    payload = json.loads(out.read_text())
    assert payload["main_setting"] == "0.7 both" and set(payload["studies"]) == {"0.7 both", "0 -"}
    main = payload["studies"]["0.7 both"]
    assert list(main["chosen"]) == METHODS
    for method in METHODS:
        grid = main["validation"][method]
        assert list(grid) == ["0.00316", "0.01", "0.0316"] and all(len(v) == 1 for v in grid.values())
        # the chosen rate is the best validation point, and the test figures are the chosen rate's
        best = max(grid, key=lambda lr: grid[lr][0])
        assert float(best) == main["chosen"][method]
        assert len(main["test"][method]) == 2
        assert payload["studies"]["0 -"]["chosen"][method] == main["chosen"][method]
    rows = payload["rows"]
    assert len(rows) == 2 * 5 * 2
    params = {r["method"]: r["params"] for r in rows}
    # the matched LoRA trains MoRA's count up to less than one rank of its smallest module (2 x 32 here)
    assert params["lora"] < params["lora_matched"] <= params["mora"] < params["lora_matched"] + 64
    seed1 = [r for r in rows if r["rate"] == 0.7 and r["method"] == "mora" and r["seed"] == 1][0]
    assert seed1["acc"] == main["test"]["mora"][1]
