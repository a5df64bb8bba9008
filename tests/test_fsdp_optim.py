"""The Riemannion and DCT-AdamW optimizers under FSDP2 (``fully_shard``): ``torchrun --nproc_per_node=2``, gloo, CPU.

Two ranks, each on its half of every batch, equal one process on the whole batches to fp32 tolerance after several
steps and a save / load of each rank's state in the middle (tests/workers/fsdp_optim.py); DCT-AdamW's moments are
split by rows (each rank holds about half of one process's). Riemannion's step gathers every adapter in one
collective (counted, for 1 and 14 adapters), bit for bit as a gather per tensor would. One torchrun launch for the
module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import get_peft_model

from peft_ext import RiemannionConfig
from peft_ext.models import tiny_llama
from peft_ext.tuners.riemannion import find_adapters

from .helpers import torchrun_ranks
from .single_thread import one_thread, single_thread  # noqa: F401  (fixture)
from .workers import fsdp_optim as worker

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("single_thread")]

ROOT = Path(__file__).resolve().parents[1]
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun_ranks(ROOT / "tests" / "workers" / "fsdp_optim.py", tmp_path_factory.mktemp("fsdp"), pytest.fail)


@pytest.fixture(scope="module")
def single():
    with one_thread():
        return {name: case(slice(None), shard=False) for name, case in worker.CASES.items()}


def test_riemannion_two_shards_equal_one_process(ranks, single):
    one = single["riemannion"]
    for rank in ranks:
        assert rank["world"] == 2 and rank["riemannion"]["contiguous"]
        for layer, X in one["points"].items():
            torch.testing.assert_close(rank["riemannion"]["points"][layer], X, **TOL, msg=layer)
        # the points agree to 1e-6; two decoder layers on top of them round further
        torch.testing.assert_close(rank["riemannion"]["logits"], one["logits"], rtol=1e-5, atol=1e-5)
    # each rank steps, and keeps the momentum of, the adapters it owns (whole groups of same-shaped adapters): the
    # two hold one process's momentum between them, each a share of it
    held = [rank["riemannion"]["state_bytes"] for rank in ranks]
    assert sum(held) == one["state_bytes"] and all(0 < h < one["state_bytes"] for h in held), (held, one)


@pytest.mark.parametrize("case", ["lora_dct", "full_dct", "full_power_channel"])
def test_dct_adamw_row_shards_equal_one_process(ranks, single, case):
    one = single[case]
    for rank in ranks:
        if case == "full_power_channel":
            # the tracked basis: a QR of a sum taken in another order (over two shards) moves it by ~1e-5
            basis, expected = torch.tensor(rank[case]["indices"]), torch.tensor(one["indices"])
            torch.testing.assert_close(basis, expected, rtol=1e-3, atol=5e-5)
        else:
            assert rank[case]["indices"] == one["indices"], "every rank must select the columns one process selects"
        # the power basis carries that ~1e-5 into the weights (measured: 1.6e-6 on entries of 0.16)
        tol = {"rtol": 1e-4, "atol": 1e-5} if case == "full_power_channel" else TOL
        for name, value in one["state"].items():
            torch.testing.assert_close(rank[case]["state"][name], value, **tol, msg=name)


@pytest.mark.parametrize("case", ["lora_dct", "full_dct"])
def test_dct_adamw_moments_are_split_by_rows(ranks, single, case):
    per_rank = [rank[case]["state_bytes"] for rank in ranks]
    whole = single[case]["state_bytes"]
    # rows split 23 + 22 (full_dct's first weight) or 3 + 2 (LoRA A with r = 5); the column indices are replicated
    assert abs(sum(per_rank) - whole) <= 0.05 * whole, (per_rank, whole)
    for part in per_rank:
        assert 0.4 * whole < part < 0.6 * whole, (part, whole)
    if case == "full_dct":
        assert sorted(rank[case]["first_moment_rows"] for rank in ranks) == [22, 23]


def test_resuming_each_ranks_saved_state_continues_exactly(ranks):
    # each rank saved its own parameter shards and optimizer state (torch.save, loaded with weights_only=True)
    for rank in ranks:
        straight = rank["uninterrupted"]
        for case in ("full_dct", "full_power_channel"):
            for name, value in straight[case]["state"].items():
                assert torch.equal(rank[case]["state"][name], value), (case, name)
        for layer, X in straight["riemannion"]["points"].items():
            assert torch.equal(rank["riemannion"]["points"][layer], X), layer
        assert torch.equal(rank["riemannion"]["logits"], straight["riemannion"]["logits"])


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(ranks):
    # only rank 1's rows hold the NaN; rank 0 must skip too, or the shards of one step would be half applied
    for rank in ranks:
        for optimizer in ("dct", "riemannion"):
            assert rank["nonfinite"][optimizer] == {"unchanged": True, "skipped": 1}, (optimizer, rank["nonfinite"])


def test_the_riemannion_step_makes_three_collectives_for_any_number_of_adapters(ranks):
    for rank in ranks:
        counts = rank["riemannion_collectives"]  # adapters -> collectives of the first and the second step
        assert sorted(counts) == [1, 14]
        # the non-finite check's all-reduce, one all-gather of every adapter's factors and gradients (per tensor it
        # was 1 + 4 per adapter: 57 for 14) and one of the new points each rank computed for the adapters it owns
        assert counts[1] == counts[14] == [3, 3], counts


def test_the_bucketed_gather_equals_full_tensor_on_padded_shards(ranks):
    for r, rank in enumerate(ranks):
        gather = rank["bucketed_gather"]
        assert all(gather["same"]), gather["same"]
        assert all(gather["written"]), gather["written"]
        assert len(gather["collectives"]) == 1, gather["collectives"]
        # FSDP2 pads: rank 1 holds no row of the one-row tensor
        assert gather["local_rows"] == (1 if r == 0 else 0)


def test_the_bucketed_step_equals_the_per_tensor_step_bit_for_bit(ranks):
    # the same run with full_tensor / write_full_ per tensor (the step before the bucketed gather)
    for rank in ranks:
        reference, now = rank["per_tensor_gathers"]["riemannion"], rank["uninterrupted"]["riemannion"]
        for layer, X in reference["points"].items():
            assert torch.equal(now["points"][layer], X), layer
        assert torch.equal(now["logits"], reference["logits"])


def test_without_the_cache_the_forward_sees_a_b_changed_behind_its_version_counter():
    # what FSDP2 does to the forward's unsharded B: same tensor, new values, same version (and often the same address)
    model = get_peft_model(tiny_llama(num_layers=1), RiemannionConfig(r=2, target_modules=["q_proj"]))
    ref = find_adapters(model)[0]
    ids = torch.randint(0, 128, (1, 6))
    for cache, fresh in ((True, False), (False, True)):
        ref.layer.cache_right_basis = cache
        model(input_ids=ids)
        stale = ref.layer.get_right_basis("default") if cache else None
        ref.B.data.copy_(torch.randn_like(ref.B))  # .data: the version counter does not move
        seen = {}
        hook = ref.layer.register_forward_hook(
            lambda layer, *_, seen=seen: seen.update(B_R=layer.get_right_basis("default"))
        )
        model(input_ids=ids)
        hook.remove()
        expected = torch.linalg.qr(ref.B.detach()).Q
        matches = torch.allclose(seen["B_R"].abs(), expected.abs(), atol=1e-5)
        assert matches is fresh, (cache, matches)
        if cache:
            assert torch.equal(seen["B_R"], stale)
