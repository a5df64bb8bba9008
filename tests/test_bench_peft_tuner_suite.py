"""benchmarks/peft_tuner_suite.py without PEFT's source distribution: the cases it puts in front of PEFT's list, and
the table it makes from pytest's JUnit report (the run itself needs `pip download` and a few minutes)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from benchmarks import peft_tuner_suite as suite


def test_cases_go_in_front_of_peft_list_and_are_importable(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_custom_models.py").write_text(
        "import torch\nTEST_CASES = [\n    ('LoRA case', 'MLP', None, {}),\n]\n"
    )
    names = suite.inject(tests, ["riemannion", "pclr"])
    assert len(names) == 2 * len(suite.CASES) and "Vanilla MLP 1 Riemannion" in names and "Vanilla MLP 1 PCLR" in names
    namespace: dict = {}
    exec((tests / "test_custom_models.py").read_text(), namespace)  # valid Python that imports peft_ext
    cases = namespace["TEST_CASES"]
    assert cases[-1][0] == "LoRA case" and [c[0] for c in cases[:-1]] == names
    pclr = next(c for c in cases if c[0] == "Vanilla MLP 5 PCLR")
    assert pclr[2].__name__ == "PCLRConfig" and pclr[3]["modules_to_save"] == ["lin1"] and pclr[3]["top_k"] == 2
    assert (tests / "__init__.py").is_file()


def test_summary_counts_per_type_and_groups_failures():
    xml = """<testsuites><testsuite>
      <testcase name="test_a[Vanilla MLP 1 Riemannion-MLP]"/>
      <testcase name="test_b[Vanilla MLP 1 Riemannion-MLP]"><failure message="ValueError: boom">x</failure></testcase>
      <testcase name="test_c[Vanilla MLP 2 Riemannion-MLP]"><failure message="ValueError: boom">x</failure></testcase>
      <testcase name="test_d[Vanilla MLP 1 PCLR-MLP]"><skipped message="gpu"/></testcase>
      <testcase name="test_e[Vanilla MLP 1 PCLR-MLP]"><error message="merging needs top_k >= 3"/></testcase>
      <testcase name="test_f[Vanilla MLP 1 LoRA-MLP]"/>
    </testsuite></testsuites>"""
    rows = suite.summarize(ET.fromstring(xml), ["riemannion", "pclr"])
    assert rows["riemannion"] == {
        "passed": 1,
        "failed": 2,
        "by_design": 0,
        "skipped": 0,
        "failures": {"ValueError: boom": 2},
        "design_reasons": {},
    }
    assert rows["pclr"] == {
        "passed": 0,
        "failed": 0,
        "by_design": 1,
        "skipped": 1,
        "failures": {},
        "design_reasons": {"merging needs static routing": 1},
    }
