"""The task kinds (peft_ext/continual/task_kinds.py): one object per kind of task sequence owns what differs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from peft_ext.continual.task_kinds import (
    Classification,
    Generation,
    task_kind,
)

ROOT = Path(__file__).resolve().parents[1]


def test_each_kind_says_what_differs():
    c, g = task_kind("classification"), task_kind("generation")
    assert isinstance(c, Classification) and isinstance(g, Generation)
    assert c.masks_classes and c.takes_heads and c.trains_output_head and c.records_hits and not c.causal
    assert not g.masks_classes and not g.takes_heads and not g.trains_output_head and not g.records_hits
    assert g.causal and g.measures_held_out_text and g.row_independent_scores
    with pytest.raises(ValueError, match=r"unknown task sequence kind 'regression'; known kinds: \['classification'"):
        task_kind("regression")


def test_no_module_of_the_engine_methods_or_jobs_tests_a_kind_by_its_name():
    """The engine, evaluation, the methods and the jobs ask the kind object; the name is data (what a sequence says
    it is, what a method lists in ``task_kinds``), never a branch."""
    test = re.compile(r"""\.kind\s*[!=]=\s*["'](generation|classification)["']""")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("peft_ext/continual", "peft_ext/jobs")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "task_kinds.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if test.search(line)
    ]
    assert not found, found
