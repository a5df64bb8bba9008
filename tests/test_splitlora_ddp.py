"""SplitLoRA under DistributedDataParallel: the statistics are all-reduced, so every rank picks the same subspace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peft_ext.tuners.splitlora.subspace import choose_split, covariance_spectrum, primary_dimension

from .helpers import torchrun_ranks

WORKER = Path(__file__).parent / "workers" / "splitlora_ddp.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun_ranks(WORKER, tmp_path_factory.mktemp("ddp"), pytest.fail)


@pytest.mark.distributed
def test_every_rank_picks_the_same_subspace_from_the_global_statistics(ranks):
    from .workers.splitlora_ddp import CONFIG, TASKS

    zero, one = ranks
    for task in range(TASKS):
        a, b = zero["tasks"][task], one["tasks"][task]
        assert a["splits"] == b["splits"], task
        assert a["tokens"] == b["tokens"] and a["kind"] == {"narrow": "dense", "wide": "sketch"}
        for key in a["A"]:
            assert torch.equal(a["A"][key], b["A"][key]), (task, key)
            assert torch.equal(a["covariance"][key], b["covariance"][key]), (task, key)

        for key in a["A"]:
            # the inputs of both ranks in all tasks so far, as one process would have seen them
            rows = torch.cat([r["tasks"][t]["inputs"][key] for t in range(task + 1) for r in ranks]).double()
            assert a["tokens"][key] == rows.shape[0]
            truth = rows.T @ rows / rows.shape[0]
            local = [torch.cat([r["tasks"][t]["inputs"][key] for t in range(task + 1)]).double() for r in (zero, one)]
            for mine in local:  # without the all-reduce a rank would see a clearly different covariance
                assert (mine.T @ mine / mine.shape[0] - truth).norm() > 0.1 * truth.norm()
            got = a["covariance"][key].double()
            if a["kind"][key] == "dense":
                torch.testing.assert_close(got, truth, rtol=1e-5, atol=1e-5)
                values, vectors, total = covariance_spectrum(truth)
                k = choose_split(values, task, CONFIG["trade_off"], dim=truth.shape[0], total=total)
                assert a["splits"][key] == (k, primary_dimension(k, truth.shape[0]))
            else:
                # the merged sketch never overestimates and its certificate bounds the error on the global data
                gap = torch.linalg.eigvalsh(truth - got)
                assert float(gap.min()) > -1e-5 and float(gap.max()) <= a["error"][key] + 1e-5
                _, vectors, _ = covariance_spectrum(got)
            primary = vectors[:, : a["splits"][key][1]]
            assert float((a["A"][key].double() @ primary).norm()) < 1e-5 * float(a["A"][key].norm()), (task, key)
