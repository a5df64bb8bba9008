"""The figures other pages quote from docs/benchmarks.md (benchmarks/figures.py): each equals its rendering from the
report, the verdict word follows the interval, and a re-run that changes an ordering fails until the sentence does."""

from __future__ import annotations

import shutil

import pytest

from benchmarks import figures
from benchmarks.figures import FIGURE, parse_report, render, rewrite

REPORT = figures.REPORT.read_text()

FAKE = """# Benchmarks

## Fake comparison (WordNet)

### test over seeds [0, 1, 2] (mean ± sd)

| method | lr grid | chosen lr | val acc | test acc (mean ± sd) | vs lora (95 % CI) |
|---|---|---:|---:|---:|---:|
| lora | 0.001 / 0.00316 / 0.01 | 0.00316 | 50.0 | 51.0 ± 1.0 | — |
| up | 0.001 / 0.00316 / 0.01 | 0.001 | 55.0 | 56.0 ± 1.0 | +5.0 [+1.0, +9.0] |
| same | 0.001 / 0.00316 / 0.01 | 0.01 | 51.0 | 51.5 ± 1.0 | +0.5 [-2.0, +3.0] |
| down | 0.001 / 0.00316 / 0.01 | 0.00316 | 45.0 | 46.0 ± 1.0 | -5.0 [-8.0, -2.0] |

| run | 10 steps | 20 steps |
|---|---:|---:|
| up lr 0.001 | 40.0 | 55.0 |
| up lr 0.00316 | 30.0 | 47.5 |

| shape | ratio |
|---|---:|
| square | 58x |
| tall | 8x |
| wide | 16x |

Targets:

- target: fake refresh = 58x (>= 50x): met
- target: up >= lora: +5.0 points, 95 % CI [+1.0, +9.0] over 3 seeds (lower end >= +0.0): met
- target: ratio 1.108, 95 % CI [1.053, 1.165] (upper end <= 1): NOT met
"""
TITLES = {"continual": "Fake comparison (WordNet)"}


def _render(key: str, text: str = FAKE) -> str:
    return render(key, parse_report(text), TITLES)


def test_every_figure_of_the_pages_equals_the_report():
    stale = []
    for page in figures.pages():
        text = page.read_text()
        for found in FIGURE.finditer(text):
            if found["body"] != render(found["key"], parse_report(REPORT)):
                stale.append(f"{page.name}: {found['key']}")
    assert not stale, f"run python -m benchmarks.figures: {stale}"
    assert sum(len(FIGURE.findall(p.read_text())) for p in figures.pages()) >= 20


def test_the_verdict_follows_the_interval():
    assert _render("vs continual 1 up") == "beats LoRA (+5.0 points [+1.0, +9.0], WordNet, 3 seeds)"
    assert _render("vs continual 1 same").startswith("ties LoRA (+0.5 points [-2.0, +3.0]")
    assert _render("vs continual 1 down").startswith("trails LoRA (-5.0 points")
    said = _render("target continual 2 LoRA at rank 8")
    assert said == "beats LoRA at rank 8 (+5.0 points [+1.0, +9.0], WordNet, 3 seeds)"
    assert _render("target continual 3 GaLore's") == "1.108x GaLore's [1.053, 1.165] (WordNet, 3 seeds)"


def test_a_ratio_reads_as_a_verdict_on_one_and_a_target_as_its_outcome():
    assert _render("ratio_vs continual 3 GaLore's") == "is above GaLore's (1.108x [1.053, 1.165], WordNet, 3 seeds)"
    tie = FAKE.replace("[1.053, 1.165]", "[0.953, 1.165]")
    assert _render("ratio_vs continual 3 GaLore's", tie).startswith("ties GaLore's (1.108x [0.953, 1.165]")
    assert _render("met continual 3") == "NOT met" and _render("met continual 2") == "met"
    assert _render("speedup continual 1 the SVD") == "58x faster than the SVD"
    assert _render("speedup continual 1 x", FAKE.replace("= 58x", "= 0.4x")) == "2.5x slower than x"


def test_ranges_cells_steps_and_measured_ratios():
    assert _render("range continual 3 | 2 | tall | wide") == "8-16x"
    assert _render("range continual 3 | 2 | square") == "58x"
    assert _render("measured continual 1") == "58x"
    assert _render("cell continual 1 up 5") == "56.0 ± 1.0"
    said = _render("lr_step continual up")
    assert said == "from 55.0 at its best learning rate (0.001) to 47.5 half a decade above it (0.00316)"
    assert _render("table continual 3").splitlines()[2] == "| shape | ratio |"


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("best continual 1 up", r"unknown kind 'best'"),
        ("vs nowhere 1 up", r"no section 'nowhere'"),
        ("vs continual 1 missing", r"no row 'missing'"),
        ("vs continual 4 up", r"no table 4"),
        ("cell continual 1 up 9", r"no column 9"),
        ("lr_step continual same", r"top of its grid"),
        ("measured continual 2", r"measures no ratio"),
    ],
)
def test_a_bad_figure_is_refused_with_what_is_there(key, message):
    with pytest.raises(ValueError, match=message):
        _render(key)


def test_a_rerun_that_flips_an_ordering_fails_the_check_and_leaves_pages_alone(tmp_path, capsys):
    """A re-run where Riemannion now clears LoRA: the README's "ties" is stale, --check says which figure, and a bad
    key leaves the page untouched."""
    row = "| riemannion_loi | 0.00949 / 0.03 / 0.0949 | 0.03 | 61.6 | 56.3 ± 1.9 | 0.5 decades | +0.2 [-3.1, +3.6] |"
    assert row in REPORT
    report = tmp_path / "benchmarks.md"
    report.write_text(REPORT.replace(row, row.replace("+0.2 [-3.1, +3.6]", "+4.2 [+1.1, +7.3]")))
    readme = tmp_path / "README.md"
    shutil.copy(figures.ROOT / "README.md", readme)
    assert figures.main(["--check", "--report", str(report), str(readme)]) == 1
    assert "vs riemannion 1 riemannion_loi" in capsys.readouterr().err
    assert figures.main(["--report", str(report), str(readme)]) == 0
    assert "beats LoRA + AdamW (+4.2 points [+1.1, +7.3], WordNet, 5 seeds)" in readme.read_text()
    before = readme.read_text() + "<!-- figure vs riemannion 1 nobody --><!-- /figure -->"
    readme.write_text(before)
    assert figures.main(["--report", str(report), str(readme)]) == 2
    assert readme.read_text() == before
    assert "no row 'nobody'" in capsys.readouterr().err


def test_rewrite_keeps_the_key_and_replaces_only_the_body():
    text = "x <!-- figure measured continual 1 -->99x<!-- /figure --> y"
    assert rewrite(text, parse_report(FAKE), TITLES) == "x <!-- figure measured continual 1 -->58x<!-- /figure --> y"
