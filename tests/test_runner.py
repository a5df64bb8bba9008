import dataclasses
import math
import random

import pytest
import torch

from peft_ext.continual import (
    ContinualEngine,
    RunContext,
    RunRecord,
    TaskTrainer,
    TrainConfig,
    get_continual_method,
    run_sequence,
)
from peft_ext.continual.methods import ContinualMethod, MethodOptions
from peft_ext.continual.report import matrix_table, metrics_table, save_results
from peft_ext.data.tasks import Example, Task, TaskSequence

from .helpers import lora_adapter, stack_collate, tiny_classifier, token_sequence

FAST = TrainConfig(epochs=4, batch_size=8, progress=False, device="cpu")


@pytest.fixture(scope="module")
def seq():
    return token_sequence()


def _run(name, seq, **opts):
    method = get_continual_method(name)(**opts)
    base = tiny_classifier(seq.num_classes)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    result = run_sequence(seq, method, base, stack_collate, FAST)
    after = base.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the runner must not modify the base model"
    return result


def test_seq_lora_fills_the_lower_triangle_and_learns(seq):
    # Task-incremental, so the check is about learning each task, not about the class-incremental head bias
    # (old classes' logits outscoring a new task's, which the CIL evaluation rightly counts as errors).
    seq = dataclasses.replace(seq, protocol="task-incremental")
    r = _run("seq_lora", seq, lr=5e-3, adapter=lora_adapter(4))
    T = len(seq)
    for i in range(T):
        for j in range(T):
            assert (r.accuracy_matrix[i][j] is None) == (j > i)
    # each task is learned right after training it (chance is 1/2 within a task)
    assert min(r.accuracy_matrix[i][i] for i in range(T)) > 0.8
    assert r.metrics["final_acc"] == pytest.approx(sum(r.accuracy_matrix[-1]) / T)
    assert r.trainable_params < r.total_params / 5
    assert len(r.task_losses) == T and all(math.isfinite(x) for x in r.task_losses)


def test_frozen_linear_trains_only_the_head(seq):
    method = get_continual_method("frozen_linear")(lr=1e-2)
    base = tiny_classifier(seq.num_classes)
    model = method.build(base, None)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"classifier.weight", "classifier.bias"}
    r = _run("frozen_linear", seq, lr=1e-2)
    assert r.trainable_params == 32 * seq.num_classes + seq.num_classes


def test_joint_reports_only_the_last_row(seq):
    r = _run("joint", seq, lr=5e-3, adapter=lora_adapter(4))
    assert all(x is None for row in r.accuracy_matrix[:-1] for x in row)
    assert all(x is not None for x in r.accuracy_matrix[-1])
    assert r.metrics["bwt"] is None and r.metrics["forgetting"] is None
    assert r.metrics["final_acc"] > 0.5


def test_runs_are_deterministic(seq):
    a = _run("seq_lora", seq, lr=5e-3, adapter=lora_adapter(4))
    b = _run("seq_lora", seq, lr=5e-3, adapter=lora_adapter(4))
    assert a.accuracy_matrix == b.accuracy_matrix
    assert a.task_losses == b.task_losses


def test_class_incremental_evaluation_scores_against_all_seen_classes():
    """A model that always predicts the newest class is right on the newest task only (CIL), but a
    task-incremental evaluation restricts it to each task's own classes."""

    class Newest(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.arange(4, dtype=torch.float))  # class 3 always wins

        def forward(self, input_ids, attention_mask=None):
            return self.bias.expand(input_ids.shape[0], 4)

    class Noop(ContinualMethod):
        name = "noop_test"
        options_cls = MethodOptions

        def make_optimizer(self, model, params, ctx):
            return torch.optim.SGD(params, lr=0.0)

    ex = lambda c: Example(torch.zeros(2, dtype=torch.long), c)  # noqa: E731
    tasks = [Task("a", [0, 1], [ex(0), ex(1)], [ex(0), ex(1)]), Task("b", [2, 3], [ex(2), ex(3)], [ex(2), ex(3)])]
    cil = run_sequence(TaskSequence("s", list("abcd"), tasks), Noop(), Newest(), stack_collate, FAST)
    # after task a the seen classes are {0,1}: the model predicts 1 -> 50% on a; after b it predicts 3 everywhere
    assert cil.accuracy_matrix == [[0.5, None], [0.0, 0.5]]
    til = run_sequence(
        TaskSequence("s", list("abcd"), tasks, protocol="task-incremental"), Noop(), Newest(), stack_collate, FAST
    )
    assert til.accuracy_matrix == [[0.5, None], [0.5, 0.5]]


def test_reports_are_written(tmp_path, seq):
    r = _run("seq_lora", seq, lr=5e-3, adapter=lora_adapter(4))
    paths = save_results([r], tmp_path / "out", {"name": "unit"}, [t.name for t in seq.tasks])
    import json

    data = json.loads(paths["json"].read_text())
    assert data["results"][0]["accuracy_matrix"] == r.accuracy_matrix
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["markdown"].read_text()
    assert "| seq_lora |" in md and f"{100 * r.metrics['final_acc']:.1f}" in md
    assert matrix_table(r).count("\n") == len(seq) + 1
    assert "final acc" in metrics_table([r])
    assert not list((tmp_path / "out").glob("*.tmp")), "no temporary files may be left behind"


def test_training_with_no_trainable_parameters_is_a_clear_error(seq):
    class Frozen(ContinualMethod):
        name = "frozen_test"

        def build(self, base_model, ctx):
            return base_model.requires_grad_(False)

    with pytest.raises(ValueError, match="no trainable parameters"):
        run_sequence(seq, Frozen(), tiny_classifier(seq.num_classes), stack_collate, FAST)


def test_bad_train_config_is_rejected():
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig(epochs=0).validate()
    with pytest.raises(ValueError, match="train_logit_mask"):
        TrainConfig(train_logit_mask="nope").validate()


def test_lr_schedules():
    from peft_ext.continual.context import lr_factor

    assert [lr_factor(s, 10, "constant", 0.0) for s in (0, 9)] == [1.0, 1.0]
    assert lr_factor(0, 10, "linear", 0.0) == 1.0 and lr_factor(5, 10, "linear", 0.0) == 0.5
    assert lr_factor(5, 10, "cosine", 0.0) == pytest.approx(0.5)
    # warmup: 2 of 10 steps ramp up, then the schedule starts from 1
    assert lr_factor(0, 10, "linear", 0.2) == pytest.approx(1 / 3) and lr_factor(2, 10, "linear", 0.2) == 1.0
    with pytest.raises(ValueError, match="warmup_ratio"):
        TrainConfig(warmup_ratio=1.0).validate()


def test_heatmap_is_a_png_and_leaves_the_callers_matplotlib_backend_alone(tmp_path):
    import matplotlib

    from peft_ext.continual import MethodResult
    from peft_ext.continual.report import plot_accuracy_matrices

    previous = matplotlib.get_backend()
    matplotlib.use("svg")  # e.g. a notebook's inline backend: plotting must not switch it
    try:
        R = [[0.9, None, None], [0.5, 0.8, None], [0.3, 0.4, 0.9]]
        result = MethodResult("seq_lora", "seq_lora", R, {"final_acc": 0.53}, 1, 1, 0.0, 0.0, [])
        path = plot_accuracy_matrices([result, result], tmp_path / "m.png", title="t")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(previous)
    with pytest.raises(ValueError, match="no results to plot"):
        plot_accuracy_matrices([], tmp_path / "none.png")


class _Recorder(TaskTrainer):
    """A training step that trains nothing and records what the engine asked of it, and when."""

    def __init__(self, log: list) -> None:
        self.log = log

    def prepare(self, phase):
        self.log.append(("prepare", phase.task_id))

    def train(self, model, phase):
        self.log.append(("train", phase.task_id, phase.allowed_classes, phase.row))
        return float(phase.task_id)

    def finish(self, model, phase):
        self.log.append(("finish", phase.task_id))

    def phase_done(self, model, phase, record):
        self.log.append(("done", phase.task_id, record.completed, record.accuracy_matrix[phase.row][phase.row]))


class _Hooks(ContinualMethod):
    name = "hooks_for_test"

    def __init__(self, log: list, joint: bool = False) -> None:
        super().__init__()
        self.log, self.trains_on_union = log, joint

    def before_task(self, model, task_id, task, ctx):
        self.log.append(("before", task_id))
        return model

    def after_task(self, model, task_id, task, ctx):
        self.log.append(("after", task_id))
        return model


@pytest.mark.parametrize("joint", [False, True])
def test_engine_runs_the_phases_in_order_with_a_pluggable_training_step(seq, joint):
    log: list = []
    engine = ContinualEngine(seq, _Hooks(log, joint), stack_collate, FAST)
    record = RunRecord.empty(len(seq))
    engine.run(engine.build(tiny_classifier(seq.num_classes)), _Recorder(log), record)
    T = len(seq)
    if joint:
        union = sorted(c for task in seq.tasks for c in task.classes)
        assert log[:5] == [("prepare", 0), ("before", 0), ("train", 0, union, T - 1), ("finish", 0), ("after", 0)]
        assert record.task_losses == [0.0] and record.completed == 1
        assert all(x is None for row in record.accuracy_matrix[:-1] for x in row)
        assert engine.metrics(record)["bwt"] is None
    else:
        for i, task in enumerate(seq.tasks):
            phase = log[6 * i : 6 * i + 6]
            assert phase[:5] == [
                ("prepare", i),
                ("before", i),
                ("train", i, task.classes, i),
                ("finish", i),
                ("after", i),
            ]
            assert phase[5][:3] == ("done", i, i + 1) and phase[5][3] is not None  # evaluated before phase_done
        assert record.task_losses == [0.0, 1.0, 2.0][:T]
        assert all(record.accuracy_matrix[i][j] is not None for i in range(T) for j in range(i + 1))
    # a run resumed from the record runs nothing more
    again = len(log)
    engine.run(engine.build(tiny_classifier(seq.num_classes)), _Recorder(log), record)
    assert len(log) == again


def test_run_context_batches_and_task_loss(seq):
    ctx = RunContext(sequence=seq, train=FAST, collate=stack_collate, device=torch.device("cpu"))
    task = seq.tasks[1]
    batches = list(ctx.iter_batches(task.train, batch_size=5, limit=2))
    assert [len(b["labels"]) for b in batches] == [5, 5]
    assert torch.equal(batches[0]["labels"], torch.tensor([ex.label for ex in task.train[:5]]))
    shuffled = list(ctx.iter_batches(task.train, rng=random.Random(0)))
    assert sorted(int(y) for b in shuffled for y in b["labels"]) == sorted(ex.label for ex in task.train)
    assert ctx.training_classes(1) == list(task.classes) and ctx.eval_classes(1, 0) == seq.classes_seen(1)
    model = tiny_classifier(seq.num_classes).eval()
    batch = batches[0]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    masked = logits.masked_fill(~ctx.class_mask(task.classes), float("-inf"))
    torch.testing.assert_close(
        ctx.task_loss(model, batch, 1), torch.nn.functional.cross_entropy(masked, batch["labels"])
    )
    assert not torch.allclose(
        ctx.task_loss(model, batch, 1), torch.nn.functional.cross_entropy(logits, batch["labels"])
    )


def test_engine_state_round_trips_and_reads_a_snapshot_of_the_flat_layout(seq):
    """``ContinualEngine.state_dict`` keeps the method's state (generators encoded) and the feature heads' apart; a
    snapshot written when both lived in one mapping (the heads under ``"heads"``) still loads into both."""
    from peft_ext.continual.runner import LoopTrainer

    method = get_continual_method("ncm")(compare_heads=["lda"])
    engine = ContinualEngine(seq, method, stack_collate, FAST)
    model = engine.build(tiny_classifier(seq.num_classes))
    engine.run(model, LoopTrainer(engine), RunRecord.empty(len(seq)))  # the heads learn every task
    method.state["generator"] = torch.Generator().manual_seed(3)
    saved = engine.state_dict()
    assert set(saved) == {"method", "heads"} and set(saved["heads"]) == {"head", "lda"}
    assert not isinstance(saved["method"]["generator"], torch.Generator)
    for state in (saved, {**saved["method"], "heads": saved["heads"]}):  # today's layout, then the flat one
        fresh = ContinualEngine(seq, get_continual_method("ncm")(compare_heads=["lda"]), stack_collate, FAST)
        assert fresh.method.state == {}  # a new run starts empty
        fresh.load_state_dict(state)
        assert torch.equal(fresh.method.state["generator"].get_state(), method.state["generator"].get_state())
        for key, head_state in saved["heads"].items():
            got = fresh.state_dict()["heads"][key]
            assert got.keys() == head_state.keys()
            for name, value in head_state.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(got[name], value), (key, name)
