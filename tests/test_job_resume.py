"""`peft-ext run --resume`: a job interrupted by a real SIGINT keeps the methods it finished, prints the command that
resumes it, and the resumed job ends with the report of an uninterrupted run; a different config is refused."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peft_ext.cli import main

from .helpers import job_config, save_tiny_bert

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["frozen_linear", "seq_lora"]


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=1, seed=0)


def _cfg(tmp_path, backbone):
    def edit(data: dict) -> None:
        data["model"]["backbone"] = str(backbone)
        data["data"].update(n_tasks=2, classes_per_task=2, train_per_class=16, test_per_class=4)
        data["train"].update(epochs=1, batch_size=4)
        data["methods"] = [m for m in data["methods"] if m["name"] in METHODS]
        for m in data["methods"]:
            if "adapter" in m:
                m["adapter"]["r"] = 2

    return job_config(tmp_path, "quickstart", edit)


def _report(out: Path) -> list[dict]:
    """The results without timings (the only part an interruption may change)."""
    results = json.loads((out / "results.json").read_text())["results"]
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in results]


def test_sigint_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_backbone, capsys):
    first = tmp_path / "interrupted"
    first.mkdir()
    cfg = _cfg(first, tiny_backbone)
    out = first / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "peft_ext", "run", str(cfg), "--no-progress"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in proc.stdout:  # the first method finished and was written once the second one starts
        seen.append(line)
        if line.startswith(f"[peft-ext] method {METHODS[1]}"):
            break
    assert (out / "results.json").exists(), (seen, proc.communicate())
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr
    assert f"peft-ext run {cfg} --resume" in stderr
    kept = [r["method"] for r in _report(out)]
    assert kept == METHODS[:1]

    assert main(["run", str(cfg), "--no-progress", "--resume"]) == 0
    assert "finished in the run being resumed" in capsys.readouterr().out

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert main(["run", str(_cfg(fresh, tiny_backbone)), "--no-progress"]) == 0
    assert [r["method"] for r in _report(out)] == METHODS
    assert _report(out) == _report(fresh / "out")

    # The same folder with a changed config: refused, nothing overwritten.
    before = (out / "results.json").read_text()
    assert main(["run", str(cfg), "--no-progress", "--resume", "--set", "train.seed=1"]) == 2
    assert "were made with a different config" in capsys.readouterr().err
    assert (out / "results.json").read_text() == before


def test_resume_with_nothing_to_resume(tmp_path, tiny_backbone, capsys):
    cfg = _cfg(tmp_path, tiny_backbone)
    assert main(["run", str(cfg), "--no-progress", "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
