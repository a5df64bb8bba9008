"""benchmarks/tuning.py: the benchmark protocol (choose on validation, test over seeds, interval verdicts)."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tuning():
    spec = importlib.util.spec_from_file_location("tuning", ROOT / "benchmarks" / "tuning.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["tuning"] = module
    spec.loader.exec_module(module)
    return module


def test_t_quantiles_match_scipy(tuning):
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 4, 9, 30, 31, 60, 200):
        assert tuning.t_quantile(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3), df
    with pytest.raises(ValueError, match="df=0"):
        tuning.t_quantile(0)


def test_paired_interval_against_a_hand_computation(tuning):
    a, b = [0.60, 0.62, 0.58, 0.61, 0.64], [0.57, 0.60, 0.58, 0.57, 0.60]
    diffs = [0.03, 0.02, 0.0, 0.04, 0.04]
    half = 2.776 * statistics.stdev(diffs) / math.sqrt(5)
    mean, lo, hi = tuning.paired_interval(a, b)
    assert mean == pytest.approx(0.026) and lo == pytest.approx(0.026 - half) and hi == pytest.approx(0.026 + half)
    with pytest.raises(ValueError, match="same seeds"):
        tuning.paired_interval(a, b[:4])


def test_grid_and_lr_range_width(tuning):
    assert tuning.log_grid(1e-2) == [pytest.approx(3.16e-3), 1e-2, pytest.approx(3.16e-2)]
    assert tuning.log_grid(1e-3, points=5, factor=10) == [1e-5, 1e-4, 1e-3, 1e-2, 1e-1]
    # best at 1e-2; 1e-3 within a point, 1e-1 not, 1e-4 within a point but not contiguous with the best
    curve = {1e-4: 0.560, 1e-3: 0.565, 1e-2: 0.570, 1e-1: 0.40, 1.0: 0.569}
    assert tuning.lr_range_width({1e-4: 0.50, **curve}) == pytest.approx(2.0)  # 1e-4 .. 1e-2
    assert tuning.lr_range_width({1e-3: 0.5, 1e-2: 0.6, 1e-1: 0.3}) == 0.0


def test_tune_and_test_chooses_on_validation_never_on_test(tuning, tmp_path):
    """Validation prefers 1e-2, test would prefer 1e-3: the chosen rate and the reported figure follow validation."""

    def score(method, lr, seed, split):
        best = 1e-2 if split == "validation" else 1e-3
        base = 0.7 if method == "ours" else 0.6
        return base - 0.1 * abs(math.log10(lr / best)) + 0.01 * seed, {"steps": 10}

    grids = {"ours": [1e-3, 1e-2, 1e-1], "peer": [1e-3, 1e-2, 1e-1]}
    study = tuning.tune_and_test(
        grids, score, tuning.Protocol(tune_seeds=(0, 1), test_seeds=(0, 1, 2)), echo=lambda line: None
    )
    assert study.chosen == {"ours": 1e-2, "peer": 1e-2}
    assert study.validation["ours"][1e-2] == [pytest.approx(0.7), pytest.approx(0.71)]
    assert study.test["ours"] == [pytest.approx(0.6), pytest.approx(0.61), pytest.approx(0.62)]
    assert study.extras["peer"] == [{"steps": 10}] * 3
    table = study.table(baseline="peer")
    assert "| ours | 0.001 / 0.01 / 0.1 | 0.01 | 70.5 | 61.0 ± 1.0 |" in table and "+10.0 [+10.0, +10.0]" in table
    assert "met" in study.verdict("ours", "peer", 0.05, "ours vs peer")
    assert "NOT met" in study.verdict("ours", "peer", 0.2, "ours vs peer")
    payload = json.loads(json.dumps(study.to_dict()))
    assert payload["validation"]["peer"]["0.01"] == [pytest.approx(0.6), pytest.approx(0.61)]
    png = study.plot_lr_curves(str(tmp_path / "lr.png"), title="test")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="same number of grid points"):
        tuning.tune_and_test({"a": [1e-3], "b": [1e-3, 1e-2]}, score, tuning.Protocol())


def test_a_verdict_needs_the_interval_not_the_mean(tuning):
    study = tuning.Study(tuning.Protocol(test_seeds=(0, 1, 2, 3, 4)))
    study.test = {"ours": [0.62, 0.55, 0.66, 0.58, 0.64], "peer": [0.60, 0.58, 0.60, 0.58, 0.60]}
    mean, lo, _ = tuning.paired_interval(study.test["ours"], study.test["peer"])
    assert mean > 0.01 > lo  # the mean clears +1 point, the interval does not
    assert study.verdict("ours", "peer", 0.01, "x").endswith("NOT met")
