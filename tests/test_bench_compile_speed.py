"""python -m benchmarks.compile_speed --quick in a subprocess: the table, one graph per adapter type, the verdict."""

from __future__ import annotations

import json

import pytest

from .helpers import run_module


@pytest.mark.slow
def test_quick_run_prints_the_table_and_the_verdict(tmp_path):
    out = tmp_path / "compile.json"
    proc = run_module("benchmarks.compile_speed", "--quick", "--json", out, threads=1)
    assert "| adapter | graphs | compile s | eager ms / step | compiled ms / step | compiled / eager |" in proc.stdout
    assert "target: every type one graph (0 graph breaks) with gradients equal to eager's" in proc.stdout
    assert proc.stdout.rstrip().endswith(": met"), proc.stdout[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["adapter"] for r in rows] == ["lora", "pclr"]
    for row in rows:
        assert row["graphs"] == 1 and row["grad_rel_diff"] < 1e-4
        assert row["ratio"] > 0 and row["eager_ms"] > 0 and row["compiled_ms"] > 0
        assert f"| {row['adapter']} | 1 | {row['compile_s']:.1f} | {row['eager_ms']:.1f} |" in proc.stdout
