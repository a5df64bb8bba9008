"""docs/adding_a_continual_method.md, proven: the page's blocks, run as written, make a method that trains through
the drivers users run (``run_sequence`` and ``peft-ext run``, interrupted and resumed), learns every task, keeps its
state across a resume, and whose mechanism (the anchor penalty) holds the adapter closer to the previous task than
sequential LoRA does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from peft_ext.continual import CONTINUAL_METHODS, TrainConfig, run_sequence
from peft_ext.continual.progress import TaskProgress
from peft_ext_cli import main

from .helpers import QUERY_VALUE, ROOT, job_config, save_tiny_bert, stack_collate, tiny_classifier, token_sequence
from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

PAGE = ROOT / "docs" / "adding_a_continual_method.md"
BLOCK = re.compile(r"(<!-- not run: [^>]*-->\s*\n)?```python\n(.*?)\n```", re.S)
ADAPTER = {"r": 4, "lora_alpha": 16.0, "target_modules": list(QUERY_VALUE)}
#: 3 tasks of 2 classes: chance on a task's test set is 50 %, on the final row's 3-task union 1/6
TASKS = 3


@pytest.fixture
def guide():
    """The page's runnable blocks executed in order in one namespace; the method they register is removed after."""
    namespace: dict = {}
    for skipped, code in BLOCK.findall(PAGE.read_text()):
        if not skipped:
            exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102
    yield namespace
    CONTINUAL_METHODS.pop("anchored_lora", None)


def _run(method_cls, strength: float | None = None):
    seq = token_sequence(n_tasks=TASKS)
    options = {"lr": 5e-3, "adapter": ADAPTER}
    method = method_cls(**options) if strength is None else method_cls(**options, strength=strength)
    anchors: list[dict[str, torch.Tensor]] = []
    drift: list[float] = []
    original = method.after_task

    def after_task(model, task_id, task, ctx):
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        if anchors:  # how far the adapter moved during this task, from where the previous one left it
            drift.append(sum(float((lora[n] - anchors[-1][n]).square().sum()) for n in lora))
        anchors.append(lora)
        return original(model, task_id, task, ctx)

    method.after_task = after_task
    train = TrainConfig(epochs=8, batch_size=8, progress=False, device="cpu")
    result = run_sequence(seq, method, tiny_classifier(seq.num_classes), stack_collate, train)
    return result, drift, method


def test_the_guide_method_learns_every_task_and_its_anchor_holds_the_adapter(guide):
    from peft_ext.continual.methods.seq_lora import SequentialLoRA

    anchored, held, method = _run(guide["AnchoredLoRA"], strength=0.1)
    plain, free, _ = _run(SequentialLoRA)
    assert CONTINUAL_METHODS["anchored_lora"] is guide["AnchoredLoRA"]
    # learns: the first two tasks right after training them, far above the 1/2 and 1/4 chance of their rows
    assert min(anchored.accuracy_matrix[i][i] for i in range(2)) > 0.8
    # and keeps them: the final accuracy over the 6 classes is far above chance (1/6) and above sequential LoRA's
    assert anchored.metrics["final_acc"] > 1 / 6 + 0.3
    assert anchored.metrics["final_acc"] > plain.metrics["final_acc"] + 0.1
    # the mechanism: the penalty keeps each later task's adapter closer to the previous task's than plain LoRA's
    assert all(h < 0.5 * f for h, f in zip(held, free)), (held, free)
    # its state: the anchor after the last task, tensors a snapshot holds and torch.load(weights_only=True) reads
    assert anchored.extras["anchored_tensors"] == len(method.state["anchor"]) > 0
    saved = method.state_dict()
    loaded = torch.load(_round_trip(saved), weights_only=True)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded["anchor"][k], v) for k, v in saved["anchor"].items())


def _round_trip(state: dict) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "state.pt"
    torch.save(state, path)
    return path


def test_options_are_checked_when_the_method_is_made(guide):
    with pytest.raises(ValueError, match=r"`strength` must be >= 0, got -1"):
        guide["AnchoredLoRA"](strength=-1)
    with pytest.raises(ValueError, match=r"unknown continual method 'anchored_lorra'; did you mean 'anchored_lora'"):
        from peft_ext.continual import get_continual_method

        get_continual_method("anchored_lorra")


def test_the_guide_method_runs_in_the_job_and_resumes_exactly(guide, tmp_path, monkeypatch):
    """``peft-ext run`` with the method named in the config, interrupted after task 1's snapshot and resumed: the
    result equals an uninterrupted run's (the anchor comes back from the snapshot: without it task 2 would train
    unpenalized and its accuracies would differ)."""
    backbone = save_tiny_bert(tmp_path / "bert", num_layers=2, seed=0)

    def edit(data: dict) -> None:
        data["model"]["backbone"] = str(backbone)
        data["data"].update(n_tasks=TASKS, classes_per_task=2, train_per_class=8, test_per_class=4)
        data["train"].update(epochs=2, batch_size=4)
        data["methods"] = [{"name": "anchored_lora", "lr": 1e-2, "strength": 0.1, "adapter": ADAPTER}]

    rows = []
    for run, interrupt in (("whole", False), ("resumed", True)):
        (tmp_path / run).mkdir()
        cfg = job_config(tmp_path / run, "quickstart", edit)
        if interrupt:
            original = TaskProgress.save

            def save_then_stop(self, model, state, record, _original=original):
                _original(self, model, state, record)
                if record.completed == 2:
                    raise KeyboardInterrupt

            with monkeypatch.context() as patch:
                patch.setattr(TaskProgress, "save", save_then_stop)
                assert main(["run", str(cfg), "--no-progress"]) == 130
            assert main(["run", str(cfg), "--no-progress", "--resume"]) == 0
        else:
            assert main(["run", str(cfg), "--no-progress"]) == 0
        (row,) = json.loads((tmp_path / run / "out" / "results.json").read_text())["results"]
        rows.append(row)
    whole, resumed = rows
    assert resumed["accuracy_matrix"] == whole["accuracy_matrix"]
    assert resumed["task_losses"] == pytest.approx(whole["task_losses"], rel=1e-6)
    assert whole["extras"]["anchored_tensors"] > 0
    assert (tmp_path / "whole" / "out" / "adapters" / "anchored_lora").is_dir()
