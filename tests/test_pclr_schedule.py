"""PCLR's pool / top_k / ranks_schedule checks: conflicts are refused at construction in the user's terms,
and a schedule that fills the pool with task 0 runs a two-task cycle, compressing to make room for task 1."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from peft_ext import PCLRConfig
from peft_ext.models import tiny_llama
from peft_ext.tuners.pclr import group_layers
from peft_ext.tuners.pclr.scoring import drop_count

from .helpers import pclr_lm_step

TARGETS = ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # a crash before these checks: task 1's 32 ranks would need every rank of task 0 dropped
        (
            {"pool_size": 32, "ranks_schedule": [32], "top_k": 16},
            r"^`ranks_schedule` gives task 1 32 new ranks, which fill `pool_size`=32: .* must be < pool_size\); "
            r"set `ranks_schedule`, e.g. ranks_schedule=\[16\] or raise pool_size to >= 33$",
        ),
        (
            {"pool_size": 16, "ranks_schedule": [8, 16], "top_k": 4},
            r"^`ranks_schedule` gives task 1 16 new ranks, which fill `pool_size`=16",
        ),
        (
            {"pool_size": 16, "ranks_schedule": [20], "top_k": 4},
            r"^`ranks_schedule` gives task 0 20 new ranks, more than `pool_size`=16 can hold .* pool_size to >= 20$",
        ),
        (
            {"top_k": 16, "pool_size": 8, "ranks_schedule": [4]},
            r"^`top_k`=16 exceeds `pool_size`=8: .* set top_k <= 8 or pool_size >= 16$",
        ),
        # the user set only pool_size: both conflicting values are the defaults, and the message says so
        ({"pool_size": 8}, r"^the default `top_k`=64 \(used when top_k is not set\) exceeds `pool_size`=8"),
        (
            {"pool_size": 8, "top_k": 4},
            r"^the default `ranks_schedule` \(\[64, 64, 64, 64, 64, 32\], used when not set\) gives task 0 64 new "
            r"ranks, more than `pool_size`=8 can hold .*; set `ranks_schedule`, e.g. ranks_schedule=\[4\]",
        ),
        ({"pool_size": 16, "ranks_schedule": [4, 0], "top_k": 4}, r"must be a non-empty list of positive integers"),
        ({"pool_size": 16, "ranks_schedule": [], "top_k": 4}, r"must be a non-empty list of positive integers"),
    ],
)
def test_config_refuses_pool_conflicts_in_the_users_terms(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PCLRConfig(target_modules=TARGETS, **kwargs)


def test_task_zero_may_fill_the_pool_and_top_k_may_equal_it():
    config = PCLRConfig(target_modules=TARGETS, pool_size=16, ranks_schedule=[16, 15], top_k=16)
    assert config.ranks_for_task(0) == 16 and config.ranks_for_task(5) == 15


def test_drop_count_makes_room_but_never_drops_every_rank():
    config = PCLRConfig(target_modules=TARGETS, pool_size=8, ranks_schedule=[8, 6], compress_schedule=[0.9], top_k=2)
    assert drop_count(config, 0, 8) == 7  # round(0.9 * 8) = 7 (also makes room for task 1's 6: 8 + 6 - 8 = 6)
    assert drop_count(config, 3, 1) == 0  # round(0.9 * 1) = 1 would empty the pool
    assert drop_count(config, 0, 0) == 0
    config.pool_size = 6  # changed after the checks: task 1's 6 ranks no longer leave room for any earlier rank
    with pytest.raises(ValueError, match=r"task 1 needs 6 new ranks but `pool_size`=6: .* drop all 4 ranks"):
        drop_count(config, 0, 4)


def _train(model, batches, steps: int = 4) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    model.train()
    for step in range(steps):
        pclr_lm_step(model, model, batches[step % len(batches)], optimizer)
    model.eval()


def test_two_task_cycle_with_task_zero_filling_the_pool():
    """pool_size 32, task 0 takes all 32 ranks: each end_task compresses to make room for the next task's 16 ranks
    (static + new never exceed the cap), keeping ranks of every finished task for routing."""
    torch.manual_seed(0)
    config = PCLRConfig(target_modules=TARGETS, pool_size=32, ranks_schedule=[32, 16], top_k=8, compress_rule="index")
    model = get_peft_model(tiny_llama(vocab_size=128, hidden_size=64), config)
    g = torch.Generator().manual_seed(0)
    tasks = [[torch.randint(lo, hi, (4, 6), generator=g) for _ in range(2)] for lo, hi in ((0, 50), (70, 128))]
    layers = [layer for group in group_layers(model).values() for layer in group]
    seen = []
    for t, batches in enumerate(tasks):
        data = [{"input_ids": ids} for ids in batches]
        proto = model.query_prototype(data)
        assert model.begin_task(t, proto) == config.ranks_for_task(t)
        seen.append({tuple(layer.counts("default")[:2]) for layer in layers})
        _train(model, batches)
        model.end_task(t, proto, data, integrate_epochs=1)
        seen.append({tuple(layer.counts("default")[:2]) for layer in layers})
    # (static, new): task 0 fills the pool; end_task drops 16 (32 + 16 - 32) so task 1's 16 fit, twice
    assert seen == [{(0, 32)}, {(16, 0)}, {(16, 16)}, {(16, 0)}]
    tags = layers[0].pclr_rank_task["default"][:16].tolist()
    assert tags.count(0) == 8 and tags.count(1) == 8  # the index rule drops every other rank of both tasks
    assert model.finished_tasks() == 2
    assert torch.isfinite(model(input_ids=tasks[1][0]).logits).all()
