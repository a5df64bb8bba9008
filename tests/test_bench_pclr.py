"""python -m benchmarks.pclr --sequence-cost at toy size in a subprocess: the cost tables, ratio and verdict."""

from __future__ import annotations

import re

import pytest

from .helpers import run_module


@pytest.mark.slow
def test_sequence_cost_prints_cpu_seconds_per_run_and_task_the_ratio_and_its_verdict():
    # 4 tasks: the benchmark's PCLR entry compresses after the fourth, so a run goes through the whole task cycle
    sizes = ("--tasks", 4, "--classes-per-task", 2, "--train-per-class", 4, "--test-per-class", 2, "--epochs", 1)
    out = run_module("benchmarks.pclr", "--sequence-cost", *sizes, "--cost-rounds", 2).stdout
    assert "| round | order | seq_lora CPU s | pclr CPU s | pclr / seq_lora | seq_lora final acc % |" in out
    assert "| task | seq_lora CPU s | pclr CPU s | pclr / seq_lora |" in out
    rows = [line.strip("| ").split(" | ") for line in out.splitlines() if re.match(r"\| \d+ \| ", line)]
    runs, tasks = [row for row in rows if len(row) == 7], [row for row in rows if len(row) == 4]
    assert [row[1] for row in runs] == ["seq_lora then pclr", "pclr then seq_lora"]  # who starts alternates
    assert {(row[5], row[6]) for row in runs} == {(runs[0][5], runs[0][6])}  # taking turns, each run computes the same
    assert [row[0] for row in tasks] == ["1", "2", "3", "4"]
    for cells in [row[2:5] for row in runs] + [row[1:] for row in tasks]:
        assert all(float(cell.rstrip("x")) > 0 for cell in cells)  # CPU seconds and their ratio
    assert re.search(r"pclr / seq_lora CPU s per run: median of 2 round\(s\) \d+\.\d\dx, geometric mean", out)
    assert re.search(r"target: pclr CPU s per run <= 1\.50x seq_lora's .*: (met|NOT met)$", out, re.MULTILINE)
