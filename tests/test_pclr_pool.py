"""PCLR's pool API and task-cycle methods: the layer's own rules, host-side counts restored on load, the forward
reading the static and new stores in place without host syncs, and ``PCLRModel.begin_task`` / ``end_task``."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from peft_ext import PCLRConfig
from peft_ext.kernels import rank_pool_gather
from peft_ext.models import tiny_llama
from peft_ext.tuners.pclr import PCLRCycleConfig, PCLRLayer, group_layers

from .helpers import pclr_lm_step

VOCAB = 128


def _model(**kwargs):
    defaults = dict(target_modules=["q_proj", "v_proj"], pool_size=16, ranks_schedule=[6], top_k=4, alpha=4.0)
    return get_peft_model(tiny_llama(vocab_size=VOCAB, hidden_size=64), PCLRConfig(**{**defaults, **kwargs}))


def _batches(seed: int, low: int, high: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(low, high, (6, 6), generator=g)} for _ in range(2)]


def _task(model, t: int, batches, train: bool = True) -> None:
    proto = model.query_prototype(batches)
    model.begin_task(t, proto)
    if train:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
        for batch in batches:
            pclr_lm_step(model, model, batch["input_ids"], optimizer)
    model.end_task(t, proto, batches, integrate_epochs=0)


def _static_and_new(model):
    """Task 0 folded into the static pool, task 1's ranks new (trained: nonzero b_i)."""
    _task(model, 0, _batches(0, 0, 60))
    tasks = _batches(1, 60, 128)
    model.begin_task(1, model.query_prototype(tasks))
    with torch.no_grad():
        for layers in group_layers(model).values():
            for layer in layers:
                layer.pclr_B["default"].normal_()
    return tasks


def test_forward_reads_both_stores_in_place_and_equals_the_gather_over_the_concatenated_pool():
    model = _model(top_k=8).eval()
    _static_and_new(model)
    layer = group_layers(model)["model.layers.0"][1]
    assert layer.counts("default")[:2] == [6, 6]
    x = torch.randn(6, 6, 64)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (6, 6)))
        indices, gates = model.base_model.routing_state.selections[("model.layers.0", "default")]
        assert (indices < 6).any() and (indices >= 6).any(), "the selection should mix static and new ranks"
        got = layer(x) - layer.base_layer(x)
        A, B = layer.pool("default")
        want = rank_pool_gather(x, A.mT, B, indices, layer.pclr_scale["default"], gates)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # the in-place views are views: no copy of the stores
    A_s, _ = layer.static_ranks("default")
    assert A_s.data_ptr() == layer.pclr_A_static["default"].data_ptr()


def test_the_forward_reads_nothing_back_to_the_host(monkeypatch):
    model = _model().eval()
    tasks = _static_and_new(model)
    inside = []

    def enter(*_):
        inside.append(True)

    def leave(*_):
        inside.pop()

    for module in model.modules():
        if isinstance(module, PCLRLayer):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)

    def refuse(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if inside:
                raise AssertionError(f"Tensor.{name} inside a PCLR layer's forward")
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("tolist", "item", "__int__", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    with torch.no_grad():
        out = model(input_ids=tasks[0]["input_ids"]).logits
    assert torch.isfinite(out).all()


def test_counts_live_on_the_host_and_load_state_dict_restores_them():
    model = _model()
    _task(model, 0, _batches(0, 0, 60), train=False)
    layer = group_layers(model)["model.layers.0"][0]
    assert layer.counts("default") == [6, 0, 1, 1]
    assert layer.pclr_counts["default"].tolist() == layer.counts("default")  # the checkpoint mirror
    fresh = _model()
    fresh_layer = group_layers(fresh)["model.layers.0"][0]
    assert fresh_layer.counts("default") == [0, 6, 0, 0]
    fresh.load_state_dict(model.state_dict())
    assert fresh_layer.counts("default") == [6, 0, 1, 1]
    assert fresh.base_model.finished_tasks() == 1


def test_the_pool_api_enforces_its_rules():
    model = _model()
    owner, other = group_layers(model)["model.layers.0"]
    keys = torch.randn(3, 64)
    with pytest.raises(ValueError, match="the group owner takes the new ranks' keys"):
        owner.begin_new_ranks("default", 0, torch.randn(3, 64))
    with pytest.raises(ValueError, match="the group owner takes the new ranks' keys"):
        other.begin_new_ranks("default", 0, torch.randn(3, 64), keys)
    with pytest.raises(ValueError, match="7 new ranks do not fit: new capacity 6"):
        owner.begin_new_ranks("default", 0, torch.randn(7, 64), torch.randn(7, 64))
    with pytest.raises(ValueError, match=r"rank indices \[6\] are outside the 6 active ranks"):
        other.drop_ranks("default", [6])
    with pytest.raises(ValueError, match="does not own its group's keys"):
        other.set_static_keys("default", torch.zeros(0, 64))
    with pytest.raises(ValueError, match=r"end_task\(2\) but the adapter is learning task 0"):
        other.finish_task("default", 2)
    other.begin_new_ranks("default", 0, torch.ones(2, 64))
    assert other.counts("default")[:2] == [0, 2] and other.pclr_counts["default"].tolist()[:2] == [0, 2]
    other.drop_ranks("default", [0])
    other.fold_new_ranks("default")
    assert other.counts("default")[:2] == [1, 0]
    assert other.active_rank_task("default").tolist() == [0]


def test_task_cycle_methods_and_settings():
    model = _model()
    tuner = model.base_model
    assert model.finished_tasks() == 0
    _task(model, 0, _batches(0, 0, 60), train=False)
    assert model.finished_tasks() == 1
    assert model.task_state() == {g: {"static": 6, "new": 0, "prototypes": 1, "task": 1} for g in group_layers(model)}
    batches = _batches(1, 60, 128)
    proto = tuner.query_prototype(batches)
    assert tuner.begin_task(1, proto) == 6
    with pytest.raises(TypeError, match=r"unknown task-cycle setting\(s\) \['integrate_epoch'\]"):
        model.end_task(1, proto, batches, integrate_epoch=0)
    with pytest.raises(ValueError, match="`key_pull_strength` must be in"):
        model.end_task(1, proto, batches, cycle=PCLRCycleConfig(key_pull_strength=2.0))
    with pytest.raises(ValueError, match="no adapter named 'other'"):
        model.end_task(1, proto, batches, adapter_name="other")
    assert model.end_task(1, proto, batches, cycle=PCLRCycleConfig(integrate_epochs=0)) is None
    assert model.finished_tasks() == 2
    with pytest.raises(ValueError, match="`integrate_routing` must be one of"):
        PCLRCycleConfig(integrate_routing="batch")
