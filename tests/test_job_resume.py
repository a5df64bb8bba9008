"""`peft-ext run --resume`: a job interrupted by a real SIGINT keeps the methods it finished, prints the command that
resumes it, and the resumed job ends with the report of an uninterrupted run; a different config is refused."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peft_ext_cli import main

from .helpers import job_config, offline_env, save_tiny_bert

METHODS = ["frozen_linear", "seq_lora"]
SIGINT_TRAIN = 160  # training examples per class of the interrupted job


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=1, seed=0)


def _cfg(tmp_path, backbone, methods=METHODS, n_tasks: int = 2, train_per_class: int = 16):
    """configs/quickstart.yaml on ``backbone`` with only ``methods``, each at rank 2 (PCLR: a pool of 8 at rank 2, top
    2), over ``n_tasks`` tasks of 2 classes for one epoch; written by :func:`job_config`."""

    def edit(data: dict) -> None:
        data["model"]["backbone"] = str(backbone)
        data["data"].update(n_tasks=n_tasks, classes_per_task=2, train_per_class=train_per_class, test_per_class=4)
        data["train"].update(epochs=1, batch_size=4)
        data["methods"] = [m for m in data["methods"] if m["name"] in methods]
        for m in data["methods"]:
            if m["name"] == "pclr":
                m["adapter"].update(pool_size=8, ranks_schedule=[2], top_k=2)
            elif "adapter" in m:
                m["adapter"]["r"] = 2

    return job_config(tmp_path, "quickstart", edit)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _report(out: Path) -> list[dict]:
    """The results without timings (the only part an interruption may change)."""
    results = json.loads((out / "results.json").read_text())["results"]
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in results]


@pytest.mark.slow
def test_sigint_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_backbone, capsys):
    first = tmp_path / "interrupted"
    first.mkdir()
    # enough training that the second method is still running when the signal lands, on a loaded machine too (at 16
    # examples per class it could finish before the parent had read its first line and sent SIGINT)
    cfg = _cfg(first, tiny_backbone, train_per_class=SIGINT_TRAIN)
    out = first / "out"
    env = {**offline_env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "peft_ext", "run", str(cfg), "--no-progress"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C's default action in the child, whatever this process inherited: a shell without job control starts
        # background jobs (e.g. `make test &`) with SIGINT ignored, and Python then installs no KeyboardInterrupt
        preexec_fn=_default_sigint,
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
    assert main(["run", str(_cfg(fresh, tiny_backbone, train_per_class=SIGINT_TRAIN)), "--no-progress"]) == 0
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


MID = ["seq_lora", "inflora", "splitlora", "pclr"]  # the order of configs/quickstart.yaml


def _mid_cfg(tmp_path, backbone):
    return _cfg(tmp_path, backbone, MID, n_tasks=3, train_per_class=8)


def _interrupt_after(monkeypatch, label: str, completed: int) -> None:
    """Ctrl-C right after the snapshot of ``label``'s task ``completed - 1`` is written."""
    from peft_ext.continual.progress import TaskProgress

    original = TaskProgress.save

    def save(self, model, method_state, record):
        original(self, model, method_state, record)
        if self.identity["label"] == label and record.completed == completed:
            raise KeyboardInterrupt

    monkeypatch.setattr(TaskProgress, "save", save)


@pytest.mark.slow
def test_resume_continues_an_interrupted_method_after_its_last_finished_task(
    tmp_path, tiny_backbone, capsys, monkeypatch
):
    """Two interruptions mid-method (InfLoRA, which re-wraps per task, after task 1, then SplitLoRA after task 0):
    each resume restores the model, the method's state and the random generators of the last finished task and
    ends with the report of an uninterrupted run; the snapshots are gone once every method finished."""
    straight = tmp_path / "straight"
    straight.mkdir()
    assert main(["run", str(_mid_cfg(straight, tiny_backbone)), "--no-progress"]) == 0
    labels = [r["label"] for r in _report(straight / "out")]
    assert labels == MID

    run_dir = tmp_path / "interrupted"
    run_dir.mkdir()
    cfg, out = _mid_cfg(run_dir, tiny_backbone), run_dir / "out"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "inflora", 2)
        assert main(["run", str(cfg), "--no-progress"]) == 130
    assert f"peft-ext run {cfg} --resume" in capsys.readouterr().err
    assert [r["label"] for r in _report(out)] == MID[:1]
    state = json.loads((out / "progress" / "01-inflora" / "state.json").read_text())
    assert state["completed"] == 2 and state["accuracy_matrix"][2] == [None, None, None]
    assert [p.name for p in (out / "progress" / "01-inflora").glob("*.pt")] == ["task-1.pt"]  # only the latest

    with monkeypatch.context() as patch:
        _interrupt_after(patch, "splitlora", 1)
        assert main(["run", str(cfg), "--no-progress", "--resume"]) == 130
    assert "method inflora: resuming after 2 finished task(s)" in capsys.readouterr().out
    assert [r["label"] for r in _report(out)] == MID[:2]

    assert main(["run", str(cfg), "--no-progress", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "method splitlora: resuming after 1 finished task(s)" in printed
    assert "method seq_lora: finished in the run being resumed" in printed
    assert _report(out) == _report(straight / "out")
    assert not (out / "progress").exists()


def test_an_earlier_run_is_never_overwritten_by_accident(tmp_path, tiny_backbone, capsys):
    cfg = _cfg(tmp_path, tiny_backbone)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"an": "earlier run"}')
    assert main(["run", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run (results.json)" in err and "--resume" in err and "--overwrite" in err
    assert (out / "results.json").read_text() == '{"an": "earlier run"}'
    assert main(["run", str(cfg), "--no-progress", "--resume", "--overwrite"]) == 2
    assert "exclude each other" in capsys.readouterr().err

    assert main(["run", str(cfg), "--no-progress", "--overwrite"]) == 0
    (aside,) = out.glob("replaced-*")
    assert (aside / "results.json").read_text() == '{"an": "earlier run"}'
    assert [r["method"] for r in _report(out)] == METHODS
