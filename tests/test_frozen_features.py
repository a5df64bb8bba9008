"""The frozen backbone's features are computed once per job: the methods that train nothing share them, and each
evaluation row reads the earlier tasks' test features instead of running the backbone again; every score stays bit
for bit what it was."""

from __future__ import annotations

import pytest
import torch

from peft_ext.continual import TrainConfig, get_continual_method, run_sequence
from peft_ext.continual.heads.frozen import FrozenFeatures
from peft_ext.data.tasks import TaskSequence

from .helpers import stack_collate, tiny_classifier, token_sequence

FAST = TrainConfig(epochs=1, batch_size=8, eval_batch_size=8, progress=False, device="cpu")
TRAINING_FREE = ("ncm", "slda", "ranpac")
#: Method options by name: RanPAC's projection kept small (its 2048-wide Gram is not what these tests check).
OPTIONS = {"ranpac": {"head": {"name": "analytic", "dim": 64}}, "seq_lora": {"lr": 5e-3}}


@pytest.fixture(scope="module")
def seq() -> TaskSequence:
    return token_sequence(n_tasks=3, classes_per_task=2, per_class=12)


def _runs(seq, base, frozen_features=None, names=TRAINING_FREE):
    return {
        name: run_sequence(
            seq,
            get_continual_method(name)(**OPTIONS.get(name, {})),
            base,
            stack_collate,
            FAST,
            frozen_features=frozen_features,
        )
        for name in names
    }


def _same(got, want):
    for name in want:
        assert got[name].accuracy_matrix == want[name].accuracy_matrix, name
        assert got[name].extras.get("final_correct") == want[name].extras.get("final_correct"), name


def test_methods_that_train_nothing_share_one_pass_and_score_exactly_as_without(seq):
    base = tiny_classifier(seq.num_classes)
    want = _runs(seq, base)
    cache = FrozenFeatures()
    got = _runs(seq, base, cache)
    _same(got, want)
    # distinct batches: each task's training data (the heads' pass) and test data, eval_batch_size at a time
    batches = sum(-(-len(t.train) // 8) + -(-len(t.test) // 8) for t in seq.tasks)
    assert cache.computed == batches
    # without the cache each method would run every evaluation row's test batches again
    rows = sum(-(-len(seq.tasks[j].test) // 8) for i in range(len(seq)) for j in range(i + 1))
    train = sum(-(-len(t.train) // 8) for t in seq.tasks)
    assert cache.reused == len(TRAINING_FREE) * (rows + train) - batches
    assert cache.bytes > 0


def test_the_backbone_runs_once_per_distinct_batch_in_a_job(seq, monkeypatch):
    """Counted where the forwards happen: with the cache the three methods run the backbone once per distinct
    batch; without it, once per batch of every pass of every method."""
    import peft_ext.continual.evaluation as evaluation
    import peft_ext.continual.heads.base as heads_base
    import peft_ext.continual.heads.frozen as frozen

    calls = []
    real = heads_base.forward_with_features

    def counted(model, batch):
        calls.append(len(batch["labels"]))
        return real(model, batch)

    for module in (evaluation, heads_base, frozen):
        monkeypatch.setattr(module, "forward_with_features", counted)
    base = tiny_classifier(seq.num_classes)
    cache = FrozenFeatures()
    _runs(seq, base, cache)
    with_cache = len(calls)
    calls.clear()
    _runs(seq, base)
    assert with_cache == cache.computed
    assert len(calls) == cache.computed + cache.reused > 3 * with_cache


def test_a_method_that_trains_ignores_the_cache(seq):
    base = tiny_classifier(seq.num_classes)
    cache = FrozenFeatures()
    got = _runs(seq, base, cache, names=("seq_lora",))
    want = _runs(seq, base, names=("seq_lora",))
    _same(got, want)
    assert cache.computed == cache.reused == 0


def test_nothing_kept_past_max_bytes_and_the_scores_are_the_same(seq):
    base = tiny_classifier(seq.num_classes)
    want = _runs(seq, base, names=("ncm",))
    cache = FrozenFeatures(max_bytes=0)
    got = _runs(seq, base, cache, names=("ncm",))
    _same(got, want)
    assert cache.bytes == 0 and cache.reused == 0 and cache.computed > 0
    with pytest.raises(ValueError, match="max_bytes must be >= 0, got -1"):
        FrozenFeatures(max_bytes=-1)


def test_another_backbone_is_refused(seq):
    cache = FrozenFeatures()
    _runs(seq, tiny_classifier(seq.num_classes), cache, names=("ncm",))
    other = tiny_classifier(seq.num_classes)
    with torch.no_grad():
        next(p for n, p in other.named_parameters() if "classifier" not in n).add_(1.0)
    with pytest.raises(ValueError, match="give each backbone its own FrozenFeatures"):
        _runs(seq, other, cache, names=("ncm",))
