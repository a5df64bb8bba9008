"""Each continual method's defining property, asserted where it acts, through the drivers users run.

The drivers are ``run_sequence`` (the runner's own loop), ``run_continual_with_trainer`` (transformers.Trainer, killed
mid-task and resumed from its checkpoint) and ``peft-ext run`` (the job, interrupted after a task's snapshot and
continued with ``--resume``): the mechanisms must hold across the snapshot and resume paths too. Nothing here calls a
method's hooks itself: :func:`observe` wraps them at class level, so the driver calls them in its own order and the
wrappers only look (before or after the real hook) and record. A unit test that calls ``before_task`` twice in a row
once stayed green while the engine, which folds the adapter in ``between_tasks`` first, had dropped O-LoRA's penalty.
"""

from __future__ import annotations

import json
import types
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from peft_ext.continual import TrainConfig, get_continual_method, run_sequence
from peft_ext.integrations import run_continual_with_trainer
from peft_ext_cli import main

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
from .test_continual_trainer import Interrupt, KillAt, targs

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
    "pclr": {
        "lr": 5e-3,
        "adapter": pclr_adapter(pool_size=6, ranks_schedule=[3], compress_schedule=[0.0, 0.5], top_k=3),
    },
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


def trainer_run(name: str, seq, tmp_path: Path) -> tuple:
    """The arguments of ``run_continual_with_trainer`` for method ``name`` (a fresh method object each call)."""
    method = get_continual_method(name)(**OPTIONS[name])
    return seq, method, tiny_classifier(seq.num_classes), stack_collate, targs(tmp_path / "trainer", save_steps=2)


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
        # killed mid-task (task 1, or the joint phase, at step 3: after checkpoint-2) and resumed from there
        stop = KillAt(0 if get_continual_method(name).trains_on_union else 1, 3)
        with pytest.raises(Interrupt):
            run_continual_with_trainer(*trainer_run(name, seq, tmp_path), callbacks=[stop])
        result, _ = run_continual_with_trainer(*trainer_run(name, seq, tmp_path))
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

    if get_continual_method(name).trains_on_union:  # one phase: nothing to interrupt between tasks
        assert main(["run", str(cfg), "--no-progress"]) == 0
    else:
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

    from peft_ext.continual.methods.olora import OLoRAMethod

    trained: dict[int, dict[str, torch.Tensor]] = {}  # task -> layer -> A at the end of the task
    penalties: dict[int, list] = defaultdict(list)  # task -> (loss term, recomputed from `trained`) per step

    def record_trained(self, model, task_id, task, ctx):
        layers = layers_of(model, LoraLayer)
        trained[task_id] = {n: m.lora_A["default"].weight.detach().clone() for n, m in layers.items()}

    def record_penalty(self, out, model, batch, task_id, ctx):
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


# --- InfLoRA-style --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_inflora_new_A_is_orthogonal_to_its_memory_and_the_memory_grows(
    driver, seq, tmp_path, tiny_backbone, monkeypatch
):
    """Each task's frozen ``A`` (set in ``before_task``) has rows orthogonal to the GPM memory of the earlier tasks'
    input directions, stays fixed while ``B`` trains, and the memory grows after every task."""
    from peft.tuners.lora import LoraLayer

    from peft_ext.continual.methods.inflora import InfLoRAMethod

    started: dict[int, dict[str, torch.Tensor]] = {}
    residual: dict[int, float] = {}
    memory_after: dict[int, dict[str, int]] = {}

    def check_new_A(self, model, model_in, task_id, task, ctx):
        memory = self.state.get("inflora_memory", {})
        layers = layers_of(model, LoraLayer)
        started[task_id] = {n: m.lora_A["default"].weight.detach().clone() for n, m in layers.items()}
        assert all(not m.lora_A["default"].weight.requires_grad for m in layers.values()), "A must be frozen"
        if task_id > 0:
            assert set(memory) == set(layers), "every adapted layer has a memory after task 0"
            residual[task_id] = max(
                float((a.double() @ memory[n]).norm() / a.double().norm()) for n, a in started[task_id].items()
            )

    def check_trained(self, model, task_id, task, ctx):
        for n, m in layers_of(model, LoraLayer).items():
            assert torch.equal(m.lora_A["default"].weight, started[task_id][n]), f"A of {n} moved during training"

    def record_memory(self, out, model, task_id, task, ctx):
        memory_after[task_id] = {n: m.shape[1] for n, m in self.state["inflora_memory"].items()}

    observe(monkeypatch, InfLoRAMethod, "before_task", after=check_new_A)
    observe(monkeypatch, InfLoRAMethod, "after_task", before=check_trained, after=record_memory)
    run_driver(driver, "inflora", seq, tmp_path, tiny_backbone, monkeypatch)

    observed = sorted(residual)
    assert observed and observed[-1] == T - 1
    assert all(residual[t] < 1e-6 for t in observed), residual
    tasks = sorted(memory_after)
    for earlier, later in zip(tasks, tasks[1:]):
        for n, columns in memory_after[later].items():
            assert columns >= memory_after[earlier][n]
    assert all(c >= 1 for c in memory_after[tasks[0]].values())
    assert sum(memory_after[tasks[-1]].values()) > sum(memory_after[tasks[0]].values()), "the memory never grew"


# --- OSF -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_osf_update_stays_out_of_the_preserved_subspace_which_grows(driver, seq, tmp_path, tiny_backbone, monkeypatch):
    """Each task's update ``dW`` lies (nearly) outside the preserved top singular block of the weight it started
    from: ``|U_k^T dW V_k| / |dW|`` is small, where an unconstrained update puts about ``(k/n)^2`` of its norm there
    (a quarter at half the directions). Not exactly zero: PEFT's OSF projects the gradients, and AdamW's per-coordinate
    scaling of the projected gradient leaks a few percent into the block (measured 1-3 % here). The preserved rank
    grows over the sequence."""
    from peft.tuners.osf.layer import OSFLayer

    from peft_ext.continual.methods.osf import OSFMethod

    blocks: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    ranks: dict[int, int] = {}
    leaks: dict[int, float] = {}

    def record_block(self, model, model_in, task_id, task, ctx):
        blocks[task_id] = {}
        for n, m in layers_of(model, OSFLayer).items():
            k = m.effective_rank["default"]
            u, _, vh = torch.linalg.svd(m.get_base_layer().weight.detach().double())
            blocks[task_id][n] = (u[:, :k], vh[:k])
            ranks[task_id] = k

    def measure_leak(self, model, task_id, task, ctx):
        shares = []
        for n, m in layers_of(model, OSFLayer).items():
            u, vh = blocks[task_id][n]
            delta = m.get_delta_weight("default").detach().double()
            assert float(delta.norm()) > 0, f"{n} did not train"
            shares.append(float((u.T @ delta @ vh.T).norm() / delta.norm()))
        leaks[task_id] = max(shares)

    observe(monkeypatch, OSFMethod, "before_task", after=record_block)
    observe(monkeypatch, OSFMethod, "after_task", before=measure_leak)
    run_driver(driver, "osf", seq, tmp_path, tiny_backbone, monkeypatch)

    assert sorted(leaks)[-1] == T - 1
    assert all(leak < 0.1 for leak in leaks.values()), leaks
    observed = sorted(ranks)
    assert all(ranks[a] < ranks[b] for a, b in zip(observed, observed[1:])), ranks


# --- SplitLoRA -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_splitlora_update_lies_in_the_minor_subspace_of_earlier_inputs(
    driver, seq, tmp_path, tiny_backbone, monkeypatch
):
    """From task 1 on, each module's trained update ``B A`` has its row space inside the minor subspace of the
    earlier tasks' input covariance: ``|B A V_p|`` is zero to rounding, with ``V_p`` the top ``primary`` eigenvectors
    computed here, independently, from the running covariance in float64."""
    from peft_ext.continual.methods.splitlora import SplitLoRAMethod
    from peft_ext.tuners.splitlora import SplitLoRALayer

    majors: dict[int, dict[str, torch.Tensor]] = {}
    leaks: dict[int, float] = {}

    def record_subspace(self, out, model, task_id, task, ctx):
        if task_id == 0:
            return
        majors[task_id] = {}
        for n, m in layers_of(model, SplitLoRALayer).items():
            primary = int(m.splitlora_primary["default"])
            assert 0 < primary < m.in_features
            _, vectors = torch.linalg.eigh(m.covariance("default").double())
            majors[task_id][n] = vectors[:, -primary:]  # eigh sorts ascending: the top ``primary``

    def measure_update(self, model, task_id, task, ctx):
        if task_id == 0:
            return
        shares = []
        for n, m in layers_of(model, SplitLoRALayer).items():
            delta = (m.splitlora_B["default"].detach() @ m.splitlora_A["default"]).double()
            assert float(delta.norm()) > 0, f"{n} did not train"
            shares.append(float((delta @ majors[task_id][n]).norm() / delta.norm()))
        leaks[task_id] = max(shares)

    observe(monkeypatch, SplitLoRAMethod, "before_task", after=record_subspace)
    observe(monkeypatch, SplitLoRAMethod, "after_task", before=measure_update)
    run_driver(driver, "splitlora", seq, tmp_path, tiny_backbone, monkeypatch)

    assert sorted(leaks)[-1] == T - 1
    assert all(leak < 1e-5 for leak in leaks.values()), leaks


# --- PCLR ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_pclr_adds_new_ranks_per_task_within_the_pool_cap(driver, seq, tmp_path, tiny_backbone, monkeypatch):
    """Every task trains its own ``NEW_RANKS`` new ranks while the finished tasks' ranks stay frozen (static), and
    the pool never holds more than ``pool_size`` ranks: after task 1 it is full and must compress."""
    from peft_ext.continual.methods.pclr import PCLRMethod
    from peft_ext.tuners.pclr import PCLRLayer

    counts: dict[int, list[tuple[int, int]]] = {}
    static: dict[int, dict[str, torch.Tensor]] = {}

    def record_start(self, out, model, task_id, task, ctx):
        layers = layers_of(model, PCLRLayer)
        counts[task_id] = [tuple(m.counts("default")[:2]) for m in layers.values()]
        static[task_id] = {n: m.pclr_A_static["default"].detach().clone() for n, m in layers.items()}

    def check_static_kept(self, model, task_id, task, ctx):
        for n, m in layers_of(model, PCLRLayer).items():
            assert torch.equal(m.pclr_A_static["default"], static[task_id][n]), f"{n}'s frozen ranks moved"

    observe(monkeypatch, PCLRMethod, "before_task", after=record_start)
    observe(monkeypatch, PCLRMethod, "after_task", before=check_static_kept)
    result = run_driver(driver, "pclr", seq, tmp_path, tiny_backbone, monkeypatch)

    assert sorted(counts)[-1] == T - 1
    for task_id, per_layer in counts.items():
        for n_static, n_new in per_layer:
            assert n_new == NEW_RANKS, (task_id, per_layer)
            assert n_static + n_new <= POOL_SIZE
    assert all(n_static == 0 for n_static, _ in counts.get(0, [(0, 0)]))
    assert max(s + n for per_layer in counts.values() for s, n in per_layer) == POOL_SIZE, "the pool never filled"
    pool = result["extras"]["pool_ranks"]  # after each task's compression
    assert len(pool) == T and all(0 < p <= POOL_SIZE for p in pool), pool


# --- the references: sequential LoRA, joint training, frozen backbone -----------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_seq_lora_trains_one_adapter_on_from_where_the_last_task_left_it(
    driver, seq, tmp_path, tiny_backbone, monkeypatch
):
    """One adapter through the whole sequence: task t starts from task t-1's trained weights (nothing resets or
    re-wraps), each task moves them, and the backbone never changes."""
    from peft.tuners.lora import LoraLayer

    from peft_ext.continual.methods.seq_lora import SequentialLoRA

    def weights(model):
        layers = layers_of(model, LoraLayer)
        return {
            f"{n}.{ab}": getattr(m, ab)["default"].weight.detach().clone()
            for n, m in layers.items()
            for ab in ("lora_A", "lora_B")
        }

    start: dict[int, dict] = {}
    end: dict[int, dict] = {}
    backbone: dict[int, dict] = {}
    observe(
        monkeypatch,
        SequentialLoRA,
        "before_task",
        after=lambda self, out, m, t, *a: start.__setitem__(t, weights(out)),
    )
    observe(
        monkeypatch,
        SequentialLoRA,
        "before_task",
        after=lambda self, out, m, t, *a: backbone.__setitem__(t, backbone_weights(out)),
    )
    observe(monkeypatch, SequentialLoRA, "after_task", before=lambda self, m, t, *a: end.__setitem__(t, weights(m)))
    run_driver(driver, "seq_lora", seq, tmp_path, tiny_backbone, monkeypatch)

    assert sorted(end)[-1] == T - 1
    for t in end:
        assert any(not torch.equal(start[t][k], end[t][k]) for k in end[t]), f"task {t} did not train the adapter"
        if t - 1 in end:
            for k in end[t]:
                assert torch.equal(start[t][k], end[t - 1][k]), f"task {t} did not start from task {t - 1}'s {k}"
    first, last = min(backbone), max(backbone)
    for k in backbone[first]:
        assert torch.equal(backbone[first][k], backbone[last][k]), f"the backbone's {k} changed"


@pytest.mark.parametrize("driver", DRIVERS)
def test_joint_trains_once_on_the_union_and_fills_only_the_last_row(driver, seq, tmp_path, tiny_backbone, monkeypatch):
    from peft_ext.continual.methods.joint import JointLoRA

    phases: list[tuple[int, int]] = []
    observe(
        monkeypatch, JointLoRA, "before_task", before=lambda self, m, t, task, ctx: phases.append((t, len(task.train)))
    )
    result = run_driver(driver, "joint", seq, tmp_path, tiny_backbone, monkeypatch)
    union = sum(len(task.train) for task in seq.tasks) if driver != "job" else None
    assert phases and {t for t, _ in phases} == {0}  # one phase (begun twice by the trainer driver's resume)
    assert len(phases) == (2 if driver == "trainer" else 1)
    if union is not None:
        assert all(n == union for _, n in phases)
    R_ = result["accuracy_matrix"]
    assert all(x is None for row in R_[:-1] for x in row) and all(x is not None for x in R_[-1])


def test_frozen_linear_keeps_the_backbone_and_trains_the_head(seq, tmp_path, tiny_backbone, monkeypatch):
    from peft_ext.continual.methods.frozen_linear import FrozenLinear

    seen: dict[int, tuple[dict, torch.Tensor]] = {}

    def record(self, model, task_id, task, ctx):
        seen[task_id] = (backbone_weights(model), model.classifier.weight.detach().clone())

    observe(monkeypatch, FrozenLinear, "before_task", before=record)
    observe(
        monkeypatch,
        FrozenLinear,
        "after_task",
        before=lambda self, m, t, *a: seen.__setitem__(
            -1 - t, (backbone_weights(m), m.classifier.weight.detach().clone())
        ),
    )
    run_driver("loop", "frozen_linear", seq, tmp_path, tiny_backbone, monkeypatch)
    for t in range(T):
        (before, head_before), (after, head_after) = seen[t], seen[-1 - t]
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert not torch.equal(head_before, head_after)


# --- the optimizer comparisons (single-task methods) -----------------------------------------------------------------


def on_every_step(monkeypatch, cls: type, before_step: Callable, after_step: Callable) -> None:
    """Call ``before_step(model)`` / ``after_step(model)`` around every optimizer step of ``cls``'s runs: the
    optimizer the method makes for the driver gets its ``step`` wrapped (the driver's own calls, in its order)."""

    def wrap(self, optimizer, model, params, ctx):
        step = optimizer.step

        def stepped(opt, *args, **kwargs):
            before_step(model)
            out = step(*args, **kwargs)
            after_step(model)
            return out

        optimizer.step = types.MethodType(stepped, optimizer)  # a bound method, as accelerate's wrapper expects

    observe(monkeypatch, cls, "make_optimizer", after=wrap)


SINGLE_TASK = {
    "riemannion": {"lr": 3e-2, "head_lr": 1e-2, "loi_batches": 2, "adapter": {"r": R, "target_modules": QUERY_VALUE}},
    "full_ft_dct": {"lr": 3e-3, "optimizer": {"name": "dct_adamw", "rank": R, "target_modules": QUERY_VALUE}},
    "full_ft_galore": {"lr": 3e-3, "optimizer": {"name": "galore_adamw", "rank": R, "target_modules": QUERY_VALUE}},
}


def run_single_task(driver: str, key: str, tmp_path: Path) -> dict:
    """One task of 4 classes, through ``run_sequence`` or the Trainer driver."""
    one = token_sequence(n_tasks=1, classes_per_task=4)
    name = "full_ft" if key.startswith("full_ft") else key
    method = get_continual_method(name)(**SINGLE_TASK[key])
    base = tiny_classifier(one.num_classes)
    if driver == "loop":
        config = TrainConfig(epochs=2, batch_size=8, progress=False, device="cpu")
        return run_sequence(one, method, base, stack_collate, config).to_dict()
    result, _ = run_continual_with_trainer(one, method, base, stack_collate, targs(tmp_path / "trainer", save_steps=2))
    return result.to_dict()


@pytest.mark.parametrize("driver", ["loop", "trainer"])
def test_riemannion_steps_stay_on_the_fixed_rank_manifold(driver, tmp_path, monkeypatch):
    """Every optimizer step keeps each adapter a rank-``r`` point with orthonormal ``A`` and the probe ``Z`` at zero,
    and moves the point ``X = A B^T``; LOI starts it away from zero delta-free (the output is unchanged at init)."""
    from peft_ext.continual.methods.riemannion import RiemannionMethod
    from peft_ext.tuners.riemannion import RiemannionLayer

    points: dict[str, torch.Tensor] = {}
    checks = {"steps": 0, "moved": 0}

    def remember(model):
        for n, m in layers_of(model, RiemannionLayer).items():
            points[n] = (m.riemannion_A["default"] @ m.riemannion_B["default"].T).detach().double()

    def check(model):
        checks["steps"] += 1
        for n, m in layers_of(model, RiemannionLayer).items():
            A, B = m.riemannion_A["default"].detach().double(), m.riemannion_B["default"].detach().double()
            eye = torch.eye(A.shape[1], dtype=torch.float64)
            assert float((A.T @ A - eye).abs().max()) < 1e-5, f"{n}: A left the Stiefel manifold"
            assert torch.count_nonzero(m.riemannion_Z["default"]) == 0, f"{n}: the probe Z is not zero"
            X = A @ B.T
            assert int(torch.linalg.matrix_rank(X)) == R, f"{n}: the point lost its rank"
            checks["moved"] += int(not torch.allclose(X, points[n], rtol=0, atol=1e-9))

    on_every_step(monkeypatch, RiemannionMethod, remember, check)
    run_single_task(driver, "riemannion", tmp_path)
    # every step moves every adapter's point (a dead adapter, or one whose step is lost, moves none)
    assert checks["steps"] > 0 and checks["moved"] == checks["steps"] * len(points), (checks, len(points))


@pytest.mark.parametrize("driver", ["loop", "trainer"])
@pytest.mark.parametrize("optimizer", ["dct", "galore"])
def test_low_rank_optimizers_update_projected_weights_in_rank_r_steps(optimizer, driver, tmp_path, monkeypatch):
    """DCT-AdamW and GaLore-AdamW: each step changes a projected weight (``query`` / ``value``) by a matrix of rank
    at most ``rank`` (the update is the projection of a rank-``r`` Adam step), while the other weights take full
    steps."""
    from peft_ext.continual.methods.full_ft import FullFineTune

    before: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}

    def weights(model) -> dict[str, torch.Tensor]:
        return {
            n: p.detach().double().clone()
            for n, p in model.named_parameters()
            if p.dim() == 2 and "embeddings" not in n and "classifier" not in n
        }

    def measure(model):
        for n, w in weights(model).items():
            # relative tolerance: writing a float32 weight back rounds every entry (~1e-9), a full-rank speck
            rank = int(torch.linalg.matrix_rank(w - before[n], rtol=1e-4))
            projected = n.endswith(("query.weight", "value.weight"))
            key = "projected" if projected else "other"
            ranks[key] = max(ranks.get(key, 0), rank)

    on_every_step(monkeypatch, FullFineTune, lambda model: before.update(weights(model)), measure)
    run_single_task(driver, f"full_ft_{optimizer}", tmp_path)
    assert 0 < ranks["projected"] <= R, ranks
    assert ranks["other"] > R, ranks


def test_olora_refuses_to_start_a_task_whose_predecessor_was_not_recorded(seq):
    """A caller of the hooks that skips ``after_task`` would train task 1 without task 0's ``A``: refused, named."""
    from peft_ext.continual import RunContext

    method = get_continual_method("olora")(**OPTIONS["olora"])
    config = TrainConfig(progress=False)
    ctx = RunContext(sequence=seq, train=config, collate=stack_collate, device=torch.device("cpu"))
    model = method.before_task(method.build(tiny_classifier(seq.num_classes), ctx), 0, seq.tasks[0], ctx)
    with pytest.raises(ValueError, match=r"the A of \[0\] finished tasks per layer but the runner starts task 1"):
        method.before_task(method.between_tasks(model, ctx), 1, seq.tasks[1], ctx)
