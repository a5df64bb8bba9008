"""benchmarks/splitlora_fsdp2.py: SplitLoRA's statistics per process under FSDP2, sharded and whole."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import splitlora_fsdp2 as bench

from .helpers import run_module


def test_on_paper_bytes_split_the_features_over_the_processes():
    eight, one = bench.on_paper(8), bench.on_paper(1)
    for sharded, whole in zip(eight, one):
        assert sharded["whole"] == whole["whole"] == whole["sharded"]
        # 4096, 8192, 14336 and 28672 inputs split evenly over 8 processes
        assert sharded["sharded"] * 8 == sharded["whole"]
    # Llama-3-8B: a 256-row float32 sketch of 6 x 4096 + 14336 inputs per layer, 32 layers
    assert eight[0]["whole"] == 32 * 256 * 4 * (6 * 4096 + 14336)
    # uneven over 3 processes: the first holds ceil(4096 / 3) = 1366 and ceil(14336 / 3) = 4779 features
    assert bench.on_paper(3)[0]["sharded"] == 32 * 256 * 4 * (6 * 1366 + 4779)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_run_measures_both_layouts_and_prints_the_verdicts(tmp_path):
    out = tmp_path / "fsdp2.json"
    proc = run_module("benchmarks.splitlora_fsdp2", "--json", out, "--batches", "3", threads=1)  # the report: 6
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith("target: ")]
    assert len(verdicts) == 2 and all(re.search(r": met$", v) for v in verdicts), verdicts
    data = json.loads(out.read_text())
    for kind, one in data["one_process"].items():
        for rank in data["ranks"]:
            sharded, whole = rank[f"{kind} / sharded"], rank[f"{kind} / whole on every process"]
            assert 2 * sharded["running_bytes"] == whole["running_bytes"] == one["running_bytes"], kind
            # while collecting: the covariance or sketch halves; each module's counters (tokens, energy) do not
            assert whole["collecting_bytes"] == one["collecting_bytes"], kind
            assert 0 < 2 * sharded["collecting_bytes"] - whole["collecting_bytes"] <= 1024, kind
            assert sharded["splits"] == whole["splits"] == one["splits"], kind
            assert sharded["collectives_per_batch"] > 0 == whole["collectives_per_batch"], kind
