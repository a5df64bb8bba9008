"""PCLR's contribution scores measure every stored task in one stacked pass: the same scores and the same compression
decisions as the pass-per-task computation they replace (kept below as the reference), through ``end_task``."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import get_peft_model

import peft_ext.tuners.pclr.layer as pclr_layer
import peft_ext.tuners.pclr.model as pclr_model
from peft_ext import PCLRConfig
from peft_ext.kernels import rank_pool_gather
from peft_ext.models import tiny_llama
from peft_ext.tuners.pclr import (
    compress,
    contribution_scores,
    group_layers,
    routed_as,
    stored_prototypes,
    task_route,
)
from peft_ext.tuners.pclr.distill import default_forward, evaluating
from peft_ext.tuners.pclr.keys import routed_as_tasks, stack_batch
from peft_ext.tuners.pclr.pool import pclr_tuner

from .helpers import pclr_lm_step

VOCAB = 128


@torch.no_grad()
def _reference_scores(model, batches, adapter="default", route_current_by_input=True, aggregate="sum"):
    """The computation before the stacked pass: one pass over ``batches`` per stored task, routed as that task."""
    groups = group_layers(model, adapter)
    totals = {group: torch.zeros(sum(layers[0].counts(adapter)[:2])) for group, layers in groups.items()}
    current = {}

    def record(layer, name, x, A, B, indices, gates):
        x3 = x if x.dim() == 3 else x.unsqueeze(1)
        proj = torch.einsum("btn,bkn->btk", x3.float(), A.detach().float()[indices])
        size = proj.abs().mean(1) * B.detach().float().norm(dim=1)[indices] * gates.float()
        current[layer.pclr_group].index_add_(0, indices.flatten(), size.flatten())

    state = pclr_tuner(model).routing_state
    protos = stored_prototypes(model, adapter)
    state.recorder = record
    try:
        with evaluating(model):
            for task in range(protos.shape[0]):
                for group in totals:
                    current[group] = torch.zeros_like(totals[group])
                with routed_as(model, task_route(protos, task, route_current_by_input)):
                    for batch in batches:
                        default_forward(model, batch)
                for group, value in current.items():
                    share = value / value.sum().clamp_min(1e-30)
                    totals[group] = (torch.add if aggregate == "sum" else torch.maximum)(totals[group], share)
    finally:
        state.recorder = None
    return totals


def _batches(task: int, n: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(task)
    low = 25 * task % (VOCAB - 40)  # each task its own token range, so its prototype and routing differ
    return [{"input_ids": torch.randint(low, low + 40, (5, 7), generator=g)} for _ in range(n)]


def _sequence(n_tasks: int, rule: str, routing: str = "tasks") -> tuple[torch.nn.Module, list]:
    """Learn ``n_tasks`` tasks through begin_task / end_task on a tiny Llama (compressing after every task but the
    first, scored by the measured-contribution ``rule``, distilled with ``routing``); the model and each end_task's
    integration result."""
    torch.manual_seed(0)
    config = PCLRConfig(
        target_modules=["q_proj", "v_proj", "up_proj"],
        pool_size=16,
        ranks_schedule=[6],
        compress_schedule=[0.0, 0.5],
        compress_rule=rule,
        top_k=4,
        alpha=4.0,
        shared_r=2,
    )
    model = get_peft_model(tiny_llama(vocab_size=VOCAB, hidden_size=32), config)
    results = []
    for task in range(n_tasks):
        batches = _batches(task)
        proto = model.query_prototype(batches)
        model.begin_task(task, proto)
        params = [p for n, p in model.named_parameters() if "pclr_A" in n or "pclr_B" in n or "pclr_keys" in n]
        optimizer = torch.optim.AdamW(params, lr=5e-2)
        model.train()
        for step in range(4):
            pclr_lm_step(model, model, batches[step % 2]["input_ids"], optimizer)
        model.eval()
        generator = torch.Generator().manual_seed(task)
        results.append(
            model.end_task(task, proto, batches, integrate_epochs=1, integrate_routing=routing, generator=generator)
        )
    return model, results


@pytest.mark.parametrize("rule", ["contribution", "contribution_max"])
def test_stacked_scores_and_drops_equal_one_pass_per_task_through_end_task(monkeypatch, rule):
    measured = []
    stacked_scores = pclr_model.contribution_scores

    def both(model, batches, adapter, forward, aggregate, **options):
        assert forward is None
        reference = _reference_scores(model, batches, adapter, aggregate=aggregate)
        stacked = stacked_scores(model, batches, adapter, forward, aggregate=aggregate, **options)
        n_drop = sum(group_layers(model)["model.layers.0"][0].counts(adapter)[:2]) // 2
        dropped = [compress(copy.deepcopy(model), n_drop, rule=rule, scores=s) for s in (reference, stacked)]
        measured.append((stored_prototypes(model).shape[0], reference, stacked, dropped))
        return stacked

    monkeypatch.setattr(pclr_model, "contribution_scores", both)
    _sequence(5, rule)
    # compression after tasks 1..4 (the schedule keeps task 0 whole): 2, 3, 4, 5 stored tasks measured
    assert [n for n, *_ in measured] == [2, 3, 4, 5]
    for n_tasks, reference, stacked, (drop_reference, drop_stacked) in measured:
        assert reference.keys() == stacked.keys() == {"model.layers.0", "model.layers.1"}
        for group in reference:
            torch.testing.assert_close(stacked[group], reference[group], rtol=1e-5, atol=1e-6)
            if rule == "contribution":  # every task's shares sum to one
                torch.testing.assert_close(stacked[group].sum(), torch.tensor(float(n_tasks)))
        assert drop_stacked == drop_reference
        assert any(d for d in drop_stacked.values())


def test_one_forward_per_batch_whatever_the_number_of_tasks(monkeypatch):
    counts = []
    stacked_scores = pclr_model.contribution_scores

    def counting(model, batches, adapter, forward, aggregate, **options):
        rows = []
        hook = pclr_tuner(model).model.register_forward_pre_hook(
            lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
        )
        try:
            return stacked_scores(model, batches, adapter, forward, aggregate=aggregate, **options)
        finally:
            hook.remove()
            counts.append((stored_prototypes(model).shape[0], rows))

    monkeypatch.setattr(pclr_model, "contribution_scores", counting)
    _sequence(4, "contribution")
    # two batches of 5 samples: two forward passes, of 5 rows per stored task
    assert counts == [(2, [10, 10]), (3, [15, 15]), (4, [20, 20])]


def test_stacked_routing_routes_each_copy_as_its_task_alone():
    torch.manual_seed(0)
    config = PCLRConfig(target_modules=["q_proj", "v_proj"], pool_size=16, ranks_schedule=[6], top_k=4, alpha=4.0)
    model = get_peft_model(tiny_llama(vocab_size=VOCAB, hidden_size=32), config).eval()
    protos = torch.nn.functional.normalize(torch.randn(2, 32), dim=-1)
    batch = _batches(0)[0]
    state = model.base_model.routing_state
    alone = []
    with torch.no_grad():
        for route in (protos[0], None, protos[1]):
            with routed_as(model, route):
                alone.append((model(**batch).logits, state.selections[("model.layers.0", "default")][0].clone()))
        with routed_as_tasks(model, [protos[0], None, protos[1]]):
            stacked = model(**stack_batch(batch, 3)).logits
            indices = state.selections[("model.layers.0", "default")][0]
    for t, (logits, selected) in enumerate(alone):
        torch.testing.assert_close(stacked[5 * t : 5 * (t + 1)], logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(indices[5 * t : 5 * (t + 1)], selected)
    with pytest.raises(ValueError, match="a batch of 5 rows is not 3 stacked copies"):
        with routed_as_tasks(model, [protos[0], None, protos[1]]), torch.no_grad():
            model(**batch)
    assert stack_batch(batch, 1) is batch
    stacked_batch = stack_batch({**batch, "note": "kept", "scalar": torch.tensor(1.0)}, 2)
    assert stacked_batch["input_ids"].shape == (10, 7) and stacked_batch["note"] == "kept"
    assert stacked_batch["scalar"].dim() == 0
    # the public entry point itself: both tasks measured, shares summing to one each
    for layer in (layer for layers in group_layers(model).values() for layer in layers):
        layer.store_prototype("default", 0, protos[0])
        layer.store_prototype("default", 1, protos[1])
    scores = contribution_scores(model, _batches(0))
    reference = _reference_scores(model, _batches(0))
    for group, value in scores.items():
        torch.testing.assert_close(value, reference[group], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("routing", ["tasks", "input"])
def test_the_distillation_teacher_is_the_contribution_pass(monkeypatch, routing):
    """The contribution pass runs the uncompressed pool on every batch routed as every stored task, the forward
    passes of the distillation's teacher: end_task keeps its outputs and the teacher runs none of its own, and the
    distillation ends where it ends when the teacher runs them again (to float rounding: one stacked pass)."""
    teacher_passes = []
    snapshot_active = pclr_model.PoolSnapshot.active
    teacher_outputs = pclr_model.teacher_outputs

    def counted_active(self):
        teacher_passes.append("snapshot")
        return snapshot_active(self)

    def counted_outputs(*args, **kwargs):
        teacher_passes.append("input")
        return teacher_outputs(*args, **kwargs)

    monkeypatch.setattr(pclr_model.PoolSnapshot, "active", counted_active)
    monkeypatch.setattr(pclr_model, "teacher_outputs", counted_outputs)
    model, results = _sequence(3, "contribution", routing)
    assert teacher_passes == []
    monkeypatch.setattr(pclr_model.KeptOutputs, "offer", lambda self, index, task, output: None)
    again, reference = _sequence(3, "contribution", routing)
    assert teacher_passes and set(teacher_passes) == {"snapshot" if routing == "tasks" else "input"}
    for result, want in zip(results[1:], reference[1:]):  # the schedule compresses after tasks 1 and 2
        assert result.steps == want.steps > 0 and result.task_draws == want.task_draws
        if routing == "tasks":
            torch.testing.assert_close(result.task_weights, want.task_weights, rtol=1e-4, atol=1e-6)
    for (name, value), (_, want) in zip(model.named_parameters(), again.named_parameters()):
        torch.testing.assert_close(value, want, rtol=1e-4, atol=1e-5, msg=name)


def test_copies_routed_as_a_task_take_the_shared_index_gather(monkeypatch):
    """Every row of a copy routed as a stored task has the task's prototype as query, so one selection: the layers
    compute such a copy with rank_pool_gather_shared, and the outputs are the per-row gather's."""
    model, _ = _sequence(3, "contribution")
    batch = _batches(3)[0]
    protos = stored_prototypes(model)
    routes = [
        task_route(protos, task) for task in range(protos.shape[0])
    ]  # older tasks as themselves, the last by input

    def logits():
        with torch.no_grad(), evaluating(model), routed_as_tasks(model, routes):
            return default_forward(model, stack_batch(batch, len(routes))).logits

    calls = []
    shared = pclr_layer.rank_pool_gather_shared

    def counted(x, *args):
        calls.append(x.shape[0])
        return shared(x, *args)

    def per_row(x, A, B, index, scale, gate):
        rows = x.shape[0]
        return rank_pool_gather(x, A, B, index.expand(rows, -1), scale, gate.expand(rows, -1), method="indexed")

    monkeypatch.setattr(pclr_layer, "rank_pool_gather_shared", counted)
    fast = logits()
    assert calls == [5] * 2 * 6  # two copies routed as a task, five rows each, through each of the 6 adapted linears
    monkeypatch.setattr(pclr_layer, "rank_pool_gather_shared", per_row)
    torch.testing.assert_close(fast, logits(), rtol=1e-6, atol=1e-6)
