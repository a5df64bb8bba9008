"""SplitLoRA's modules fed the same input share one accumulator of the task in progress's statistics (one sketch, one
product, one exchange per distinct input), and every module still ends with the statistics and splits it would have
kept on its own: against separate accumulators (sharing switched off), through inputs that diverge, and through a
direct ``accumulate_statistics`` call on a module that shares one. The two-process (FSDP2) counterparts are in
tests/test_fsdp2.py (``splitlora_sketch`` against ``splitlora_sketch_separate``)."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_ext import SplitLoRAConfig
from peft_ext.models import tiny_llama
from peft_ext.tuners.splitlora import SplitLoRALayer
from peft_ext.tuners.splitlora import statistics as statistics_module
from peft_ext.tuners.splitlora.sharing import _Group

from .helpers import padded_batches

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KINDS = {"dense": {"statistics": "dense"}, "sketch": {"statistics": "sketch", "sketch_rank": 8}}


def separate_accumulators():
    """Sharing switched off: every module reading an input opens a group of its own."""
    return patch.object(_Group, "matches", lambda self, *args: False)


def _layers(model: nn.Module) -> dict[str, SplitLoRALayer]:
    return {m.seed_key: m for m in model.modules() if isinstance(m, SplitLoRALayer)}


def _batches(task: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return padded_batches(task, 3, (3, 7), pad_from=5)


def _llama_cycle(kind: dict) -> tuple[dict, list, list]:
    """Two tasks of statistics and end_task (one ``collect_statistics`` block per batch, as the docs show, in the first
    task; one for all batches in the second): the running statistics, the splits, the shared groups."""
    config = SplitLoRAConfig(r=2, target_modules=TARGETS, trade_off=3.0, **kind)
    model = get_peft_model(tiny_llama(hidden_size=32, seed=0), config)
    splits, groups = [], []
    with torch.no_grad():
        for task in range(2):
            model.begin_task()
            if task == 0:
                for ids, mask in _batches(task):
                    with model.collect_statistics():
                        model(input_ids=ids, attention_mask=mask)
            else:
                with model.collect_statistics():
                    for ids, mask in _batches(task):
                        model(input_ids=ids, attention_mask=mask)
            groups.append(model.statistics_groups())
            splits.append({key: (s.k_star, s.primary) for key, s in model.end_task().items()})
    state = {k: v.clone() for k, v in model.state_dict().items() if "splitlora_" in k}
    return state, splits, groups


@pytest.mark.parametrize("kind", list(KINDS))
def test_shared_accumulators_give_the_statistics_and_splits_of_separate_ones(kind):
    shared, shared_splits, groups = _llama_cycle(KINDS[kind])
    with separate_accumulators():
        separate, separate_splits, separate_groups = _llama_cycle(KINDS[kind])
    assert shared_splits == separate_splits
    assert all(len(group) == 1 for task in separate_groups for group in task)
    qkv = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    assert all(qkv in task and len(task) == 8 for task in groups), groups  # q/k/v, o, gate/up, down per layer
    assert shared.keys() == separate.keys()
    for name, value in shared.items():
        if kind == "sketch" or "splitlora_cov" not in name:
            assert torch.equal(value, separate[name]), name  # one fd_append of the same rows: the same bits
        else:  # one product added, or multiplied into the sum in place: the rounding of one addition
            torch.testing.assert_close(value, separate[name], rtol=1e-6, atol=1e-6, msg=name)


def test_q_k_v_share_one_sketch_and_one_append_per_input():
    config = SplitLoRAConfig(r=2, target_modules=TARGETS, statistics="sketch", sketch_rank=8)
    model = get_peft_model(tiny_llama(hidden_size=32, seed=0), config)
    appends = []
    original = statistics_module.fd_append

    def spy(buffer, fill, rows, shards=None):
        appends.append(id(buffer))
        return original(buffer, fill, rows, shards)

    with patch.object(statistics_module, "fd_append", spy), torch.no_grad(), model.collect_statistics():
        for ids, mask in _batches(0):
            model(input_ids=ids, attention_mask=mask)
    layers = _layers(model)
    # 2 layers x 4 distinct inputs (q/k/v's, o's, gate/up's, down's), one append each per batch
    assert len(appends) == 3 * 2 * 4 and len(set(appends)) == 2 * 4
    attention = [layers[f"model.layers.0.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")]
    assert attention[0]._splitlora_pending["default"] is attention[1]._splitlora_pending["default"]
    assert attention[0]._splitlora_pending["default"] is attention[2]._splitlora_pending["default"]
    mlp = layers["model.layers.0.mlp.gate_proj"], layers["model.layers.0.mlp.up_proj"]
    assert mlp[0]._splitlora_pending["default"] is mlp[1]._splitlora_pending["default"]


class _Switch(nn.Module):
    """``a``, ``b`` and ``c`` read the same tensor until ``split`` is set; then ``b`` reads another one."""

    def __init__(self, n: int = 12) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(n, n) for _ in range(3))
        self.split = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(2 * x if self.split else x) + self.c(x)


def _switch_cycle(kind: dict, diverge: bool, direct: bool) -> dict:
    model = get_peft_model(_Switch(), SplitLoRAConfig(r=2, target_modules=["a", "b", "c"], **kind))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        with model.collect_statistics():
            for step in range(4):
                model.base_model.model.split = diverge and step == 2
                model(torch.randn(5, 12, generator=g))
        if direct:  # outside the hooks: on b alone
            _layers(model)["b"].accumulate_statistics("default", torch.randn(4, 12, generator=g))
        else:
            torch.randn(4, 12, generator=g)
        with model.collect_statistics():
            model(torch.randn(5, 12, generator=g))
        model.end_task()
    return {k: v.clone() for k, v in model.state_dict().items() if "splitlora_" in k}


@pytest.mark.parametrize("kind", [{"statistics": "dense"}, {"statistics": "sketch", "sketch_rank": 4}])
@pytest.mark.parametrize(("diverge", "direct"), [(True, False), (False, True), (True, True)])
def test_a_module_whose_input_diverges_keeps_its_own_statistics(kind, diverge, direct):
    """b leaves the shared accumulator when it reads another tensor (it gets a copy of the state before that
    batch), and a direct accumulate_statistics on b changes b's statistics only: as with separate accumulators."""
    shared = _switch_cycle(kind, diverge, direct)
    with separate_accumulators():
        separate = _switch_cycle(kind, diverge, direct)
    for name, value in shared.items():
        torch.testing.assert_close(value, separate[name], rtol=1e-6, atol=1e-6, msg=name)
    # a and c kept reading the same tensors, b did not
    key = "splitlora_cov" if kind["statistics"] == "dense" else "splitlora_sketch"
    a, b, c = (shared[f"base_model.model.{m}.{key}.default"] for m in "abc")
    assert torch.equal(a, c) and not torch.equal(a, b)
