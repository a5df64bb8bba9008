"""The command line's light front (peft_ext_cli): plain, fast --help, shipped configs by name, copying one out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import peft_ext_cli

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_help_is_plain_text_and_imports_no_torch(tmp_path):
    """--help (top level and per command) and `configs` run without importing torch, peft or peft_ext itself."""
    code = """
import sys
import peft_ext_cli
for argv in (["--help"], ["run", "--help"], ["check", "--help"], ["configs", "--help"]):
    try:
        peft_ext_cli.main(argv)
    except SystemExit as exit:
        assert exit.code == 0, (argv, exit.code)
print("END-HELP")
assert peft_ext_cli.main(["configs"]) == 0
heavy = sorted(m for m in ("torch", "peft", "transformers", "bitsandbytes", "peft_ext") if m in sys.modules)
print("HEAVY", heavy)
"""
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    out, listing = proc.stdout.split("END-HELP")
    assert "quickstart" in listing and "mora_emoji" in listing
    assert "quickstart" in out and "--set" in out and "--copy" in out
    for markup in ("``", ":class:", ":mod:", ":func:", "`"):
        assert markup not in out, f"help text carries markup {markup!r}"
    assert "configs/" not in out, "help must not point to a checkout-only path"


def test_help_via_module_exits_0(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "peft_ext_cli", "--help"], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: peft-ext")


def test_shipped_configs_are_the_repository_configs():
    assert list(peft_ext_cli.shipped_configs()) == SHIPPED
    assert "quickstart" in SHIPPED
    assert peft_ext_cli.configs_dir() == ROOT / "configs"


def test_resolve_config_by_name_and_file_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = str(ROOT / "configs" / "quickstart.yaml")
    assert peft_ext_cli.resolve_config("quickstart") == shipped
    assert peft_ext_cli.resolve_config("quickstart.yaml") == shipped
    assert peft_ext_cli.resolve_config("nope") == "nope"  # left to the loader, which says it does not exist
    assert peft_ext_cli.resolve_config("sub/quickstart.yaml") == "sub/quickstart.yaml"  # a path is never a name
    (tmp_path / "quickstart.yaml").write_text("name: mine\n")
    assert peft_ext_cli.resolve_config("quickstart.yaml") == "quickstart.yaml"  # an existing file wins
    (tmp_path / "quickstart").mkdir()
    assert peft_ext_cli.resolve_config("quickstart") == "quickstart"


def test_check_by_name_and_unknown_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert peft_ext_cli.main(["check", "quickstart"]) == 0
    out = capsys.readouterr().out
    assert "valid (11 methods:" in out
    # and what it would run: the sequence, its splits and each task
    summary = (
        "would run: wordnet-supersenses-5x4-seed0 (class-incremental), 5 tasks, 20 classes, 800 train / "
        "400 validation / 800 test"
    )
    assert summary in out
    assert out.count("\n  t") == 5
    assert peft_ext_cli.main(["check", "quickstart_typo"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_configs_copy_brings_the_data_files_a_config_names(tmp_path, monkeypatch, capsys):
    """Relative data paths are read from the config's folder: the copy runs where it was written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job").mkdir()
    assert peft_ext_cli.main(["configs", "--copy", "wordnet_csv", "job"]) == 0
    assert "and the 2 data file(s) it names" in capsys.readouterr().out
    shipped = Path(peft_ext_cli.configs_dir())
    for rel in ("data/wordnet_train.csv", "data/wordnet_test.csv"):
        assert (tmp_path / "job" / rel).read_bytes() == (shipped / rel).read_bytes()
    assert peft_ext_cli.main(["configs", "--copy", "instructions_jsonl", "job"]) == 0
    assert len(list((tmp_path / "job" / "data" / "instructions").glob("*.jsonl"))) == 3
    # a data file already there is not overwritten, and nothing is written
    (tmp_path / "job" / "wordnet_csv.yaml").unlink()
    capsys.readouterr()
    assert peft_ext_cli.main(["configs", "--copy", "wordnet_csv", "job"]) == 2
    assert "data/wordnet_train.csv already exists" in capsys.readouterr().err
    assert not (tmp_path / "job" / "wordnet_csv.yaml").exists()


def test_configs_copy_writes_a_copy_and_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    source = (ROOT / "configs" / "quickstart.yaml").read_text()
    assert peft_ext_cli.main(["configs", "--copy", "quickstart"]) == 0
    assert (tmp_path / "quickstart.yaml").read_text() == source
    assert peft_ext_cli.main(["configs", "--copy", "mora_emoji", "mine.yaml"]) == 0
    assert (tmp_path / "mine.yaml").read_text() == (ROOT / "configs" / "mora_emoji.yaml").read_text()
    (tmp_path / "mine.yaml").write_text("edited\n")
    capsys.readouterr()
    assert peft_ext_cli.main(["configs", "--copy", "quickstart", "mine.yaml"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "mine.yaml").read_text() == "edited\n"
    (tmp_path / "d").mkdir()
    assert peft_ext_cli.main(["configs", "--copy", "quickstart", "d"]) == 0  # a folder: NAME.yaml inside it
    assert (tmp_path / "d" / "quickstart.yaml").read_text() == source
    assert peft_ext_cli.main(["configs", "--copy", "nope"]) == 2
    assert "no shipped config 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        peft_ext_cli.main(["configs", "--copy", "quickstart", "a.yaml", "b.yaml"])


def test_every_package_of_the_source_tree_is_listed_for_the_wheel():
    """setuptools ships only the listed packages: a new subpackage left out would import from a checkout and fail
    from the wheel."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(root).parts)
        for p in (root / "peft_ext").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set()
