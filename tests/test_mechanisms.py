"""Each continual method's defining property, asserted where it acts, through the drivers users run.

The drivers are ``run_sequence`` (the runner's own loop), ``run_continual_with_trainer`` (transformers.Trainer) and
``peft-ext run`` (the job, interrupted after a task and continued with ``--resume``). Nothing here calls a method's
hooks itself: :func:`observe` wraps them at class level, so the driver calls them in its own order and the wrappers
only look (before or after the real hook) and record. A unit test that calls ``before_task`` twice in a row once
stayed green while the engine, which folds the adapter in ``between_tasks`` first, had dropped O-LoRA's penalty.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainingArguments

from peft_ext.cli import main
from peft_ext.continual import TrainConfig, get_continual_method, run_sequence
from peft_ext.integrations import run_continual_with_trainer

from .helpers import (
    QUERY_VALUE,
    job_config,
    lora_adapter,
    pclr_adapter,
    save_tiny_bert,
    stack_collate,
    tiny_classifier,
    token_sequence,
)
from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

R = 2  # adapter rank everywhere: the tiny models are 32 wide
T = 3  # tasks

OPTIONS: dict[str, dict[str, Any]] = {
    "frozen_linear": {"lr": 1e-2},
    "seq_lora": {"lr": 1e-2, "adapter": lora_adapter(R)},
    "joint": {"lr": 1e-2, "adapter": lora_adapter(R)},
    "olora": {"lr": 1e-2, "lambda_orth": 0.5, "adapter": lora_adapter(R)},
    "inflora": {"lr": 1e-2, "r": R, "target_modules": QUERY_VALUE},
    "osf": {"lr": 1e-2, "target_modules": QUERY_VALUE},
    "splitlora": {"lr": 1e-2, "adapter": {"r": R, "trade_off": 5.0, "target_modules": QUERY_VALUE}},
    "pclr": {"lr": 5e-3, "adapter": pclr_adapter(pool_size=6, ranks_schedule=[3], compress_schedule=[0.0, 0.5])},
}
POOL_SIZE, NEW_RANKS = 6, 3


# --- observing a method's hooks as the driver calls them ----------------------------------------------------------


def observe(monkeypatch, cls: type, hook: str, before: Callable | None = None, after: Callable | None = None) -> None:
    """Wrap ``cls.hook``: ``before(self, *args)`` runs before the real hook, ``after(self, out, *args)`` after it."""
    original = getattr(cls, hook)

    def wrapped(self, *args):
        if before is not None:
            before(self, *args)
        out = original(self, *args)
        if after is not None:
            after(self, out, *args)
        return out

    monkeypatch.setattr(cls, hook, wrapped)


def unwrap(model):
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def layers_of(model, kind: type) -> dict[str, Any]:
    return {n: m for n, m in unwrap(model).named_modules() if isinstance(m, kind)}


def backbone_weights(model) -> dict[str, torch.Tensor]:
    """The encoder's own weights (the base layers' weights, not any adapter's), cloned."""
    return {
        n: p.detach().clone()
        for n, p in unwrap(model).named_parameters()
        if n.startswith("encoder.") and "lora_" not in n and "classifier" not in n
    }


# --- the drivers --------------------------------------------------------------------------------------------------


def targs(out: Path) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        num_train_epochs=2,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1000,
        seed=0,
        dataloader_num_workers=0,
    )


@pytest.fixture(scope="module")
def seq():
    return token_sequence(n_tasks=T)


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=2, seed=0)


def drive(driver: str, name: str, seq, tmp_path: Path, backbone: Path | None = None, monkeypatch=None) -> dict:
    """Run method ``name`` through ``driver``; returns its result as a dict (``accuracy_matrix``, ``extras``, ...).

    ``job``: ``peft-ext run`` on WordNet with the tiny backbone, interrupted right after task 1's snapshot and
    continued with ``--resume`` (the observers see both processes' worth of hooks, the resumed one from task 2 on).
    """
    if driver == "loop":
        method = get_continual_method(name)(**OPTIONS[name])
        config = TrainConfig(epochs=2, batch_size=8, progress=False, device="cpu")
        return run_sequence(seq, method, tiny_classifier(seq.num_classes), stack_collate, config).to_dict()
    if driver == "trainer":
        method = get_continual_method(name)(**OPTIONS[name])
        base = tiny_classifier(seq.num_classes)
        result, _ = run_continual_with_trainer(seq, method, base, stack_collate, targs(tmp_path / "trainer"))
        return result.to_dict()
    assert driver == "job"

    def edit(data: dict) -> None:
        data["model"]["backbone"] = str(backbone)
        data["data"].update(n_tasks=T, classes_per_task=2, train_per_class=8, test_per_class=4)
        data["train"].update(epochs=2, batch_size=4)
        data["methods"] = [{"name": name, **OPTIONS[name]}]

    cfg = job_config(tmp_path, "quickstart", edit)
    from peft_ext.continual.progress import TaskProgress

    original = TaskProgress.save

    def save_then_stop(self, model, method_state, record):
        original(self, model, method_state, record)
        if record.completed == 2:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(TaskProgress, "save", save_then_stop)
        assert main(["run", str(cfg), "--no-progress"]) == 130
    assert main(["run", str(cfg), "--no-progress", "--resume"]) == 0
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    return row


DRIVERS = ["loop", "trainer", "job"]


def run_driver(driver, name, seq, tmp_path, tiny_backbone, monkeypatch) -> dict:
    return drive(driver, name, seq, tmp_path, tiny_backbone if driver == "job" else None, monkeypatch)


# --- O-LoRA -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_olora_penalizes_overlap_with_every_earlier_task_A(driver, seq, tmp_path, tiny_backbone, monkeypatch):
    """From task 1 on the loss carries ``lambda * sum_{i<t} |A_i A_t^T|``, over every earlier task's trained ``A``;
    the report counts the rows covered. With the penalty lost the first assertion on task 1 fails."""
    from peft.tuners.lora import LoraLayer

    from peft_ext.continual.methods_splitlora import OLoRAMethod

    trained: dict[int, dict[str, torch.Tensor]] = {}  # task -> layer -> A at the end of the task
    penalties: dict[int, list] = defaultdict(list)  # task -> (loss term, recomputed from `trained`) per step

    def record_trained(self, model, task_id, task, ctx):
        layers = layers_of(model, LoraLayer)
        trained[task_id] = {n: m.lora_A["default"].weight.detach().clone() for n, m in layers.items()}

    def record_penalty(self, out, model, batch, task_id):
        earlier = [trained[i] for i in range(task_id) if i in trained]
        expected = None
        if len(earlier) == task_id and task_id > 0:  # every earlier A observed in this process
            expected = sum(
                0.5 * (torch.cat([e[n] for e in earlier]) @ m.lora_A["default"].weight.T).abs().sum()
                for n, m in layers_of(model, LoraLayer).items()
            )
        penalties[task_id].append((out, expected))

    observe(monkeypatch, OLoRAMethod, "after_task", before=record_trained)
    observe(monkeypatch, OLoRAMethod, "extra_loss", after=record_penalty)
    result = run_driver(driver, "olora", seq, tmp_path, tiny_backbone, monkeypatch)

    assert all(out is None for out, _ in penalties[0]), "task 0 has nothing to be orthogonal to"
    for task_id in range(1, T):
        assert penalties[task_id], f"no training step of task {task_id} was seen"
        for out, expected in penalties[task_id]:
            assert out is not None and float(out.detach()) > 0, f"task {task_id} trains without the penalty"
            if expected is not None:
                torch.testing.assert_close(out, expected)
    n_layers = 2 * len(QUERY_VALUE)
    assert result["extras"]["old_A_rows"] == [t * R * n_layers for t in range(T)]
    overlap = result["extras"]["orth_overlap"]
    assert overlap[0] == 0.0 and all(v > 0 for v in overlap[1:])


def test_olora_penalty_keeps_new_A_nearly_orthogonal_to_old_ones(seq):
    """The penalty acts: with ``lambda_orth`` large the trained ``A`` overlap earlier ones far less than at 0."""

    def overlap(lambda_orth: float) -> list[float]:
        method = get_continual_method("olora")(lr=1e-2, lambda_orth=lambda_orth, adapter=lora_adapter(R))
        config = TrainConfig(epochs=2, batch_size=8, progress=False, device="cpu")
        result = run_sequence(seq, method, tiny_classifier(seq.num_classes), stack_collate, config)
        return result.extras["orth_overlap"]

    free, penalized = overlap(0.0), overlap(5.0)
    for task_id in range(1, T):
        assert penalized[task_id] < 0.5 * free[task_id], (free, penalized)
