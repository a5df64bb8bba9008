"""python -m benchmarks.compile_speed --quick in a subprocess: the table, one graph per adapter type, the verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_run_prints_the_table_and_the_verdict(tmp_path):
    out = tmp_path / "compile.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.compile_speed", "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| adapter | graphs | compile s | eager ms / step | compiled ms / step | compiled / eager |" in proc.stdout
    assert "target: every type one graph (0 graph breaks) with gradients equal to eager's" in proc.stdout
    assert proc.stdout.rstrip().endswith(": met"), proc.stdout[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["adapter"] for r in rows] == ["lora", "pclr"]
    for row in rows:
        assert row["graphs"] == 1 and row["grad_rel_diff"] < 1e-4
        assert row["ratio"] > 0 and row["eager_ms"] > 0 and row["compiled_ms"] > 0
        assert f"| {row['adapter']} | 1 | {row['compile_s']:.1f} | {row['eager_ms']:.1f} |" in proc.stdout
