"""The continual driver on transformers.Trainer: the method lifecycle, logging, and resume after an interruption at
any point (mid-task, after a task's training, between tasks) with the same accuracy matrix as one uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import WEIGHTS_NAME

from peft_ext.continual import get_continual_method
from peft_ext.integrations import ContinualTrainer, run_continual_with_trainer
from peft_ext.integrations.continual_trainer import STATE_FILE, last_complete_checkpoint, load_model_state

from .helpers import (
    QUERY_VALUE,
    TEST_HEAD_DIM,
    lora_adapter,
    pclr_adapter,
    run_module,
    stack_collate,
    tiny_classifier,
    token_sequence,
)
from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

METHODS = {
    "seq_lora": {"lr": 1e-2, "adapter": lora_adapter(4)},
    "splitlora": {"lr": 5e-3, "adapter": {"r": 2, "trade_off": 5.0, "target_modules": QUERY_VALUE}},
    "riemannion": {"lr": 0.05, "head_lr": 1e-2, "loi_batches": 2, "adapter": {"r": 4, "target_modules": QUERY_VALUE}},
    "pclr": {
        "lr": 5e-3,
        "adapter": pclr_adapter(pool_size=12, ranks_schedule=[4], compress_schedule=[0.0, 0.25], top_k=4),
    },
}


class Interrupt(Exception):
    """Stands for the process being killed."""


class KillAt(TrainerCallback):
    """Raises inside task ``task`` after global step ``step`` (``None``: when the task's training ends)."""

    def __init__(self, task: int, step: int | None) -> None:
        self.task, self.step = task, step

    def _here(self, args: TrainingArguments) -> bool:
        return Path(args.output_dir).name == f"task-{self.task}"

    def on_step_end(self, args, state, control, **kwargs):
        if self.step is not None and self._here(args) and state.global_step == self.step:
            raise Interrupt(f"killed at step {state.global_step} of task {self.task}")

    def on_train_end(self, args, state, control, **kwargs):
        if self.step is None and self._here(args):
            raise Interrupt(f"killed after training task {self.task}")


class Logs(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def targs(out: Path, **kw) -> TrainingArguments:
    base = {
        "output_dir": str(out),
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 64,
        "num_train_epochs": 2,
        "lr_scheduler_type": "constant",
        "save_strategy": "steps",
        "save_steps": 5,
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "logging_steps": 1000,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    return TrainingArguments(**{**base, **kw})


def run(seq, name: str, out: Path, callbacks=None, resume: bool = True):
    method = get_continual_method(name)(**METHODS[name])
    return run_continual_with_trainer(
        seq, method, tiny_classifier(seq.num_classes), stack_collate, targs(out), callbacks=callbacks, resume=resume
    )


@pytest.fixture(scope="module")
def seq():
    return token_sequence(n_tasks=3)


def test_learns_logs_and_matches_the_runner_protocol(seq, tmp_path):
    logs = Logs()
    result, model = run(seq, "seq_lora", tmp_path, callbacks=[logs])
    R = result.accuracy_matrix
    assert all(R[i][j] is not None for i in range(3) for j in range(i + 1)) and R[0][1] is None
    assert R[0][0] > 0.8 and R[1][1] > 0.8  # seq_lora forgets; run_sequence gives the same picture here
    merged = {k: v for entry in logs.logs for k, v in entry.items()}
    assert merged["continual/acc_2_0"] == R[2][0] and merged["continual/acc_1_1"] == R[1][1]
    assert merged["continual/final_acc"] == pytest.approx(result.metrics["final_acc"])
    assert set(result.metrics) == {"final_acc", "learning_acc", "avg_incremental_acc", "bwt", "forgetting"}
    saved = json.loads((tmp_path / STATE_FILE).read_text())
    assert saved["completed"] == 3 and saved["accuracy_matrix"] == R
    assert len(result.task_losses) == 3 and result.trainable_params < result.total_params
    # a checkpoint holds the whole model, in the file Trainer's resume reads
    checkpoint = Path(last_complete_checkpoint(tmp_path / "task-2"))
    snapshot = torch.load(tmp_path / "task-2" / "end-of-task.pt", weights_only=True)
    assert set(torch.load(checkpoint / WEIGHTS_NAME, weights_only=True)) == set(snapshot["model"])
    # a finished run resumes to the same result without training
    again, _ = run(seq, "seq_lora", tmp_path)
    assert again.accuracy_matrix == R
    with pytest.raises(ValueError, match="already holds a continual run"):
        run(seq, "seq_lora", tmp_path, resume=False)
    with pytest.raises(ValueError, match="belongs to another run"):
        run(seq, "splitlora", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "kill_task", "kill_step"),
    [
        ("seq_lora", 1, 8),  # mid-task, in the second epoch, three steps after checkpoint-5
        ("splitlora", 1, 8),
        ("riemannion", 2, 7),  # LOI init on task 0; the Riemannion optimizer's momentum comes from checkpoint-5
        ("splitlora", 1, None),  # after training, before after_task collects the statistics
        ("pclr", 2, 3),  # before the task's first checkpoint: the task restarts from its beginning
        ("pclr", 1, None),
    ],
)
def test_interrupted_run_resumes_to_the_same_accuracy_matrix(seq, tmp_path, name, kill_task, kill_step):
    straight, straight_model = run(seq, name, tmp_path / "straight")
    out = tmp_path / "killed"
    with pytest.raises(Interrupt):
        run(seq, name, out, callbacks=[KillAt(kill_task, kill_step)])
    assert json.loads((out / STATE_FILE).read_text())["completed"] == kill_task
    resumed, resumed_model = run(seq, name, out)
    assert resumed.accuracy_matrix == straight.accuracy_matrix
    assert resumed.extras == straight.extras
    for (key, a), b in zip(straight_model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), key


def test_the_driver_overrides_only_public_trainer_methods():
    """Trainer's private methods change between releases; the driver's Trainer overrides none of them."""
    overridden = {name for name in vars(ContinualTrainer) if callable(getattr(Trainer, name, None))}
    assert overridden == {"__init__", "compute_loss", "save_model"}


def test_load_model_state_explains_a_structure_change():
    model = tiny_classifier(4)
    state = {k: v for k, v in model.state_dict().items() if "classifier" not in k}
    with pytest.raises(ValueError, match="re-wraps the model per task"):
        load_model_state(model, state)
    bigger = dict(model.state_dict())
    bigger["classifier.weight"] = torch.zeros(5, 32)
    with pytest.raises(ValueError, match=r"parameter has shape \(4, 32\)"):
        load_model_state(model, bigger)


def test_joint_method_trains_once_and_fills_the_last_row(seq, tmp_path):
    method = get_continual_method("joint")(lr=1e-2, adapter=lora_adapter(4))
    result, _ = run_continual_with_trainer(
        seq, method, tiny_classifier(seq.num_classes), stack_collate, targs(tmp_path, num_train_epochs=1)
    )
    assert result.accuracy_matrix[0] == [None, None, None] and None not in result.accuracy_matrix[2]
    assert result.metrics["bwt"] is None and len(result.task_losses) == 1
    assert (tmp_path / "task-0").is_dir() and not (tmp_path / "task-1").exists()


@pytest.mark.slow
def test_a_half_written_checkpoint_is_skipped(seq, tmp_path):
    """A kill while Trainer saves leaves a checkpoint folder without trainer_state.json (written last)."""
    straight, _ = run(seq, "splitlora", tmp_path / "straight")
    out = tmp_path / "killed"
    with pytest.raises(Interrupt):
        run(seq, "splitlora", out, callbacks=[KillAt(1, 11)])
    (out / "task-1" / "checkpoint-10" / "trainer_state.json").unlink()
    assert last_complete_checkpoint(out / "task-1") == str(out / "task-1" / "checkpoint-5")
    assert last_complete_checkpoint(out / "task-9") is None
    resumed, _ = run(seq, "splitlora", out)
    assert resumed.accuracy_matrix == straight.accuracy_matrix
    with pytest.raises(ValueError, match="save_only_model"):
        run_continual_with_trainer(
            seq,
            get_continual_method("seq_lora")(adapter=lora_adapter(8)),
            tiny_classifier(seq.num_classes),
            stack_collate,
            targs(tmp_path / "x", save_only_model=True),
        )


@pytest.mark.slow
def test_a_rewrapping_method_resumes_to_the_same_accuracy_matrix(seq, tmp_path):
    """InfLoRA re-wraps the model per task; it folds its adapter between tasks, so the snapshot after task 0 is a
    plain backbone that a fresh build loads."""
    base = tiny_classifier(seq.num_classes)

    def go(out, callbacks=None):
        method = get_continual_method("inflora")(lr=5e-3, r=2)
        return run_continual_with_trainer(seq, method, base, stack_collate, targs(out), callbacks=callbacks)

    straight, _ = go(tmp_path / "straight")
    with pytest.raises(Interrupt):
        go(tmp_path / "killed", callbacks=[KillAt(1, 3)])
    resumed, _ = go(tmp_path / "killed")
    assert resumed.accuracy_matrix == straight.accuracy_matrix


@pytest.mark.slow
def test_a_killed_process_resumes_to_the_same_accuracy_matrix(seq, tmp_path):
    """A real SIGKILL in a subprocess, mid-task (task 1, step 9: after checkpoint-5, with no cleanup of any kind)."""
    import signal

    out = tmp_path / "killed"
    proc = run_module("tests.workers.continual_kill", out, "splitlora", 1, 9, timeout=240, threads=1, ok=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert json.loads((out / STATE_FILE).read_text())["completed"] == 1
    resumed, _ = run(seq, "splitlora", out)
    straight, _ = run(seq, "splitlora", tmp_path / "straight")
    assert resumed.accuracy_matrix == straight.accuracy_matrix


def test_heads_in_the_trainer_driver_learn_and_resume_exactly(seq, tmp_path):
    """The Trainer driver takes a method's ``head`` and ``compare_heads`` as the runner does; a run killed after a
    task's training (before the heads read it) resumes to the same matrices and head statistics."""

    def heads_run(out, callbacks=None):
        method = get_continual_method("seq_lora")(
            lr=1e-2,
            adapter=lora_adapter(4),
            head={"name": "analytic", "dim": TEST_HEAD_DIM},  # a narrow projection: its eigh is the cost
            compare_heads=["prototype", "aligned"],
        )
        return run_continual_with_trainer(
            seq, method, tiny_classifier(seq.num_classes), stack_collate, targs(out), callbacks=callbacks
        )

    straight, _ = heads_run(tmp_path / "straight")
    assert straight.extras["head"]["name"] == "analytic"
    for name in ("prototype", "aligned"):
        final = straight.extras["heads"][name]["metrics"]["final_acc"]
        assert final > straight.metrics["final_acc"] - 0.3 and final > 1 / 6 + 0.2, name
    out = tmp_path / "killed"
    with pytest.raises(Interrupt):
        heads_run(out, callbacks=[KillAt(1, None)])
    resumed, _ = heads_run(out)
    assert resumed.accuracy_matrix == straight.accuracy_matrix
    assert resumed.extras["heads"] == straight.extras["heads"]
