"""``torchrun --nproc_per_node 2 -m peft_ext run CONFIG`` (gloo, CPU): the job trains every method data-parallel and
ends with the report of one process on the same config, within rounding; rank 0 alone prints and writes; a resume
on another number of processes is refused.

Tolerance: two processes average the gradients of two half-batch means where one process takes the mean of the whole
batch, so the sums round differently (about 1e-7 relative per step) and the differences grow a little over the
steps. Each accuracy may therefore move by at most one test example (an example on the decision boundary can flip),
and each task's mean training loss by 1e-6 relative (measured: at most 5e-8, and the same accuracies). The batch
size is even, so the halves are equal. The backbone has no dropout: with dropout, each process draws its own masks
and the runs are not comparable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peft_ext.cli import main

from .helpers import ROOT, job_config, launcher, run_launcher, save_tiny_bert

METHODS = ["seq_lora", "splitlora"]
LOSS_RTOL = 1e-6


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    path = save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=1, seed=0)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _cfg(tmp_path: Path, backbone: Path) -> Path:
    def edit(data: dict) -> None:
        data["model"].update(backbone=str(backbone), dropout=0.0)
        data["data"].update(n_tasks=2, classes_per_task=2, train_per_class=8, test_per_class=4)
        data["train"].update(epochs=1, batch_size=4)  # even: two equal halves
        data["methods"] = [m for m in data["methods"] if m["name"] in METHODS]
        for m in data["methods"]:
            m["adapter"]["r"] = 2

    return job_config(tmp_path, "quickstart", edit)


def _torchrun(*args: str, ok: bool = True, timeout: float = 120) -> tuple[str, str]:
    """``torchrun --standalone --nproc_per_node=2 ARGS`` (:func:`~tests.helpers.run_launcher`): stdout, stderr."""
    torchrun = launcher("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python (it ships with torch)")
    return run_launcher([torchrun, "--standalone", "--nproc_per_node=2", *args], timeout=timeout, ok=ok)


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def _report(out: Path) -> list[dict]:
    """The results without timings (the only part an interruption may change)."""
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in _results(out)["results"]]


@pytest.fixture(scope="module")
def two(tmp_path_factory, backbone):
    """The job on 2 processes: its config, output dir and stdout."""
    folder = tmp_path_factory.mktemp("two")
    cfg = _cfg(folder, backbone)
    stdout, _ = _torchrun("-m", "peft_ext", "run", str(cfg), "--no-progress")
    return cfg, folder / "out", stdout


@pytest.mark.distributed
def test_two_processes_match_one_and_only_rank_zero_prints_and_writes(tmp_path, backbone, two, capsys):
    _, out, stdout = two
    for label in METHODS:
        assert stdout.count(f"[peft-ext] method {label}\n") == 1, stdout
    assert stdout.count("[peft-ext] wrote ") == 1
    assert sorted(p.name for p in out.iterdir()) == ["accuracy_matrix.png", "results.json", "results.md"]

    assert main(["run", str(_cfg(tmp_path, backbone)), "--no-progress"]) == 0
    one, two_ = _results(tmp_path / "out"), _results(out)
    assert (one["meta"]["world_size"], two_["meta"]["world_size"]) == (1, 2)
    assert [r["label"] for r in two_["results"]] == METHODS and not two_.get("failed")
    one_example = 1 / (2 * 4)  # classes_per_task * test_per_class
    for a, b in zip(one["results"], two_["results"]):
        for row_a, row_b in zip(a["accuracy_matrix"], b["accuracy_matrix"]):
            for x, y in zip(row_a, row_b):
                assert (x is None) == (y is None) and (x is None or abs(x - y) <= one_example + 1e-9), (a, b)
        for x, y in zip(a["task_losses"], b["task_losses"]):
            assert abs(x - y) <= LOSS_RTOL * abs(x), (a["label"], a["task_losses"], b["task_losses"])


@pytest.mark.distributed
def test_resume_on_another_number_of_processes_is_refused(two, capsys):
    cfg, out, _ = two
    before = (out / "results.json").read_text()
    assert main(["run", str(cfg), "--no-progress", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "was made on 2 process(es), this one has 1" in err and "--nproc_per_node 2" in err
    assert (out / "results.json").read_text() == before


@pytest.mark.distributed
def test_two_processes_resume_mid_method_like_an_uninterrupted_run(tmp_path, backbone, two):
    """Rank 0 stops right after SplitLoRA's first snapshot; resumed on 2 processes, the job ends with the report of
    the uninterrupted 2-process run (the model, method state and random generators of task 0 restored)."""
    cfg, out = _cfg(tmp_path, backbone), tmp_path / "out"
    worker = str(ROOT / "tests" / "job_interrupt_worker.py")
    _, stderr = _torchrun(worker, "splitlora", "1", "run", str(cfg), "--no-progress", ok=False)
    assert f"torchrun --nproc_per_node=2 -m peft_ext run {cfg} --resume" in stderr
    assert [r["label"] for r in _report(out)] == METHODS[:1]
    assert (out / "progress" / "01-splitlora" / "task-0.pt").is_file()

    stdout, _ = _torchrun("-m", "peft_ext", "run", str(cfg), "--no-progress", "--resume")
    assert stdout.count("[peft-ext] method seq_lora: finished in the run being resumed") == 1, stdout
    assert stdout.count("[peft-ext] method splitlora: resuming after 1 finished task(s)") == 1, stdout
    assert _report(out) == _report(two[1])
    assert not (out / "progress").exists()
