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
    # where the time goes: PCLR's start of task (the query prototype's pass) and end of task (compression and
    # distillation after the fourth task) cost CPU that sequential LoRA's do not; the phases add up to the run
    assert "| phase | seq_lora CPU s | pclr CPU s | pclr - seq_lora |" in out
    phases = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:] for line in out.splitlines()}
    start, end, rest, whole = (
        [float(c) for c in phases[k]] for k in ("start of task", "end of task", "training and evaluation", "whole run")
    )
    assert start[1] >= start[0] and end[1] >= end[0]  # tenths of a second: at this toy size both may read 0.0
    for column in (0, 1):
        assert start[column] + end[column] + rest[column] == pytest.approx(whole[column], abs=0.2)
    assert re.search(r"target: pclr CPU s per run <= 1\.50x seq_lora's .*: (met|NOT met)$", out, re.MULTILINE)
