"""PCLR's cycle beyond the basics: routing as a stored task, the teacher pool snapshot, task-sampled integration
(draws proportional to sqrt of the last distillation loss), the measured-contribution compression rule and the
adapter-size bound."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from peft import get_peft_model

from peft_ext import PCLRConfig
from peft_ext.continual import get_continual_method
from peft_ext.models import tiny_llama
from peft_ext.tuners.pclr import (
    PoolSnapshot,
    compress,
    contribution_scores,
    group_layers,
    integrate_over_tasks,
    routed_as,
    stored_adapter_parameters,
    stored_prototypes,
    task_route,
)

from .helpers import pclr_adapter, pclr_lm_step, run_recording_state, token_sequence

VOCAB = 128


def _model(**kwargs):
    defaults = dict(target_modules=["q_proj", "v_proj"], pool_size=16, ranks_schedule=[6], top_k=4, alpha=4.0)
    return get_peft_model(tiny_llama(vocab_size=VOCAB, hidden_size=64), PCLRConfig(**{**defaults, **kwargs}))


def _pool_layers(model) -> list:
    """Every PCLR linear of ``model``, group by group."""
    return [layer for layers in group_layers(model).values() for layer in layers]


def _batches(seed: int, low: int, high: int, n: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(low, high, (6, 6), generator=g)} for _ in range(n)]


def _logits(model, batch):
    return model(input_ids=batch["input_ids"]).logits


def _train(model, batches, steps: int = 8, lr: float = 5e-2) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    model.train()
    for step in range(steps):
        pclr_lm_step(model, model, batches[step % len(batches)]["input_ids"], optimizer)
    model.eval()


def _store_prototype(model, task_id: int, proto: torch.Tensor) -> None:
    """What end_task does first, without compressing or folding (to set up integration by hand)."""
    for layer in _pool_layers(model):
        layer.store_prototype("default", task_id, F.normalize(proto, dim=0))


def _two_tasks(model):
    """Task 0 learnt and frozen; task 1 learnt, its prototype stored, its ranks still new (not folded)."""
    tasks = [_batches(0, 0, 50), _batches(1, 70, 128)]
    proto = model.query_prototype(tasks[0])
    model.begin_task(0, proto)
    _train(model, tasks[0])
    model.end_task(0, proto, tasks[0], integrate_epochs=0)
    proto = model.query_prototype(tasks[1])
    model.begin_task(1, proto)
    _train(model, tasks[1])
    _store_prototype(model, 1, proto)
    return tasks


def _two_tasks_and_teacher(**kwargs):
    """A model (``_model(**kwargs)``) after :func:`_two_tasks`, those tasks' batches and the uncompressed pool's
    snapshot (the distillation teacher)."""
    model = _model(**kwargs)
    tasks = _two_tasks(model)
    return model, tasks, PoolSnapshot(model)


def test_routed_as_gives_every_sample_the_prototype_as_query():
    model = _model()
    tasks = _two_tasks(model)
    protos = stored_prototypes(model)
    assert protos.shape[0] == 2
    state = model.base_model.routing_state
    mixed = {"input_ids": torch.cat([tasks[0][0]["input_ids"][:3], tasks[1][0]["input_ids"][:3]])}
    with torch.no_grad():
        _logits(model, mixed)
        own = state.selections[("model.layers.0", "default")][0].clone()
        with routed_as(model, protos[0] * 3.0):  # any scale: the prototype is normalized
            routed = _logits(model, mixed)
            indices, _ = state.selections[("model.layers.0", "default")]
            torch.testing.assert_close(state.query, protos[0].expand(6, -1))
        assert (indices == indices[0]).all(), "every sample routes identically"
        assert not (own == own[0]).all(), "by their own queries the two tasks' samples route differently"
        # routed as task 0, no sample may use task 1's ranks (prototype routing with the forced query)
        tags = group_layers(model)["model.layers.0"][0].active_rank_task("default")
        assert (tags[indices] == 0).all()
        # the routing is restored after the block
        again = _logits(model, mixed)
    assert not torch.allclose(routed, again)
    torch.testing.assert_close(state.selections[("model.layers.0", "default")][0], own)
    with pytest.raises(ValueError, match="`prototype` has 3 entries but the query has width 64"):
        with routed_as(model, torch.ones(3)), torch.no_grad():
            _logits(model, mixed)


def test_task_route_routes_older_tasks_by_prototype_and_the_current_one_by_input():
    model = _model()
    tasks = _two_tasks(model)
    protos = stored_prototypes(model)
    assert torch.equal(task_route(protos, 0), protos[0])
    assert task_route(protos, 1) is None  # the last stored prototype is the current task
    torch.testing.assert_close(task_route(protos, 1, current_by_input=False), protos[1])
    for bad in (2, -1):
        with pytest.raises(ValueError, match=f"task {bad} is not among the 2 stored prototype"):
            task_route(protos, bad)
    # routed_as(None) leaves the routing alone: the same selection as no context at all
    state = model.base_model.routing_state
    with torch.no_grad():
        plain = _logits(model, tasks[1][0])
        own = state.selections[("model.layers.0", "default")][0].clone()
        with routed_as(model, None):
            again = _logits(model, tasks[1][0])
    torch.testing.assert_close(again, plain)
    torch.testing.assert_close(state.selections[("model.layers.0", "default")][0], own)


def test_pool_snapshot_runs_the_uncompressed_pool_and_restores_the_compressed_one():
    model = _model(shared_r=2)
    tasks = _two_tasks(model)
    probe = tasks[1][0]
    with torch.no_grad():
        before = _logits(model, probe)
    snapshot = PoolSnapshot(model)
    compress(model, 5, rule="index")
    params = {n: p.detach().clone() for n, p in model.named_parameters() if "pclr_" in n}
    with torch.no_grad():
        after = _logits(model, probe)
        assert not torch.allclose(before, after), "compression changes the outputs"
        with snapshot.active():
            torch.testing.assert_close(_logits(model, probe), before, atol=0, rtol=0)
        torch.testing.assert_close(_logits(model, probe), after, atol=0, rtol=0)
    for name, p in model.named_parameters():
        if name in params:
            assert torch.equal(p, params[name]), name


def test_task_sampled_integration_lowers_kl_and_draws_tasks_by_sqrt_of_their_loss():
    model, tasks, teacher = _two_tasks_and_teacher(shared_r=0)
    # "compress" only task 1's ranks. Routed as task 0 the student equals the teacher and stays equal (without a
    # shared LoRA nothing it trains reaches task 0's routing): loss 0, weight sqrt(1e-4). Routed as task 1 it does
    # not, so task 1 must be drawn far more often.
    with torch.no_grad():
        for layer in _pool_layers(model):
            layer.pclr_B["default"][:3] = 0
    result = integrate_over_tasks(
        model, tasks[1], teacher, epochs=15, lr=1e-2, generator=torch.Generator().manual_seed(0)
    )
    assert result.steps == 30 and sum(result.task_draws) == 30
    assert result.task_draws[1] >= 3 * result.task_draws[0] > 0, result.task_draws
    assert result.kl_before > 1e-4
    assert result.kl_after < 0.5 * result.kl_before, result
    assert result.task_weights[0] == pytest.approx(1e-2)  # sqrt(0 + 1e-4)
    assert result.task_weights[1] > result.task_weights[0]  # task 1 still has a loss left


def test_unmeasured_integration_trains_the_same_student_with_fewer_forwards():
    """measure=False skips the before/after passes (losses None); the steps are the same ones: the teacher outputs
    kept for the measurement serve the steps that draw the same (batch, task) pair, exactly."""
    params, calls, results = [], [], []
    for measure in (True, False):
        torch.manual_seed(0)
        model, tasks, teacher = _two_tasks_and_teacher(shared_r=2)
        compress(model, 4, rule="index")
        count = [0]

        def forward(m, batch, count=count):
            count[0] += 1
            return m(**{k: v for k, v in batch.items() if k != "labels"})

        gen = torch.Generator().manual_seed(3)
        result = integrate_over_tasks(model, tasks[1], teacher, epochs=2, forward=forward, generator=gen,
                                      measure=measure)  # fmt: skip
        results.append(result)
        calls.append(count[0])
        params.append({n: p.detach().clone() for n, p in model.named_parameters() if "pclr_" in n})
    measured, unmeasured = results
    assert unmeasured.kl_before is None and unmeasured.kl_after is None and measured.kl_before > 0
    assert measured.task_draws == unmeasured.task_draws and measured.steps == unmeasured.steps == 4
    for name, value in params[0].items():
        assert torch.equal(value, params[1][name]), name
    batches = len(tasks[1])
    reused = calls[1] - (calls[0] - 3 * batches)  # measured: +1 teacher, +1 before, +1 after per batch, minus reuse
    assert calls[1] == 2 * unmeasured.steps and 0 <= reused <= unmeasured.steps, calls


def test_end_task_measures_the_integration_only_when_asked():
    from peft_ext.tuners.pclr import PCLRCycleConfig

    for measure in (False, True):
        torch.manual_seed(0)
        model = _model(shared_r=2, pool_size=8, ranks_schedule=[4], compress_schedule=[0.5])
        batches = _batches(0, 0, 50)
        proto = model.query_prototype(batches)
        model.begin_task(0, proto)
        _train(model, batches)
        cycle = PCLRCycleConfig(integrate_epochs=1, measure_integration=measure)
        result = model.end_task(0, proto, batches, cycle=cycle)  # drops 2 of the 4 ranks, then distills
        assert (result.kl_before is None) is (not measure) and (result.kl_after is None) is (not measure)
        assert result.steps == len(batches)
    with pytest.raises(ValueError, match="`measure_integration` must be True or False, got 'yes'"):
        PCLRCycleConfig(measure_integration="yes")


def test_task_draws_are_reproducible_with_a_generator():
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        model, tasks, teacher = _two_tasks_and_teacher(shared_r=2)
        compress(model, 4, rule="index")
        result = integrate_over_tasks(model, tasks[1], teacher, epochs=3, generator=torch.Generator().manual_seed(3))
        draws.append((result.task_draws, result.kl_after))
    assert draws[0] == draws[1]


def _manual_contributions(model, batches, proto) -> dict[str, torch.Tensor]:
    """Per-group sum over linears, samples of gate * mean_t |a_i . x| * ||b_i||, with the inputs captured by hooks."""
    inputs = {}

    def capture(module, args):
        inputs[id(module)] = args[0]

    hooks = [layer.register_forward_pre_hook(capture) for layer in _pool_layers(model)]
    state = model.base_model.routing_state
    totals = {}
    try:
        with torch.no_grad(), routed_as(model, proto) if proto is not None else nullcontext():
            for batch in batches:
                _logits(model, batch)
                for group, layers in group_layers(model).items():
                    indices, gates = state.selections[(group, "default")]
                    for layer in layers:
                        A, B = layer.pool("default")
                        x = inputs[id(layer)]
                        score = torch.zeros(A.shape[0])
                        for b in range(x.shape[0]):
                            for j, i in enumerate(indices[b].tolist()):
                                size = (x[b] @ A[i]).abs().mean() * B[i].norm() * gates[b, j]
                                score[i] += size
                        totals[group] = totals.get(group, 0) + score
    finally:
        for h in hooks:
            h.remove()
    return {g: v / v.sum() for g, v in totals.items()}


def test_contribution_scores_match_a_manual_computation_and_weigh_tasks_equally():
    model = _model()
    tasks = _two_tasks(model)
    protos = stored_prototypes(model)
    scores = contribution_scores(model, tasks[1])
    # task 0 (old): the data routed as task 0; task 1 (current, its data): each sample by its own query
    manual = [_manual_contributions(model, tasks[1], protos[0]), _manual_contributions(model, tasks[1], None)]
    for group, value in scores.items():
        torch.testing.assert_close(value, manual[0][group] + manual[1][group], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(value.sum(), torch.tensor(2.0))  # each task's share sums to one
    as_before = contribution_scores(model, tasks[1], route_current_by_input=False)
    by_proto = _manual_contributions(model, tasks[1], protos[1])
    for group, value in as_before.items():
        torch.testing.assert_close(value, manual[0][group] + by_proto[group], atol=1e-5, rtol=1e-4)


def test_the_current_task_keeps_its_ranks_when_its_prototype_prefers_static_keys():
    """The failure the input routing fixes: static keys sit closer to the current task's prototype than its own
    (trained) new keys, so routed by the prototype the task selects only static ranks and its new ranks score 0
    and are dropped first; routed by the samples' own queries they are what the task uses."""
    model = _model(top_k=6)  # 6 static (task 0) + 6 new (task 1) ranks, top-6
    tasks = _two_tasks(model)
    protos = stored_prototypes(model)
    owner = group_layers(model)["model.layers.0"][0]
    state = model.base_model.routing_state
    with torch.no_grad():
        queries = F.normalize(state.query_fn(model.base_model.model, (), tasks[1][0]), dim=-1)
        for layers in group_layers(model).values():  # static keys: the prototype itself; new keys: the queries
            layers[0].pclr_keys_static["default"][:6] = protos[1]
            layers[0].pclr_keys["default"][:6] = queries[:6]
    new = list(range(6, 12))
    before = contribution_scores(model, tasks[1], route_current_by_input=False)
    assert all((value[new] == 0).all() for value in before.values())
    assert compress(copy.deepcopy(model), 6, rule="contribution", scores=before)["model.layers.0"] == new
    scores = contribution_scores(model, tasks[1])
    assert all((value[new] > 0).all() for value in scores.values()), scores  # every new rank is used
    assert owner.counts("default")[:2] == [6, 6]


def test_contribution_compression_drops_ranks_that_add_nothing():
    model = _model(top_k=12)
    tasks = _two_tasks(model)
    dead = [1, 4, 8]  # static 1 and 4 (task 0), new 2 (task 1, pool index 8)
    with torch.no_grad():
        for layer in _pool_layers(model):
            layer.pclr_B_static["default"][[1, 4]] = 0
            layer.pclr_B["default"][2] = 0
    scores = contribution_scores(model, tasks[1])
    for value in scores.values():
        assert (value[dead] == 0).all() and (value[[i for i in range(12) if i not in dead]] > 0).all()
    dropped = compress(model, 3, rule="contribution", scores=scores)
    assert all(d == dead for d in dropped.values())
    with pytest.raises(ValueError, match="no score for each of the 9 active ranks"):
        compress(model, 1, rule="contribution", scores={g: v[:3] for g, v in scores.items()})


def test_end_task_with_contribution_and_task_routing_keeps_the_cap():
    model = _model(pool_size=12, ranks_schedule=[6], compress_schedule=[0.0, 0.5], compress_rule="contribution")
    sizes = []
    for t in range(4):
        batches = _batches(t, 30 * t, 30 * t + 40)
        proto = model.query_prototype(batches)
        model.begin_task(t, proto)
        _train(model, batches, steps=2)
        result = model.end_task(
            t, proto, batches, integrate_routing="tasks", generator=torch.Generator().manual_seed(t)
        )
        sizes.append(stored_adapter_parameters(model))
        if t > 0:
            assert result is not None and len(result.task_draws) == t + 1
    # at the cap, the adapter grows by one stored prototype (query width 64) per task and layer group, nothing else
    growth = [b - a for a, b in zip(sizes[1:], sizes[2:])]
    assert growth == [64 * len(group_layers(model))] * 2, (sizes, growth)
    with pytest.raises(ValueError, match="`integrate_routing` must be one of"):
        model.end_task(4, proto, batches, integrate_routing="sample")
    with pytest.raises(ValueError, match="compress_rule='contribution' measures the ranks"):
        model.end_task(4, proto, [])


def test_stored_adapter_parameters_counts_ranks_keys_prototypes_and_shared():
    model = _model(shared_r=2)
    # tiny llama: q_proj 64 -> 64, v_proj 64 -> 32 (grouped-query kv heads) per layer; keys live on q_proj
    layers = group_layers(model)["model.layers.0"]
    widths = sum(layer.in_features + layer.out_features for layer in layers)
    per_group = 6 * widths + 2 * widths + 6 * 64  # ranks, shared LoRA, keys (no prototype yet)
    assert stored_adapter_parameters(model) == len(group_layers(model)) * per_group


@pytest.mark.slow
def test_continual_plugin_with_task_routing_records_a_bounded_adapter(monkeypatch):
    from peft_ext.tuners.pclr import PCLRModel

    seq = token_sequence(n_tasks=3)
    schedules = {"ranks_schedule": [4], "compress_schedule": [0.0, 0.5], "compress_rule": "contribution"}
    adapter = pclr_adapter(pool_size=8, top_k=4, shared_r=2, **schedules)
    cycle = {"integrate_routing": "tasks", "measure_integration": True, "key_noise": 0.125}
    method = get_continual_method("pclr")(lr=5e-3, cycle=cycle, adapter=adapter)
    noises, begin = [], PCLRModel.begin_task

    def recording_begin(self, *args, **kwargs):
        noises.append(kwargs["cycle"].key_noise)  # the run's cycle reaches begin_task (its key_noise)
        return begin(self, *args, **kwargs)

    monkeypatch.setattr(PCLRModel, "begin_task", recording_begin)
    result, captured = run_recording_state(seq, method)
    assert noises == [0.125] * 3
    assert captured["pclr_pool"] == [4, 4, 4]
    sizes = captured["pclr_adapter_params"]
    # the ranks stay at the cap; only one prototype per task and group is added
    assert len(sizes) == 3 and sizes[2] - sizes[1] == sizes[1] - sizes[0] < 0.05 * sizes[0], sizes
    assert result.extras["adapter_params"] == sizes and result.extras["pool_ranks"] == [4, 4, 4]
    kl = captured["pclr_integrate"]
    assert kl[0] is None and all(after <= before for before, after in kl[1:])
    assert result.accuracy_matrix[0][0] > 0.9
    with pytest.raises(ValueError, match="`integrate_routing` must be one of"):
        get_continual_method("pclr")(cycle={"integrate_routing": "batch"})


def test_a_non_finite_distillation_loss_is_refused():
    model, tasks, teacher = _two_tasks_and_teacher(shared_r=2)
    with torch.no_grad():
        for layer in _pool_layers(model):
            layer.pclr_B["default"][0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite PCLR distillation loss"):
        integrate_over_tasks(model, tasks[1], teacher, epochs=1)


def test_contribution_max_scores_a_rank_by_its_largest_share_of_one_task():
    model = _model()
    tasks = _two_tasks(model)
    protos = stored_prototypes(model)
    shares = [_manual_contributions(model, tasks[1], protos[0]), _manual_contributions(model, tasks[1], None)]
    scores = contribution_scores(model, tasks[1], aggregate="max")
    for group, value in scores.items():
        torch.testing.assert_close(value, torch.maximum(shares[0][group], shares[1][group]), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="`aggregate` must be 'sum' or 'max', got 'mean'"):
        contribution_scores(model, tasks[1], aggregate="mean")
    config = _model(compress_rule="contribution_max", compress_schedule=[0.5]).peft_config["default"]
    assert config.compress_rule == "contribution_max"
    with pytest.raises(ValueError, match="compress_rule='contribution_max' measures the ranks on the task's data"):
        model = _model(compress_rule="contribution_max", compress_schedule=[0.5])
        proto = model.query_prototype(tasks[0])
        model.begin_task(0, proto)
        model.end_task(0, proto)
