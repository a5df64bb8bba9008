"""DCT-AdamW under DistributedDataParallel: 2 processes (torchrun, gloo on CPU) pick the same columns every step and
end with identical parameters, equal to a single process training on the full batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from .helpers import run_launcher
from .single_thread import single_thread  # noqa: F401  (fixture)
from .workers import ddp_dct as worker

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("single_thread")]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run_launcher([*cmd, str(ROOT / "tests" / "workers" / "ddp_dct.py"), str(out)], timeout=120)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_every_rank_selects_the_same_columns_and_keeps_identical_parameters(ranks):
    r0, r1 = ranks
    assert r0["world"] == r1["world"] == 2
    assert len(r0["history"]) == worker.STEPS
    assert r0["history"] == r1["history"]
    assert set(r0["history"][0]) == {"0.weight", "2.weight"}
    # the selection moves during training, so agreeing on it is not trivial
    assert len({tuple(step["0.weight"]) for step in r0["history"]}) > 1
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name


def test_ddp_equals_one_process_on_the_full_batch(ranks):
    model = worker.make_model()
    history = worker.train(model, slice(0, worker.BATCH))
    assert history == ranks[0]["history"]
    for name, p in model.named_parameters():
        assert torch.allclose(p.detach(), ranks[0]["params"][name], atol=1e-5), name


def test_indices_are_broadcast_from_rank_0(ranks):
    r0, r1 = ranks
    assert r0["local"] == [1, 2, 3] and r1["local"] == [7, 8, 9], "the ranks see different gradients"
    assert r0["synced"]["auto"] == r1["synced"]["auto"] == [1, 2, 3]
    assert r0["synced"]["off"] == [1, 2, 3] and r1["synced"]["off"] == [7, 8, 9]
