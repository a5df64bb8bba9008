"""PCLR: routing per sample, top-K gates, key learning, compression rules, integration, the pool cap, prototype
routing at inference, save/load mid-sequence, the continual plugin and the PEFT tuner contract."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from peft import PeftConfig, PeftModel, get_peft_model
from peft.utils import PeftType

import peft_ext
from peft_ext import PCLRConfig
from peft_ext.continual import get_continual_method
from peft_ext.models import tiny_llama
from peft_ext.tuners.pclr import (
    PCLR,
    PCLRLayer,
    compress,
    group_layers,
    importance_scores,
    integrate,
    pool_in_use,
    query_key_loss,
    query_loss,
    route,
    select_top_k,
    teacher_outputs,
)

from .helpers import pclr_adapter, run_recording_state, token_sequence, training_only
from .tuner_contract import CONTRACT_CHECKS, TunerCase

VOCAB = 128


def _llama():
    return tiny_llama(vocab_size=VOCAB, hidden_size=64)


def _config(**kwargs) -> PCLRConfig:
    defaults = dict(target_modules=["q_proj", "v_proj"], pool_size=16, ranks_schedule=[8], top_k=3, alpha=3.0)
    return PCLRConfig(**{**defaults, **kwargs})


def _ids(rows: int, tokens: int = 6, seed: int = 0, low: int = 0, high: int = VOCAB) -> torch.Tensor:
    return torch.randint(low, high, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, **kwargs):
    return model(input_ids=ids, **kwargs).logits


# -- the tuner contract -------------------------------------------------------------------------------------------


def _contract_config(identity: bool) -> PCLRConfig:
    # top_k covers the 4 ranks, so routing is static and merging is exact (routing itself is tested below)
    return _config(pool_size=8, ranks_schedule=[4], top_k=4, alpha=4.0, shared_r=2, init_weights=identity)


CASE = TunerCase(
    name="tiny_llama",
    make_model=_llama,
    make_config=_contract_config,
    make_inputs=lambda: {"input_ids": _ids(4, 7, seed=3)},
    make_optimizer=lambda model: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
    prefix="pclr_",
    quantize=("q_proj", "v_proj"),
    atol=1e-4,
)


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_tuner_contract(check, tmp_path):
    check(CASE, tmp_path)


def test_registered_with_peft():
    assert peft_ext.registered_peft_types()["pclr"] is PCLR is PeftType.PCLR
    config = _config()
    saved = {**config.to_dict(), "target_modules": ["q_proj", "v_proj"]}
    loaded = PeftConfig.from_peft_type(**json.loads(json.dumps(saved)))
    assert type(loaded) is PCLRConfig and loaded.top_k == 3 and loaded.ranks_schedule == [8]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pool_size": 0}, "`pool_size` must be a positive integer, got 0"),
        ({"top_k": 2.0}, "`top_k` must be a positive integer, got 2.0"),
        ({"ranks_schedule": [20]}, r"`ranks_schedule` gives task 0 20 new ranks, more than `pool_size`=16 can hold"),
        ({"compress_schedule": [1.0]}, r"`compress_schedule` must be .* \[0, 1\), got \[1.0\]"),
        ({"compress_rule": "magnitude"}, "`compress_rule` must be one of .*'index', 'importance'.*got 'magnitude'"),
        ({"shared_r": -1}, "`shared_r` must be a non-negative integer"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _config(**kwargs)


def test_merge_refuses_input_dependent_routing():
    model = get_peft_model(_llama(), _config(init_weights=False))  # top_k 3 of 8 ranks
    with pytest.raises(ValueError, match="routes each input to its own 3 of 8 ranks"):
        model.merge_adapter()


# -- routing -------------------------------------------------------------------------------------------------------


def test_layers_of_a_block_share_one_key_set_and_selection():
    model = get_peft_model(_llama(), _config(init_weights=False))
    groups = group_layers(model)
    assert sorted(groups) == ["model.layers.0", "model.layers.1"]
    for layers in groups.values():
        assert len(layers) == 2 and layers[0].owns_keys("default") and not layers[1].owns_keys("default")
        assert "default" in layers[0].pclr_keys and "default" not in layers[1].pclr_keys
    model(input_ids=_ids(5))
    assert set(model.base_model.routing_state.selections) == {(g, "default") for g in groups}


def test_hard_gates_select_exactly_k_per_sample_and_output_matches_manual_sum():
    model = get_peft_model(_llama(), _config(init_weights=False)).eval()
    ids = _ids(5)
    with torch.no_grad():
        model(input_ids=ids)
    state = model.base_model.routing_state
    layer = group_layers(model)["model.layers.0"][0]
    indices, gates = state.selections[("model.layers.0", "default")]
    assert indices.shape == (5, 3) and torch.equal(gates, torch.ones(5, 3))
    assert all(len(set(row.tolist())) == 3 for row in indices)
    # the selection is the top-3 by cosine between the normalized mean input embedding and the keys
    emb = model.get_input_embeddings()(ids).mean(1)
    scores = F.normalize(emb, dim=-1) @ F.normalize(layer.keys("default").detach(), dim=-1).T
    assert torch.equal(indices.sort(1).values, scores.topk(3).indices.sort(1).values)
    assert len({tuple(sorted(r.tolist())) for r in indices}) > 1, "samples should route differently"
    # the layer's adapter output equals the manual sum of the selected rank-1 terms
    x = torch.randn(5, 4, 64)
    A, B = layer.pool("default")
    with torch.no_grad():
        got = layer(x) - layer.base_layer(x)
        want = torch.stack(
            [
                sum(torch.outer(x[b] @ A[i], B[i]) for i in indices[b].tolist()) * layer.pclr_scale["default"]
                for b in range(5)
            ]
        )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_select_top_k_masks_and_gates_slots_without_allowed_ranks():
    query = F.normalize(torch.randn(2, 4), dim=-1)
    keys = F.normalize(torch.randn(5, 4), dim=-1)
    allowed = torch.tensor([[True, False, False, False, True], [True] * 5])
    indices, gates = select_top_k(query, keys, 3, allowed)
    assert set(indices[0, :2].tolist()) == {0, 4} and gates[0].tolist() == [1.0, 1.0, 0.0]
    assert gates[1].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("masked", [False, True])
def test_route_equals_select_top_k_and_query_key_loss(masked):
    # the layer's one-pass routing against the two references: same selection, same loss and key gradients
    g = torch.Generator().manual_seed(0)
    query = F.normalize(torch.randn(4, 8, generator=g), dim=-1)
    keys = torch.randn(12, 8, generator=g).requires_grad_()
    allowed = torch.rand(4, 12, generator=g) > 0.6 if masked else None
    allowed = None if allowed is None else allowed | torch.eye(4, 12, dtype=torch.bool)  # >= 1 rank per sample
    indices, gates, loss = route(query, keys, 5, allowed)
    (grad,) = torch.autograd.grad(loss, keys)
    want_indices, want_gates = select_top_k(query, keys, 5, allowed)
    want_loss = query_key_loss(query, keys, want_indices, want_gates)
    (want_grad,) = torch.autograd.grad(want_loss, keys)
    assert torch.equal(indices, want_indices) and torch.equal(gates, want_gates)
    assert masked == bool((gates == 0).any())
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)
    with torch.no_grad():  # no loss without gradients (nor for frozen keys)
        assert route(query, keys, 5, allowed)[2] is None
    assert route(query, keys.detach(), 5, allowed)[2] is None


def test_per_sample_routing_in_a_mixed_batch_equals_each_sample_alone():
    model = get_peft_model(_llama(), _config(init_weights=False)).eval()
    ids = torch.cat([_ids(3, seed=1, high=40), _ids(3, seed=2, low=80)])  # two "tasks" with disjoint vocabularies
    with torch.no_grad():
        batch = _logits(model, ids)
        selections = model.base_model.routing_state.selections[("model.layers.0", "default")][0]
        alone = torch.cat([_logits(model, ids[i : i + 1]) for i in range(len(ids))])
    assert len({tuple(sorted(r.tolist())) for r in selections}) > 1
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=1e-4)


def test_keys_learn_only_through_the_query_loss():
    model = get_peft_model(_llama(), _config(init_weights=False))
    owner = group_layers(model)["model.layers.0"][0]
    keys = owner.pclr_keys["default"]
    ids = _ids(8, seed=4)
    _logits(model, ids).pow(2).mean().backward()
    assert keys.grad is None or keys.grad.abs().max() == 0, "the task loss must not reach the keys (hard gates)"
    optimizer = torch.optim.Adam([keys], lr=0.05)

    def alignment() -> float:
        _logits(model, ids)  # with grad enabled: the query loss is only recorded when keys can learn
        return 1 - float(query_loss(model).detach()) / model.peft_config["default"].query_loss_weight

    before = alignment()
    for _ in range(20):
        optimizer.zero_grad()
        _logits(model, ids)
        query_loss(model).backward()
        optimizer.step()
    after = alignment()
    assert after > before + 0.1, (before, after)


# -- compression ---------------------------------------------------------------------------------------------------


def _set_norms(model, norms: list[float]) -> None:
    """Give rank i of every linear ||a_i|| = 1 and ||b_i|| = norms[i] (distinct directions)."""
    with torch.no_grad():
        for layers in group_layers(model).values():
            for layer in layers:
                A, B = layer.pclr_A["default"], layer.pclr_B["default"]
                for i, n in enumerate(norms):
                    A[i] = F.normalize(torch.randn(A.shape[1]), dim=0)
                    B[i] = F.normalize(torch.randn(B.shape[1]), dim=0) * n


def test_importance_compression_keeps_the_highest_importance_ranks():
    model = get_peft_model(_llama(), _config())
    norms = [0.5, 3.0, 0.1, 2.0, 1.0, 0.2, 4.0, 0.3]
    _set_norms(model, norms)
    layers = group_layers(model)["model.layers.0"]
    before_A = layers[1].pclr_A["default"][:8].detach().clone()
    before_keys = layers[0].pclr_keys["default"][:8].detach().clone()
    dropped = compress(model, 3, rule="importance")
    assert dropped["model.layers.0"] == [2, 5, 7]  # norms 0.1, 0.2, 0.3
    kept = [0, 1, 3, 4, 6]
    assert layers[1].counts("default")[:2] == [0, 5]
    torch.testing.assert_close(layers[1].pclr_A["default"][:5], before_A[kept])
    torch.testing.assert_close(layers[0].pclr_keys["default"][:5], before_keys[kept])
    assert importance_scores(layers, "default").min() > 0.3 * 2 * 0.99


def test_index_compression_drops_every_s_th_rank():
    model = get_peft_model(_llama(), _config())
    _set_norms(model, [float(i + 1) for i in range(8)])
    dropped = compress(model, 2, rule="index")
    assert dropped["model.layers.0"] == [3, 7]  # s = 4: 25 % of 8
    norms = importance_scores(group_layers(model)["model.layers.0"], "default") / 2
    torch.testing.assert_close(norms, torch.tensor([1.0, 2.0, 3.0, 5.0, 6.0, 7.0]))


# -- the cycle -----------------------------------------------------------------------------------------------------


def _task_batches(seed: int, low: int, high: int, n: int = 2) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": _ids(6, seed=seed * 10 + i, low=low, high=high)} for i in range(n)]


def _train(model, batches, steps: int = 6, lr: float = 5e-2) -> None:
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    model.train()
    for step in range(steps):
        batch = batches[step % len(batches)]
        logits = _logits(model, batch["input_ids"])
        # next-token prediction on the task's tokens
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["input_ids"][:, 1:].reshape(-1))
        loss = loss + query_loss(model)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def _run_task(model, t: int, batches, integrate_epochs: int = 1):
    proto = model.query_prototype(batches)
    model.begin_task(t, proto)
    _train(model, batches)
    return model.end_task(t, proto, batches, integrate_epochs=integrate_epochs, integrate_lr=1e-2)


def test_pool_never_exceeds_its_cap_across_a_long_sequence():
    config = _config(pool_size=12, ranks_schedule=[5, 5, 3], compress_schedule=[0.0, 0.1], shared_r=2)
    model = get_peft_model(_llama(), config)
    sizes = []
    for t in range(10):
        batches = _task_batches(t, low=(t * 12) % 100, high=(t * 12) % 100 + 28, n=1)
        proto = model.query_prototype(batches)
        model.begin_task(t, proto)
        sizes.append(pool_in_use(model))
        _train(model, batches, steps=1)
        model.end_task(t, proto, batches, integrate_epochs=0)
        sizes.append(pool_in_use(model))
    assert max(sizes) == 12, sizes  # the cap is reached (compression is exercised) ...
    assert all(s <= 12 for s in sizes)  # ... and never exceeded
    layer = next(iter(group_layers(model).values()))[0]
    assert layer.counts("default")[2:] == [10, 10]  # 10 prototypes stored, next task is 10


def test_integration_lowers_the_teacher_student_kl():
    model = get_peft_model(_llama(), _config(pool_size=16, ranks_schedule=[8], top_k=8, shared_r=4))
    batches = _task_batches(0, 0, 60)
    proto = model.query_prototype(batches)
    model.begin_task(0, proto)
    _train(model, batches, steps=10)
    teacher = teacher_outputs(model, batches)
    compress(model, 4, rule="index")
    result = integrate(model, batches, teacher, epochs=15, lr=1e-2)
    assert result.kl_before > 1e-4, "compression should change the outputs"
    assert result.kl_after < 0.5 * result.kl_before, result
    assert result.steps == 30


def test_inference_routes_by_the_nearest_prototype():
    model = get_peft_model(_llama(), _config(pool_size=18, ranks_schedule=[6], top_k=4))
    tasks = [_task_batches(0, 0, 40), _task_batches(1, 80, 128)]
    for t, batches in enumerate(tasks):
        _run_task(model, t, batches, integrate_epochs=0)
    layer = group_layers(model)["model.layers.0"][0]
    tags = layer.active_rank_task("default")
    assert tags.tolist() == [0] * 6 + [1] * 6
    state = model.base_model.routing_state
    with torch.no_grad():
        for t, batches in enumerate(tasks):
            _logits(model, batches[0]["input_ids"])
            indices, gates = state.selections[("model.layers.0", "default")]
            used = tags[indices][gates.bool()]
            if t == 0:
                assert (used == 0).all(), "task-0 inputs must not use the later task's ranks"
            else:
                assert (used == 1).any()
    # without prototype routing the task-0 inputs may pick task-1 ranks: the restriction is what makes the difference
    for layers in group_layers(model).values():
        for lyr in layers:
            lyr.pclr_prototype_routing["default"] = False
    with torch.no_grad():
        outputs = [_logits(model, batches[0]["input_ids"]) for batches in tasks]
    assert all(torch.isfinite(o).all() for o in outputs)


def test_save_load_in_the_middle_of_a_sequence_continues_identically(tmp_path):
    config = _config(pool_size=12, ranks_schedule=[4], compress_schedule=[0.0, 0.25], shared_r=2)
    tasks = [_task_batches(t, 30 * t, 30 * t + 40) for t in range(3)]
    model = get_peft_model(_llama(), config)
    for t in range(2):
        _run_task(model, t, tasks[t])
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(_llama(), tmp_path, is_trainable=True)
    probe = tasks[0][0]["input_ids"]
    torch.testing.assert_close(_logits(loaded.eval(), probe), _logits(model.eval(), probe), atol=0, rtol=0)
    finals = []
    for m in (model, loaded):
        torch.manual_seed(7)
        _run_task(m, 2, tasks[2])
        with torch.no_grad():
            finals.append(torch.cat([_logits(m, task[0]["input_ids"]) for task in tasks]))
    torch.testing.assert_close(finals[0], finals[1], atol=1e-5, rtol=1e-5)
    layer = group_layers(loaded)["model.layers.0"][0]
    # 4 ranks, then 8 - 25 % = 6, then 6 + 4 - 25 % (rounded) = 8 static ranks; 3 prototypes; task 3 next
    assert layer.counts("default") == [8, 0, 3, 3]


def test_begin_task_out_of_order_is_refused():
    model = get_peft_model(_llama(), _config())
    proto = model.query_prototype(_task_batches(0, 0, 40))
    with pytest.raises(ValueError, match=r"begin_task\(1\) but the adapter expects task 0"):
        model.begin_task(1, proto)
    with pytest.raises(ValueError, match="`prototype` has 3 entries but the keys have width 64"):
        model.begin_task(0, torch.ones(3))


@pytest.mark.parametrize("width", [64, 384])
def test_new_keys_sit_at_the_relative_noise_from_the_prototype(width):
    """key_noise is relative to the unit prototype: a new key's cosine to it is about 1 / sqrt(1 + noise^2) at any
    query width. (It used to be per coordinate: cosine 0.71 at width 384, and the new keys lost the top-k to the
    trained static keys.)"""
    config = _config(pool_size=32, ranks_schedule=[16], top_k=4)
    proto = get_peft_model(tiny_llama(vocab_size=VOCAB, hidden_size=width), config).query_prototype(
        _task_batches(0, 0, 40)
    )
    for noise, low, high in ((0.05, 0.997, 0.9999), (0.3, 0.93, 0.98), (0.0, 1 - 1e-6, 1 + 1e-6)):
        model = get_peft_model(tiny_llama(vocab_size=VOCAB, hidden_size=width), copy.deepcopy(config))
        torch.manual_seed(0)
        model.begin_task(0, proto, key_noise=noise)
        keys = next(iter(group_layers(model).values()))[0].keys("default")
        cos = F.normalize(keys.float(), dim=-1) @ F.normalize(proto.float(), dim=0)
        assert keys.shape == (16, width)
        assert low < cos.mean() < high, (noise, cos)
        if noise > 0:
            assert torch.linalg.matrix_rank(keys.float() - keys[0].float()) > 1  # not tied


# -- the continual plugin ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_continual_plugin_runs_a_sequence_within_the_cap():
    seq = token_sequence(n_tasks=3)
    adapter = pclr_adapter(pool_size=12, ranks_schedule=[4], compress_schedule=[0.0, 0.25], top_k=4, shared_r=2)
    method = get_continual_method("pclr")(lr=5e-3, adapter=adapter)
    result, captured = run_recording_state(seq, method)
    assert captured["pclr_pool"] == [4, 6, 8]  # 4; 4 + 4 less 25 % = 6; 6 + 4 less 25 % (rounded) = 8
    assert captured["pclr_integrate"][0] is None and captured["pclr_integrate"][1] is not None
    assert all(row[i] is not None for i, row in enumerate(result.accuracy_matrix))
    # the pool itself learns: with the head frozen at its random init, the first task is learnt through the adapter
    # alone (a trained head separates these token classes by itself); with the pool's factors frozen too (its keys
    # still train) it is not
    for pool_trains, low, high in ((True, 0.9, 1.0), (False, 0.0, 0.75)):
        method = training_only(
            get_continual_method("pclr")(lr=5e-3, adapter=adapter),
            head=False,
            adapter=pool_trains,
            adapter_markers=("pclr_A", "pclr_B"),
        )
        run = run_recording_state(token_sequence(n_tasks=1, per_class=40), method, epochs=5)[0]
        assert low <= run.accuracy_matrix[0][0] <= high, (pool_trains, run.accuracy_matrix)  # measured: 1.0 / 0.575


def test_plugin_options_are_validated():
    with pytest.raises(ValueError, match="`top_k` must be a positive integer, got 0"):
        get_continual_method("pclr")(adapter={"top_k": 0})
    with pytest.raises(ValueError, match="`integrate_epochs` must be >= 0, got -1"):
        get_continual_method("pclr")(cycle={"integrate_epochs": -1})


def test_plugin_cycle_section_is_the_cycle_config_and_old_flat_keys_move_into_it():
    from peft_ext.continual.config import ConfigError, config_from_dict
    from peft_ext.tuners.pclr import PCLRCycleConfig

    options = get_continual_method("pclr")().options
    assert options.cycle == PCLRCycleConfig()  # one default per setting: the cycle config's own
    base = {"data": {"dataset": "wordnet"}, "methods": []}
    doc = {**base, "methods": [{"name": "pclr", "cycle": {"integrate_epochs": 0, "integrate_routing": "tasks"}}]}
    cycle = config_from_dict(doc).methods[0].options.cycle
    assert isinstance(cycle, PCLRCycleConfig) and cycle.integrate_epochs == 0 and cycle.integrate_routing == "tasks"
    with pytest.warns(DeprecationWarning, match=r"write `cycle: \{integrate_epochs: 0\}`"):
        flat = config_from_dict({**base, "methods": [{"name": "pclr", "integrate_epochs": 0}]})
    assert flat.methods[0].options.cycle.integrate_epochs == 0
    with pytest.raises(ConfigError, match=r"`methods\[0\]\.cycle\.temperature` must be > 0"):
        config_from_dict({**base, "methods": [{"name": "pclr", "cycle": {"temperature": 0.0}}]})
    with pytest.raises(ConfigError, match=r"unknown key `methods\[0\]\.cycle\.epochs`"):
        config_from_dict({**base, "methods": [{"name": "pclr", "cycle": {"epochs": 1}}]})


def test_pclr_layer_is_exported():
    assert issubclass(peft_ext.tuners.pclr.Linear, PCLRLayer)


def test_an_adapter_on_part_of_a_block_owns_its_own_keys():
    model = get_peft_model(_llama(), _config(init_weights=False))
    model.add_adapter("v_only", _config(target_modules=["v_proj"], init_weights=False))
    model.set_adapter("v_only")
    layers = group_layers(model, "v_only")["model.layers.0"]
    assert len(layers) == 1 and layers[0].owns_keys("v_only") and "v_only" in layers[0].pclr_keys
    with torch.no_grad():
        out = _logits(model.eval(), _ids(3))
    assert torch.isfinite(out).all()


def test_deepcopy_gets_its_own_routing_state():
    import copy

    model = get_peft_model(_llama(), _config(init_weights=False)).eval()
    ids = _ids(3)
    with torch.no_grad():
        expected = _logits(model, ids)
        clone = copy.deepcopy(model)
        got = _logits(clone, ids)
    state = clone.base_model.routing_state
    assert state is not model.base_model.routing_state
    assert all(layer._pclr_state is state for layer in clone.modules() if isinstance(layer, PCLRLayer))
    assert all(owner in set(clone.modules()) for owner in state.owners.values())
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_a_user_supplied_query_function_decides_the_routing():
    model = get_peft_model(_llama(), _config(init_weights=False)).eval()
    owner = group_layers(model)["model.layers.0"][0]
    keys = owner.keys("default").detach()
    calls = []

    def query_fn(base, args, kwargs):
        calls.append(kwargs["input_ids"].shape)
        # every sample queries with key 5 itself: key 5 must be selected for every sample
        return keys[5].expand(kwargs["input_ids"].shape[0], -1)

    model.base_model.set_query_fn(query_fn)
    with torch.no_grad():
        _logits(model, _ids(4))
    indices, _ = model.base_model.routing_state.selections[("model.layers.0", "default")]
    assert calls == [(4, 6)], "the query is computed once per forward pass"
    assert (indices == 5).any(1).all()
    with pytest.raises(TypeError, match="`query_fn` must be callable, got int"):
        model.base_model.set_query_fn(3)
