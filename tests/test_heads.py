"""Continual heads: each checked by what it must do, through the driver users run (``run_sequence``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peft_ext.continual import ContinualEngine, RunRecord, TrainConfig, get_continual_method, run_sequence
from peft_ext.continual.heads import AlignedHead, AnalyticHead, CosineClassifier, build_head
from peft_ext.continual.heads.analytic import AnalyticOptions, Tridiagonal, gcv_ridge
from peft_ext.continual.progress import TaskProgress
from peft_ext.continual.runner import LoopTrainer
from peft_ext.data.tasks import TaskSequence

from .helpers import lora_adapter, stack_collate, tiny_classifier, token_sequence

FAST = TrainConfig(epochs=3, batch_size=8, progress=False, device="cpu")
FEATURE_HEADS = ["prototype", "lda", "analytic", "aligned"]


@pytest.fixture(scope="module")
def seq() -> TaskSequence:
    return token_sequence(n_tasks=3, classes_per_task=2, per_class=16)


def _engine(seq, method, config=FAST):
    engine = ContinualEngine(seq, method, stack_collate, config)
    model = engine.build(tiny_classifier(seq.num_classes))
    return engine, model


def _run(engine, model, seq, trainer=None):
    record = RunRecord.empty(len(seq))
    model = engine.run(model, trainer or LoopTrainer(engine), record)
    return model, engine.result(model, record)


@torch.no_grad()
def _embeddings(model: nn.Module, examples) -> torch.Tensor:
    model.eval()
    batch = stack_collate(examples)
    return model.embed(batch["input_ids"], batch["attention_mask"]).double()


def test_prototype_head_is_the_class_means_computed_by_hand(seq):
    engine, model = _engine(seq, get_continual_method("ncm")())
    model, result = _run(engine, model, seq)
    means = torch.stack(
        [_embeddings(model, [ex for t in seq.tasks for ex in t.train if ex.label == c]).mean(0) for c in range(6)]
    )
    expected = nn.functional.normalize(means, dim=-1).float()
    torch.testing.assert_close(engine.head.prototypes(), expected, rtol=1e-5, atol=1e-6)
    # scores are the cosines to those means: the accuracy follows from them
    test = [ex for ex in seq.tasks[0].test]
    f = nn.functional.normalize(_embeddings(model, test).float(), dim=-1)
    predicted = (f @ expected.T).argmax(-1)
    assert result.accuracy_matrix[-1][0] == pytest.approx(
        (predicted == torch.tensor([e.label for e in test])).float().mean().item()
    )
    # a frozen backbone, untrained: nothing trained, no loss, the head's time counted
    assert result.task_losses == [None, None, None]
    assert result.trainable_params == 0
    assert result.extras["head"] == {"name": "prototype"}


def _feed(head, batches, width):
    """Feed ``batches`` of (task, features, labels) to ``head`` task by task, as the engine's pass does."""
    from peft_ext.data.tasks import Task

    class Ctx:  # what end_task reads of a run without a validation split
        sequence = TaskSequence("s", [f"c{i}" for i in range(6)], [Task("t", [0], [], [])])

    for task_id, parts in enumerate(batches):
        head.begin_task(task_id, Task(f"t{task_id}", sorted({int(y) for _, y in parts for y in y}), [], []), width)
        for x, y in parts:
            head.accumulate(x, y)
        head.end_task(nn.Identity(), task_id, Ctx())


def test_analytic_head_gives_the_same_weights_for_any_task_order_and_batch_split():
    gen = torch.Generator().manual_seed(0)
    width = 12
    tasks = []
    for t in range(3):
        y = torch.tensor([2 * t, 2 * t + 1]).repeat(10)
        x = torch.randn(20, width, generator=gen, dtype=torch.float64) + y[:, None].double()
        tasks.append((x, y))
    options = AnalyticOptions(dim=32, ridge="auto")

    def weights(order, batch):
        head = AnalyticHead(options, num_classes=6, seed=3)
        _feed(
            head,
            [[(tasks[t][0][s : s + batch], tasks[t][1][s : s + batch]) for s in range(0, 20, batch)] for t in order],
            width,
        )
        return head

    reference = weights([0, 1, 2], 20)
    for order, batch in (([2, 0, 1], 20), ([0, 1, 2], 3), ([1, 2, 0], 7)):
        other = weights(order, batch)
        torch.testing.assert_close(other.gram, reference.gram, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(other.targets, reference.targets, rtol=1e-12, atol=1e-9)
        assert other.chosen[-1] == reference.chosen[-1]
        torch.testing.assert_close(other.weight, reference.weight, rtol=1e-5, atol=1e-7)
    # and the weights are the ridge solution of the projected features
    h = torch.relu(torch.cat([x for x, _ in tasks]).float() @ reference.projection).double()
    y = nn.functional.one_hot(torch.cat([y for _, y in tasks]), 6).double()
    lam = reference.chosen[-1] * torch.linalg.eigvalsh(h.T @ h).clamp_min(0).mean()
    solved = torch.linalg.solve(h.T @ h + lam * torch.eye(32, dtype=torch.float64), h.T @ y)
    torch.testing.assert_close(reference.weight.double(), solved, rtol=1e-3, atol=1e-4)


def _eigen_gcv(gram, targets, lam, n):
    """The reference: generalized cross-validation from ``G``'s full eigendecomposition."""
    s, u = torch.linalg.eigh(gram)
    s = s.clamp_min(0)
    p2 = ((u.T @ targets) ** 2).sum(-1)
    shrink = 1 / (s + lam)
    rss = n - 2 * (p2 * shrink).sum() + (p2 * s * shrink * shrink).sum()
    dof = (s * shrink).sum()
    return float(n * rss.clamp_min(0) / (n - dof) ** 2) if dof < n else float("inf")


@pytest.mark.parametrize(("samples", "dim"), [(40, 64), (200, 64), (5, 1), (3, 2)])
def test_analytic_tridiagonal_solve_is_the_eigendecomposition_s(samples, dim):
    """The ridge weights and the GCV error of every grid point, through the tridiagonal reduction, equal those of
    the eigendecomposition to float64 rounding: rank-deficient (fewer samples than ``dim``) and full rank."""
    gen = torch.Generator().manual_seed(samples + dim)
    h = torch.relu(torch.randn(samples, dim, generator=gen, dtype=torch.float64) + 0.3)
    y = torch.arange(samples) % 3
    gram, targets = h.T @ h, h.T @ nn.functional.one_hot(y, 3).double()
    system = Tridiagonal(gram, targets)
    torch.testing.assert_close(
        system.eigenvalues.sort().values, torch.linalg.eigvalsh(gram).clamp_min(0), rtol=0, atol=1e-10 * gram.trace()
    )
    unit = float(gram.trace()) / dim
    grid = [unit * 10.0**k for k in range(-6, 3)]
    for lam in grid:
        solved = torch.linalg.solve(gram + lam * torch.eye(dim, dtype=torch.float64), targets)
        condition = float((system.eigenvalues.max() + lam) / lam)  # both solutions are exact to ~eps x this
        error = float((system.weight(lam) - solved).norm() / solved.norm())
        assert error <= 1e-14 * condition, (lam, error, condition)
        reference = _eigen_gcv(gram, targets, lam, float(samples))
        if reference == float("inf"):
            assert system.gcv(lam, samples, samples) == float("inf")
        else:
            # RSS is a difference of O(n) terms divided by (n - dof)^2: rounding grows as the fit interpolates
            dof = float((system.eigenvalues / (system.eigenvalues + lam)).sum())
            rel = 1e-12 * (samples / (samples - dof)) ** 2
            assert system.gcv(lam, samples, samples) == pytest.approx(reference, rel=rel)
    scores = [_eigen_gcv(gram, targets, lam, float(samples)) for lam in grid]
    finite = [i for i, v in enumerate(scores) if v != float("inf")]
    expected = grid[min(finite, key=lambda i: (scores[i], -i))] if finite else grid[-1]
    assert gcv_ridge(system, samples, samples, grid) == expected


def test_analytic_gcv_picks_a_small_ridge_for_clean_labels_and_a_large_one_for_noise():
    """GCV does its job: labels that are a function of the features want little shrinkage, random labels much."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(300, 20, generator=gen, dtype=torch.float64)
    clean = (h[:, :3].argmax(-1)).long()
    noise = torch.randint(0, 3, (300,), generator=gen)
    gram = h.T @ h
    unit = float(gram.trace()) / 20
    grid = [unit * 10.0**k for k in range(-6, 3)]
    chosen = {
        name: gcv_ridge(Tridiagonal(gram, h.T @ nn.functional.one_hot(y, 3).double()), 300.0, 300.0, grid)
        for name, y in (("clean", clean), ("noise", noise))
    }
    assert chosen["clean"] < chosen["noise"]


def test_aligned_head_retrains_from_stored_statistics_only(seq, monkeypatch):
    """Collate records every example it turns into a batch; while the heads learn after task t, only task t's
    training examples may pass (the alignment itself reads no example at all)."""
    seen: list[tuple[str, int]] = []
    phase = {"learning": None}
    owner = {id(ex): t for t, task in enumerate(seq.tasks) for ex in task.train}

    def collate(examples):
        if phase["learning"] is not None:
            seen.extend((phase["learning"], owner.get(id(ex), -1)) for ex in examples)
        return stack_collate(examples)

    aligns = []
    original_align = AlignedHead.align

    def align(self, seed):
        before = len(seen)
        original_align(self, seed)
        aligns.append(len(seen) - before)

    monkeypatch.setattr(AlignedHead, "align", align)
    import peft_ext.continual.engine as engine_module

    original = engine_module.learn_heads

    def learn_heads(heads, model, task_id, task, ctx):
        phase["learning"] = task_id
        try:
            original(heads, model, task_id, task, ctx)
        finally:
            phase["learning"] = None

    monkeypatch.setattr(engine_module, "learn_heads", learn_heads)
    method = get_continual_method("seq_lora")(lr=5e-3, adapter=lora_adapter(4), head="aligned")
    result = run_sequence(seq, method, tiny_classifier(seq.num_classes), collate, FAST)
    assert aligns == [0, 0, 0]  # three alignments, no example collated during any
    assert {(t, owner_t) for t, owner_t in seen} == {(0, 0), (1, 1), (2, 2)}
    assert result.extras["head"]["alignments"] == 3
    assert result.accuracy_matrix[0][0] > 0.8  # the aligned classifier learned the first task


def test_cosine_head_leaves_earlier_rows_bitwise_unchanged(seq):
    method = get_continual_method("seq_lora")(lr=1e-2, weight_decay=0.1, adapter=lora_adapter(4), head="cosine")
    engine, model = _engine(seq, method)
    rows: list[torch.Tensor] = []

    class Recording(LoopTrainer):
        def phase_done(self, model, phase, record):
            super().phase_done(model, phase, record)
            heads = [m for m in model.modules() if isinstance(m, CosineClassifier) and m.weight.requires_grad]
            (head,) = heads
            rows.append(torch.where(head.frozen[:, None], head.frozen_weight, head.weight).detach().clone())

    model, result = _run(engine, model, seq, Recording(engine))
    assert torch.equal(rows[1][:2], rows[0][:2])  # task 0's classes after task 1
    assert torch.equal(rows[2][:4], rows[1][:4])  # tasks 0 and 1's classes after task 2
    assert not torch.equal(rows[1][2:4], rows[0][2:4])  # the task being learned moves
    assert result.accuracy_matrix[0][0] > 0.8


def test_first_task_adaptation_trains_once_and_the_head_learns_every_class(seq):
    method = get_continual_method("seq_lora")(
        lr=5e-3, adapter=lora_adapter(4), head="prototype", adapt="first_task", compare_heads=["analytic"]
    )
    result = run_sequence(seq, method, tiny_classifier(seq.num_classes), stack_collate, FAST)
    assert result.task_losses[0] is not None and result.task_losses[1:] == [None, None]
    # 6 separable classes: well above chance (1/6) on every task after the last one
    assert min(result.accuracy_matrix[-1]) > 0.6
    assert min(result.extras["heads"]["analytic"]["accuracy_matrix"][-1]) > 0.6


def test_compared_heads_score_the_same_run_and_the_linear_row_is_unchanged(seq):
    plain = run_sequence(
        seq,
        get_continual_method("seq_lora")(lr=5e-3, adapter=lora_adapter(4)),
        tiny_classifier(6),
        stack_collate,
        FAST,
    )
    compared = run_sequence(
        seq,
        get_continual_method("seq_lora")(lr=5e-3, adapter=lora_adapter(4), compare_heads=FEATURE_HEADS),
        tiny_classifier(6),
        stack_collate,
        FAST,
    )
    assert compared.accuracy_matrix == plain.accuracy_matrix
    assert compared.task_losses == plain.task_losses
    assert sorted(compared.extras["heads"]) == sorted(FEATURE_HEADS)
    for name, data in compared.extras["heads"].items():
        assert data["metrics"]["final_acc"] > 1 / 6 + 0.2, name  # each head learns from the features


def test_training_free_baselines_learn_every_task(seq):
    for name in ("ncm", "slda", "ranpac"):
        result = run_sequence(seq, get_continual_method(name)(), tiny_classifier(6), stack_collate, FAST)
        assert result.metrics["final_acc"] > 1 / 6 + 0.3, name


def test_resume_restores_the_heads_exactly(seq, tmp_path, monkeypatch):
    def method():
        return get_continual_method("seq_lora")(
            lr=5e-3, adapter=lora_adapter(4), head="analytic", compare_heads=["prototype", "aligned", "lda"]
        )

    straight = run_sequence(seq, method(), tiny_classifier(6), stack_collate, FAST)
    progress = TaskProgress(tmp_path / "p", {"method": "seq_lora"})
    original = LoopTrainer.train

    def interrupted(self, model, phase):
        if phase.task_id == 2:
            raise KeyboardInterrupt
        return original(self, model, phase)

    monkeypatch.setattr(LoopTrainer, "train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_sequence(seq, method(), tiny_classifier(6), stack_collate, FAST, progress=progress)
    monkeypatch.setattr(LoopTrainer, "train", original)
    resumed = run_sequence(seq, method(), tiny_classifier(6), stack_collate, FAST, progress=progress)
    assert resumed.accuracy_matrix == straight.accuracy_matrix
    assert resumed.task_losses == straight.task_losses
    assert resumed.extras["heads"] == straight.extras["heads"]
    assert resumed.extras["head"] == straight.extras["head"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"head": "protoype"}, "did you mean 'prototype'"),
        ({"head": {"name": "analytic", "dims": 8}}, "did you mean 'dim'"),
        ({"head": {"name": "analytic", "ridge": -1.0}}, "`head.ridge` must be"),
        ({"adapt": "first_task"}, "`adapt: first_task` freezes the model"),
        ({"adapt": "sometimes"}, "`adapt` must be one of"),
        ({"compare_heads": ["cosine"]}, "give it its own method entry with `head: cosine`"),
        ({"compare_heads": ["lda", "lda"]}, "lists a head twice"),
        ({"head": "cosine", "compare_heads": ["linear"]}, "which the 'cosine' head replaces"),
    ],
)
def test_bad_head_options_are_one_clear_line(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        get_continual_method("seq_lora")(adapter=lora_adapter(4), **options)
    assert "\n" not in str(err.value)


def test_training_free_methods_refuse_trained_heads():
    with pytest.raises(ValueError, match="'ncm' trains nothing"):
        get_continual_method("ncm")(head="cosine")


def test_a_head_that_chooses_on_validation_needs_a_validation_split(seq):
    method = get_continual_method("ranpac")(head={"name": "analytic", "ridge": "validation"})
    with pytest.raises(ValueError, match=r"`data.val_per_class` \(shipped data sets\) or `data.validation`"):
        ContinualEngine(seq, method, stack_collate, FAST)


def test_config_errors_name_the_key(tmp_path):
    from peft_ext.continual.config import ConfigError, config_from_dict

    data = {"methods": [{"name": "seq_lora", "head": "analytc"}]}
    with pytest.raises(ConfigError, match=r"`methods\[0\]\.head` 'analytc' is not a head \(did you mean 'analytic'"):
        config_from_dict(data)
    config = config_from_dict({"methods": [{"name": "ranpac", "head": {"name": "analytic", "dim": 64}}]})
    assert config.methods[0].options.head == {"name": "analytic", "dim": 64}


def test_memory_per_class_of_each_head_at_width_4096():
    from peft_ext.continual.heads import HEADS

    sizes = {name: cls.bytes_per_class(cls.options_cls(), 4096) for name, cls in HEADS.items()}
    assert sizes["linear"] == sizes["cosine"] == 0  # their rows are the model's own parameters
    assert sizes["prototype"] == 8 * 4097
    assert sizes["aligned"] < 2**21  # auto: a rank-64 covariance beyond width 1024, not 64 MiB
    full = HEADS["aligned"].bytes_per_class(HEADS["aligned"].options_cls(covariance="full"), 4096)
    assert full > 64 * 2**20


def test_head_builder_rejects_non_heads():
    with pytest.raises(ValueError, match="must be a head name or a mapping"):
        build_head(3, 4)


@pytest.mark.distributed
def test_two_processes_give_what_one_gives(tmp_path):
    """Each process reads half of every task (29 examples: shares of 15 and 14) and the sums are all-reduced: the
    heads' statistics and scores equal one process's reading everything."""
    from .helpers import ROOT, torchrun_ranks
    from .workers.heads import run_heads

    ranks = torchrun_ranks(ROOT / "tests" / "workers" / "heads.py", tmp_path, pytest.fail)
    one = run_heads()
    for got in ranks:
        assert got["result"]["accuracy_matrix"] == one["result"]["accuracy_matrix"]
        assert got["result"]["extras"]["heads"] == one["result"]["extras"]["heads"]
        for head, state in one["heads"].items():
            _assert_states_close(got["heads"][head], state, head)


def _assert_states_close(got, want, where):
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            _assert_states_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=where)
    else:
        assert got == pytest.approx(want, rel=1e-6), where


def test_check_refuses_a_head_that_needs_the_validation_split_the_config_lacks(capsys):
    """`peft-ext check` (and `run`, before any training) names the head and the key that gives a validation split."""
    from peft_ext_cli import main

    from .helpers import ROOT

    config = str(ROOT / "configs" / "quickstart.yaml")
    # the shipped config has a validation split: this check runs without one
    no_split = ["--set", "data.val_per_class=0"]
    head = "methods.ranpac.head={name: analytic, ridge: validation}"
    assert main(["check", config, "--only", "ranpac", *no_split, "--set", head]) == 2
    err = capsys.readouterr().err
    assert "`methods.ranpac`" in err and "`data.val_per_class`" in err and "'analytic' head" in err
    assert main(["check", config, "--only", "ranpac", "--set", "methods.ranpac.head=analytc"]) == 2
    assert "did you mean 'analytic'" in capsys.readouterr().err
    # with a validation split the same head is valid
    assert (
        main(
            [
                "check",
                config,
                "--only",
                "ranpac",
                "--set",
                "data.val_per_class=5",
                "--set",
                "methods.ranpac.head={name: analytic, ridge: validation}",
            ]
        )
        == 0
    )
