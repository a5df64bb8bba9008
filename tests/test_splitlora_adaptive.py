"""The adaptive SplitLoRA of the ablation benchmark (benchmarks/_lib/splitlora_variants.py): it measures each task on
held-out examples and raises the next tasks' A norm or the split's trade-off when a task trails the first; it must
change the run exactly then."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks._lib.splitlora_variants import AdaptiveSplitLoRA, RecordedSplitLoRA
from peft_ext.continual import TrainConfig, run_sequence
from peft_ext.continual.methods.splitlora import SplitLoRAOptions
from peft_ext.tuners.splitlora import SplitLoRAConfig, SplitLoRALayer
from peft_ext.tuners.splitlora.subspace import kaiming_lora_A, seeded_generator

from .helpers import QUERY_VALUE, stack_collate, tiny_classifier, token_sequence


def _sequence():
    seq = token_sequence(n_tasks=3, classes_per_task=2, per_class=12)
    # held-out examples: the test examples (enough for a mechanical check)
    return dataclasses.replace(seq, tasks=[dataclasses.replace(t, validation=list(t.test)) for t in seq.tasks])


def _options(**adapter) -> SplitLoRAOptions:
    return SplitLoRAOptions(lr=1e-2, adapter=SplitLoRAConfig(r=4, target_modules=list(QUERY_VALUE), **adapter))


def _run(method):
    seq = _sequence()
    seen = {}
    original = method.before_task

    def before_task(model, task_id, task, ctx):  # the A each task trains with (after the rule's gain)
        model = original(model, task_id, task, ctx)
        seen[task_id] = {
            m._splitlora_seed_key: m.splitlora_A["default"].detach().clone()
            for m in model.modules()
            if isinstance(m, SplitLoRALayer)
        }
        return model

    method.before_task = before_task
    config = TrainConfig(epochs=1, batch_size=8, progress=False)
    return run_sequence(seq, method, tiny_classifier(seq.num_classes), stack_collate, config), seen


def test_an_adaptive_rule_that_never_fires_is_plain_splitlora():
    plain, plain_a = _run(RecordedSplitLoRA(_options()))
    quiet, quiet_a = _run(AdaptiveSplitLoRA(_options(), knob="norm", factor=2.0, tolerance=0.0))
    assert quiet.accuracy_matrix == plain.accuracy_matrix
    assert quiet.extras["adaptive"]["gain_used"] == [1.0, 1.0, 1.0]
    assert quiet.extras["splits"] == plain.extras["splits"]
    for t in plain_a:
        for key in plain_a[t]:
            torch.testing.assert_close(quiet_a[t][key], plain_a[t][key], rtol=0, atol=0)


def test_the_norm_rule_scales_later_tasks_a_up_to_the_kaiming_norm():
    plain, plain_a = _run(RecordedSplitLoRA(_options()))
    # tolerance 10: every task from the second on "trails" the first, so the gain doubles after each of them
    loud, loud_a = _run(AdaptiveSplitLoRA(_options(), knob="norm", factor=2.0, tolerance=10.0))
    adaptive = loud.extras["adaptive"]
    assert len(adaptive["accuracy"]) == 3 and all(0 <= a <= 1 for a in adaptive["accuracy"])
    # task 1: no task measured yet (gain 1); task 2: doubled after task 1, capped at t + 1 = 3
    assert adaptive["gain_used"] == [1.0, 1.0, 2.0]
    for key, a in loud_a[2].items():
        torch.testing.assert_close(a, 2.0 * plain_a[2][key])  # the same direction, twice the norm
        n = a.shape[1]
        kaiming = float(torch.linalg.matrix_norm(kaiming_lora_A(4, n, seeded_generator(0, key, 2), torch.float64)))
        assert float(torch.linalg.matrix_norm(a)) == pytest.approx(2.0 * kaiming / 3, rel=1e-5)
    assert loud.accuracy_matrix != plain.accuracy_matrix or loud.task_losses != plain.task_losses


def test_the_trade_off_rule_raises_the_next_split_trade_off():
    # a small configured trade-off keeps many primary directions, so a raised one visibly keeps fewer
    plain, _ = _run(RecordedSplitLoRA(_options(trade_off=0.5)))
    loud, _ = _run(AdaptiveSplitLoRA(_options(trade_off=0.5), knob="trade_off", factor=1000.0, tolerance=10.0))
    # the split after task 0 keeps the configured 0.5; after task 1 (trailing) 500; after task 2, 500000
    assert loud.extras["adaptive"]["trade_off"] == [0.5, 500.0, 500000.0]
    assert loud.extras["adaptive"]["gain_used"] == [1.0, 1.0, 1.0]  # the norm is left alone
    plain_primary = [sorted(p for _, p in task.values()) for task in plain.extras["splits"]]
    primary = [sorted(p for _, p in task.values()) for task in loud.extras["splits"]]
    assert primary[0] == plain_primary[0]  # the first split is the configured one
    assert min(plain_primary[1]) > 2 and set(primary[1]) == {2}  # every module's split at the floor (k* <= 1)


def test_the_rule_needs_held_out_examples():
    seq = token_sequence(n_tasks=2, classes_per_task=2, per_class=8)
    method = AdaptiveSplitLoRA(_options(), knob="norm")
    with pytest.raises(ValueError, match="needs held-out"):
        run_sequence(seq, method, tiny_classifier(seq.num_classes), stack_collate, TrainConfig(progress=False))
    with pytest.raises(ValueError, match="`knob` must be"):
        AdaptiveSplitLoRA(_options(), knob="rank")
