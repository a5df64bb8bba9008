"""benchmarks/_lib/protocol.py: the benchmark protocol (choose on validation, test over seeds, interval verdicts), with
the run cache of benchmarks/_lib/cache.py that keeps its runs."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from benchmarks._lib import protocol
from benchmarks._lib.cache import RunCache


def test_t_quantiles_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 4, 9, 30, 31, 60, 200):
        assert protocol.t_quantile(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3), df
    with pytest.raises(ValueError, match="df=0"):
        protocol.t_quantile(0)


def test_paired_interval_against_a_hand_computation():
    a, b = [0.60, 0.62, 0.58, 0.61, 0.64], [0.57, 0.60, 0.58, 0.57, 0.60]
    diffs = [0.03, 0.02, 0.0, 0.04, 0.04]
    half = 2.776 * statistics.stdev(diffs) / math.sqrt(5)
    mean, lo, hi = protocol.paired_interval(a, b)
    assert mean == pytest.approx(0.026) and lo == pytest.approx(0.026 - half) and hi == pytest.approx(0.026 + half)
    with pytest.raises(ValueError, match="same seeds"):
        protocol.paired_interval(a, b[:4])


def test_grid_and_lr_range_width():
    assert protocol.log_grid(1e-2) == [pytest.approx(3.16e-3), 1e-2, pytest.approx(3.16e-2)]
    assert protocol.log_grid(1e-3, points=5, factor=10) == [1e-5, 1e-4, 1e-3, 1e-2, 1e-1]
    # best at 1e-2; 1e-3 within a point, 1e-1 not, 1e-4 within a point but not contiguous with the best
    curve = {1e-4: 0.560, 1e-3: 0.565, 1e-2: 0.570, 1e-1: 0.40, 1.0: 0.569}
    assert protocol.lr_range_width({1e-4: 0.50, **curve}) == pytest.approx(2.0)  # 1e-4 .. 1e-2
    assert protocol.lr_range_width({1e-3: 0.5, 1e-2: 0.6, 1e-1: 0.3}) == 0.0


def test_tune_and_test_chooses_on_validation_never_on_test(tmp_path):
    """Validation prefers 1e-2, test would prefer 1e-3: the chosen rate and the reported figure follow validation."""

    def score(method, lr, seed, split):
        best = 1e-2 if split == "validation" else 1e-3
        base = 0.7 if method == "ours" else 0.6
        return base - 0.1 * abs(math.log10(lr / best)) + 0.01 * seed, {"steps": 10}

    grids = {"ours": [1e-3, 1e-2, 1e-1], "peer": [1e-3, 1e-2, 1e-1]}
    study = protocol.tune_and_test(
        grids, score, protocol.Protocol(tune_seeds=(0, 1), test_seeds=(0, 1, 2)), echo=lambda line: None
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
        protocol.tune_and_test({"a": [1e-3], "b": [1e-3, 1e-2]}, score, protocol.Protocol())


def test_a_grid_grows_past_the_end_that_scores_best_until_the_best_is_inside():
    """With extend_edges, a method whose best validation score is at an end of its grid gets one more point a grid
    step beyond (3e-2 -> 9e-2 -> 0.27 here, half-decade steps), for every method alike; one whose best is inside
    keeps its grid; the number of points added is capped."""
    peak = {"up": 0.2, "down": 4e-4, "inside": 1e-2}

    def score(method, lr, seed, split):
        return 0.9 - 0.1 * abs(math.log10(lr / peak[method]))

    grids = {m: [3e-3, 1e-2, 3e-2] for m in peak}
    seen = []

    def logged(*key):
        seen.append(key)
        return score(*key)

    grown = protocol.Protocol(test_seeds=(0,), extend_edges=2)
    study = protocol.tune_and_test(grids, logged, grown, echo=lambda line: None)
    assert sorted(study.validation["up"]) == [3e-3, 1e-2, 3e-2, 9e-2, 0.27]  # 0.27 beats 9e-2: capped at 2 points
    assert study.chosen["up"] == 0.27
    assert sorted(study.validation["down"]) == [2.7e-4, 9e-4, 3e-3, 1e-2, 3e-2]
    assert study.chosen["down"] == 2.7e-4
    assert sorted(study.validation["inside"]) == [3e-3, 1e-2, 3e-2] and study.chosen["inside"] == 1e-2
    assert sum(1 for key in seen if key[3] == "validation") == 13  # 3 x 3 + 2 + 2
    plain = protocol.tune_and_test(grids, score, protocol.Protocol(test_seeds=(0,)), echo=lambda line: None)
    assert plain.chosen == {"up": 3e-2, "down": 3e-3, "inside": 1e-2}
    assert protocol.beyond_edge([1e-3, 1e-2], 1e-2) == pytest.approx(0.1)
    assert protocol.beyond_edge([1e-3, 1e-2, 1e-1], 1e-2) is None and protocol.beyond_edge([1e-2], 1e-2) is None
    assert "grows by up to 2" in protocol.Protocol(extend_edges=2).describe()
    with pytest.raises(ValueError, match="extend_edges must be >= 0, got -1"):
        protocol.Protocol(extend_edges=-1)


def test_a_verdict_needs_the_interval_not_the_mean():
    study = protocol.Study(protocol.Protocol(test_seeds=(0, 1, 2, 3, 4)))
    study.test = {"ours": [0.62, 0.55, 0.66, 0.58, 0.64], "peer": [0.60, 0.58, 0.60, 0.58, 0.60]}
    mean, lo, _ = protocol.paired_interval(study.test["ours"], study.test["peer"])
    assert mean > 0.01 > lo  # the mean clears +1 point, the interval does not
    assert study.verdict("ours", "peer", 0.01, "x").endswith("NOT met")


def test_run_cache_saves_each_run_and_a_restarted_job_reuses_them(tmp_path):
    path = tmp_path / "runs.json"
    calls = []

    def score(method, lr, seed, split):
        calls.append((method, lr, seed, split))
        if method == "boom" and split == "test":
            raise RuntimeError("killed")
        return {"a": 0.5, "b": 0.7, "boom": 0.9}[method] + lr, {"curve": [(1, math.inf)], "lr": lr}

    seeds = protocol.Protocol(tune_seeds=(0,), test_seeds=(0, 1))
    grids = {"a": [0.01, 0.1], "b": [0.01, 0.1], "boom": [0.01, 0.1]}
    settings = {"epochs": 2, "data": [1, 2]}
    with pytest.raises(RuntimeError, match="killed"):  # the job dies at boom's first test run
        protocol.tune_and_test(grids, RunCache(path, settings).wrap(score), seeds, echo=lambda _: None)
    finished = len(calls) - 1
    assert finished == 6 + 4  # 6 validation runs, a's and b's test runs: all saved, the failing one not
    assert not (tmp_path / "runs.json.tmp").exists()
    saved = json.loads(path.read_text())
    assert len(saved["runs"]) == finished and saved["settings"] == settings

    calls.clear()
    cache = RunCache(path, settings)
    study = protocol.tune_and_test({k: v for k, v in grids.items() if k != "boom"}, cache.wrap(score), seeds,
                                   echo=lambda _: None)  # fmt: skip
    assert calls == [] and cache.reused == 8  # nothing retrained
    assert study.chosen == {"a": 0.1, "b": 0.1} and study.test["a"] == [0.6, 0.6]
    assert study.extras["a"][0] == {"curve": [[1, math.inf]], "lr": 0.1}  # JSON-normalized, inf kept
    assert (("a", 0.1, 1, "test") in cache) and cache[("a", 0.1, 1, "test")][0] == 0.6

    with pytest.raises(SystemExit, match=r"other settings \(differing: epochs\)"):
        RunCache(path, {**settings, "epochs": 3})
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="is not a run cache"):
        RunCache(path, settings)
    memory = RunCache(None, settings)  # no path: nothing written
    memory.put(("x",), 1)
    assert memory.get(("x",)) == 1 and memory.get(("y",)) is None and not list(tmp_path.glob("*.tmp"))
