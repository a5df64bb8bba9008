"""python -m benchmarks.dct_vs_galore --quick: every table and every optimizer's code path runs, and the figures obey
what must hold whatever the timing (energy bounds, the protocol's choices, checkpoint formats)."""

from __future__ import annotations

import json

import pytest

from .helpers import run_module

pytest.importorskip("galore_torch")
pytest.importorskip("apollo_torch")


@pytest.mark.slow
def test_quick_run_covers_every_optimizer_and_basis(tmp_path):
    out, png = tmp_path / "dct.json", tmp_path / "lr.png"
    run_module("benchmarks.dct_vs_galore", "--quick", "--json", out, "--png", png)
    results = json.loads(out.read_text())

    # table 1: one timing per basis and shape
    bases = ["galore_svd", "apollo_random", "dct_matmul", "dct_fft", "coordinates", "power"]
    for record in results["refresh"]:
        assert all(record[f"{b}_s"] > 0 for b in bases)

    # table 2: the SVD top-r is the optimum of every r-dimensional basis; a basis refreshed on the gradient it is
    # measured on captures at least what it did before that refresh (one power step can only move towards the top)
    mean = results["energy"]["mean"]
    for key, values in mean.items():
        assert all(0 < v <= 1 + 1e-9 for v in values), key
        assert all(v <= s + 1e-9 for v, s in zip(values, mean["svd"])), key
    assert all(f >= s - 1e-9 for f, s in zip(mean["power"], mean["power_stale"]))
    assert mean["dct_l2"][0] >= mean["dct_l1"][0] - 1e-9  # L2 is the best DCT selection by energy

    # table 3: every optimizer ran the protocol; GaLore's and APOLLO's states do not load weights_only, ours do
    study = results["finetune"]
    labels = ["AdamW", "GaLore r=8", "APOLLO r=8", "DCT-AdamW r=8", "power r=8", "coordinates r=8"]
    labels += ["DCT channel r=8", "power channel r=8"]
    assert list(study["chosen"]) == labels
    for label in labels:
        assert all(0 <= a <= 1 for a in study["test"][label])
        extra = study["extras"][label][0]
        assert extra["weights_only_loadable"] == (label.split()[0] not in ("GaLore", "APOLLO")), label
    adamw = study["extras"]["AdamW"][0]["state_bytes_projected"]
    assert study["extras"]["DCT-AdamW r=8"][0]["state_bytes_projected"] < adamw / 10

    # the targets are printed, each with a verdict
    targets = results["targets"]
    assert any("refresh vs SVD" in t for t in targets) and any(">= APOLLO accuracy" in t for t in targets)
    assert all(t.endswith(("met", "NOT met")) for t in targets)
    assert "step_time" in results and "column_bias" in results
    adamw_step = next(r for r in results["step_time"] if r["label"] == "AdamW")
    assert adamw_step["mean_vs_adamw"] == 1.0 and all(r["mean_s"] > 0 for r in results["step_time"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the lr-robustness figure of table 3


def test_gap_and_scale_rule_labels_leave_the_default_specs_unchanged():
    from benchmarks.dct_vs_galore import optimizer_specs

    default = optimizer_specs([8, 64], 4.0, 500, 200, 10)
    specs = optimizer_specs([8, 64], 4.0, 500, 200, 10, dct_gaps=(1, 10), scale_rules=("sqrt", "linear"))
    assert {m: specs[m] for m in default} == default  # cached runs of the default labels stay valid
    for base in ("DCT-AdamW r=8", "DCT channel r=64"):
        assert specs[f"{base} gap=10"] == {**default[base], "gap": 10}
    assert "DCT-AdamW r=8 gap=1" not in specs and "DCT-AdamW r=8 scale sqrt" not in specs  # r=8 is the reference
    sqrt, linear = specs["DCT-AdamW r=64 scale sqrt"], specs["DCT-AdamW r=64 scale linear"]
    assert sqrt["scale"] == pytest.approx(4.0 / 8**0.5) and linear["scale"] == pytest.approx(0.5)
    assert sqrt["center"] == linear["center"] == default["DCT-AdamW r=8"]["center"]  # r=8's lr carries over
    assert {k: v for k, v in sqrt.items() if k not in ("scale", "center")} == {
        k: v for k, v in default["DCT-AdamW r=64"].items() if k not in ("scale", "center")
    }
