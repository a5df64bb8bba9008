"""The README's quickstart must keep working: run it (shrunk) exactly as written otherwise."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _quickstart() -> str:
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_quickstart_runs(capsys):
    code = _quickstart()
    shrunk = code.replace("n_tasks=5", "n_tasks=2").replace("train_per_class=80", "train_per_class=8")
    shrunk = shrunk.replace("test_per_class=40", "test_per_class=4").replace("epochs=3", "epochs=1, progress=False")
    assert shrunk != code, "the README quickstart changed: update this test's shrinking"
    exec(compile(shrunk, str(README), "exec"), {})
    assert "| seq_lora |" in capsys.readouterr().out


def test_readme_adapter_snippet_runs():
    text = README.read_text()
    section = text[text.index("### SplitLoRA, PCLR, MoRA") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    for name, prefix in (("splitlora", "splitlora_"), ("pclr", "pclr_"), ("mora", "mora_")):
        model = scope[name]
        assert type(model).__name__ == "PeftModel"
        assert any(prefix in n for n, _ in model.named_parameters()), name


def test_the_readme_method_table_names_what_the_package_exports():
    """Every name in the "import" column of the README's method table is importable as written: ``from peft_ext
    import Name`` for a plain name, ``import peft_ext.module`` for a dotted one."""
    import importlib

    import peft_ext

    text = README.read_text()
    table = text[text.index("| method | import |") :].split("\n\n")[0]
    names = [n for row in table.splitlines()[2:] for n in re.findall(r"`([^`]+)`", row.split("|")[2])]
    assert len(names) >= 6, table
    for name in names:
        if "." in name:
            importlib.import_module(name)
        else:
            assert name in peft_ext.__all__ and getattr(peft_ext, name), name
