"""benchmarks/run_all.py: runs each entry into its log, extracts the tables and target verdicts, writes the report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def run_all(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LOGS", tmp_path / "logs")
    script = tmp_path / "fake_bench.py"
    script.write_text(
        "import sys\n"
        "print('progress 10%\\rprogress 100%')\n"
        "print('### Accuracy')\n"
        "print('| method | acc |')\n"
        "print('|---|---:|')\n"
        "print('| ours | 51.0 |')\n"
        "print('target: ours - theirs = +2.0 points (>= +1.0): met')\n"
        "print('target: step time 1.3x (<= 1.15x): NOT met')\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    entries = (
        module.Entry("good", "A good benchmark", (str(script), "0"), 1, "What it compares.", "figures/good.png"),
        module.Entry("broken", "A failing benchmark", (str(script), "3"), 1, "Fails on purpose."),
        module.Entry("missing", "Never run", (str(script), "0"), 1, "Not selected."),
    )
    monkeypatch.setattr(module, "ENTRIES", entries)
    return module


def test_extract_finds_tables_with_captions_targets_and_the_footer(run_all):
    text = "noise\n### Title\n\n| a | b |\n|---|---|\n| 1 | 2 |\nCHECK PASS: speedup: 3.1\ntarget: x (>= 1): NOT met\n"
    text += "[run_all] exit 0, 12 s wall\n"
    blocks, targets, footer = run_all.extract(text)
    assert blocks == ["### Title\n\n| a | b |\n|---|---|\n| 1 | 2 |"]
    assert targets == ["CHECK PASS: speedup: 3.1", "target: x (>= 1): NOT met"]
    assert footer == "exit 0, 12 s wall"


def test_main_runs_the_selected_entries_keeps_logs_and_writes_the_report(run_all, tmp_path, capsys):
    report = tmp_path / "benchmarks.md"
    code = run_all.main(["--only", "good", "broken", "--out", str(report)])
    assert code == 1, "a failing entry makes the whole run fail"
    assert "failed: broken" in capsys.readouterr().out
    assert (run_all.LOGS / "good.log").is_file() and not (run_all.LOGS / "good.log.tmp").exists()
    text = report.read_text()
    assert "## A good benchmark" in text and "| ours | 51.0 |" in text
    assert "![A good benchmark](figures/good.png)" in text and text.count("![") == 1  # only the entry with a figure
    assert "- target: ours - theirs = +2.0 points (>= +1.0): met" in text
    assert "| good | target: step time 1.3x (<= 1.15x): NOT met |" in text  # the summary table
    assert "Run: exit 3" in text  # the failing entry's exit status is in its section
    missing = text.split("## Never run", 1)[1]
    assert "Not run yet." in missing
    # --reuse keeps the existing logs; --report-only rebuilds the report without running anything
    before = (run_all.LOGS / "good.log").stat().st_mtime_ns
    assert run_all.main(["--only", "good", "--reuse", "--out", str(report)]) == 0
    assert (run_all.LOGS / "good.log").stat().st_mtime_ns == before
    assert run_all.main(["--report-only", "--out", str(report)]) == 0


def test_mora_benchmark_prints_its_targets_verdicts():
    spec = importlib.util.spec_from_file_location("mora_bench", ROOT / "benchmarks" / "mora_missing_modality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [
        {"rate": 0.7, "kind": "both", "method": "mora", "acc": 0.70},
        {"rate": 0.7, "kind": "both", "method": "lora", "acc": 0.75},
        {"rate": 0.7, "kind": "text", "method": "mora", "acc": 0.80},
        {"rate": 0.7, "kind": "text", "method": "lora", "acc": 0.60},
        {"rate": 0.0, "kind": "both", "method": "mora", "acc": 0.10},
    ]
    lines = module.targets(rows, {"mora": 9.0, "prompts": 10.0})
    assert lines == [
        "target: rate 0.7 both: MoRA accuracy 70.0 vs best other (lora) 75.0 (MoRA best): NOT met",
        "target: rate 0.7 text: MoRA accuracy 80.0 vs best other (lora) 60.0 (MoRA best): met",
        "target: MoRA inference time / prompt baseline = 0.90x (<= 1.00x): met",
    ]
