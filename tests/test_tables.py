"""Published numbers come from files that runs write: every generated table in the README and docs/ equals the
table its results file gives, and ``peft-ext table`` prints and rewrites them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peft_ext.continual.report import GENERATED_CLOSE, GENERATED_OPEN, generated_blocks, published_table
from peft_ext_cli import main

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_publishes_the_make_run_table_from_its_results_file():
    sources = [source for source, _ in generated_blocks((ROOT / "README.md").read_text())]
    assert "docs/results/quickstart.json" in sources


@pytest.mark.parametrize("markdown", MARKDOWN, ids=lambda p: p.name)
def test_every_generated_table_equals_its_results_file(markdown):
    for source, body in generated_blocks(markdown.read_text()):
        assert body == published_table(markdown.parent / source), (
            f"{markdown.name}'s table from {source} was edited by hand or its results changed: run "
            f"`peft-ext table --into {markdown.relative_to(ROOT)}`"
        )


def _results(path: Path, final: float) -> Path:
    row = {
        "method": "seq_lora",
        "label": "seq_lora",
        "accuracy_matrix": [[0.9, None], [0.5, 0.8]],
        "metrics": {"final_acc": final, "avg_incremental_acc": 0.8, "bwt": -0.4, "forgetting": 0.4},
        "trainable_params": 1234,
        "total_params": 99999,
        "train_seconds": 10.0,
        "eval_seconds": 2.0,
        "task_losses": [0.5, 0.6],
        "extras": {},
    }
    meta = {"name": "x", "torch": "2.13.0", "threads": 2, "machine": "x86_64", "wall_seconds": 13.0}
    path.write_text(json.dumps({"meta": meta, "tasks": ["a", "b"], "results": [row]}))
    return path


def test_table_prints_and_rewrites_only_the_generated_block(tmp_path, capsys):
    results = _results(tmp_path / "r.json", 0.65)
    assert main(["table", str(results)]) == 0
    printed = capsys.readouterr().out
    # "acc after learning" (85.0) comes from the matrix's diagonal: results saved before the metric existed
    assert "| seq_lora | 65.0 | 85.0 | 80.0 | -40.0 | 40.0 | 1,234 |" in printed
    assert "10 s training + 2 s evaluation" in printed

    page = tmp_path / "page.md"
    stale = GENERATED_OPEN.format(source="r.json") + "\n| old |\n" + GENERATED_CLOSE
    page.write_text(f"# Title\n\nbefore\n\n{stale}\n\nafter\n")
    assert main(["table", "--into", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "| old |" not in text and published_table(results) in text

    _results(results, 0.7)  # a new run: the page follows
    assert main(["table", "--into", str(page)]) == 0
    assert "| seq_lora | 70.0 |" in page.read_text()


def test_table_refuses_a_file_that_is_not_results_and_leaves_the_page(tmp_path, capsys):
    (tmp_path / "bad.json").write_text('{"meta": {}}')
    page = tmp_path / "page.md"
    before = GENERATED_OPEN.format(source="bad.json") + "\n| kept |\n" + GENERATED_CLOSE + "\n"
    page.write_text(before)
    assert main(["table", "--into", str(page)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "is not a results.json of a continual job" in err
    assert page.read_text() == before
    assert main(["table", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
