"""python -m benchmarks.riemannion --timing-only: the step-time rounds and the LOI cost without the training runs."""

from __future__ import annotations

import json
import re

import pytest

from .helpers import run_module


@pytest.mark.slow
def test_timing_only_prints_the_step_time_and_loi_verdicts_and_trains_nothing(tmp_path):
    out = tmp_path / "timing.json"
    args = ["--quick", "--timing-only", "--methods", "riemannion_loi", "lora_adamw", "--json", out]
    text = run_module("benchmarks.riemannion", *args, timeout=600).stdout

    assert "interleaved in one process" in text and "test accuracy" not in text.lower()
    verdicts = [line for line in text.splitlines() if line.startswith("target: ")]
    assert len(verdicts) == 2 and all(re.search(r": (met|NOT met)$", v) for v in verdicts), verdicts
    assert "step time" in verdicts[0] and "95 % CI" in verdicts[0] and "LOI cost" in verdicts[1]
    data = json.loads(out.read_text())
    assert set(data["timing"]["median_step_ms"]) == {"riemannion_loi", "lora_adamw"}
    assert set(data["timing"]["init"]) == {"riemannion_loi"} and data["targets"] == verdicts
    assert "study" not in data and "runs" not in data
