"""docs/adding_a_head.md, proven: the page's head, written into a temporary module and declared as a ``peft_ext.heads``
entry point of a temporary distribution, is found by its name in a ``peft-ext run`` job (a new process, nothing
imported by hand) and named in its report; in this process its scores are the nearest class mean's, its state
round-trips through ``torch.load(weights_only=True)``, and a broken entry point beside it is skipped with a warning."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peft_ext.continual.heads import HEADS
from peft_ext.plugins import _LOADED, ENTRY_POINT_GROUPS, load_entry_points

from .helpers import ROOT, job_config, offline_env, save_tiny_bert

PAGE = ROOT / "docs" / "adding_a_head.md"
MODULE = "peft_ext_euclidean_demo"


def _distribution(site: Path, name: str, entry_points: str) -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def site(tmp_path):
    """A folder that holds the page's head as a module and two distributions declaring heads: the page's, and one
    whose module does not exist."""
    (block,) = re.findall(r"```python\n(.*?)\n```", PAGE.read_text(), re.S)
    site = tmp_path / "site"
    site.mkdir()
    (site / f"{MODULE}.py").write_text(block + "\n")
    _distribution(site, "euclidean-demo", f"[peft_ext.heads]\neuclidean = {MODULE}\n")
    _distribution(site, "broken-demo", "[peft_ext.heads]\nbroken = no_such_module_anywhere\n")
    return site


@pytest.fixture
def registered(site, monkeypatch):
    """The head loaded through its entry point in this process; removed after."""
    group = ENTRY_POINT_GROUPS["heads"]
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(_LOADED, group, set(_LOADED.get(group, ())))
    with pytest.warns(UserWarning, match=r"entry point 'broken' \(no_such_module_anywhere\) failed to load"):
        loaded = load_entry_points(group)
    assert loaded == ["euclidean"]
    yield HEADS["euclidean"]
    HEADS.pop("euclidean", None)
    sys.modules.pop(MODULE, None)


def test_the_head_scores_the_nearest_mean_and_keeps_its_state(registered, tmp_path):
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 5, generator=g, dtype=torch.float64) * 3
    labels = torch.arange(3).repeat_interleave(20)
    features = centers[labels] + torch.randn(60, 5, generator=g, dtype=torch.float64)
    head = registered(num_classes=4)
    head.begin_task(0, None, 5)
    for part in (slice(0, 25), slice(25, 60)):  # any batch split
        head.accumulate(features[part], labels[part])
    head.end_task(torch.nn.Linear(1, 1), 0, None)
    queries = torch.randn(10, 5, generator=g, dtype=torch.float64) * 3
    means = torch.stack([features[labels == c].mean(0) for c in range(3)])
    expected = torch.cdist(queries, means).argmin(1)
    scores = head.scores(queries.float())
    assert torch.equal(scores.argmax(1), expected)
    assert torch.isinf(scores[:, 3]).all()  # class 3 not learned yet
    torch.save(head.state_dict(), tmp_path / "head.pt")
    again = registered(num_classes=4)
    again.load_state_dict(torch.load(tmp_path / "head.pt", weights_only=True))
    assert torch.equal(again.scores(queries.float()), scores)
    assert registered.bytes_per_class(registered.options_cls(), 5) == 48
    with pytest.raises(ValueError, match=r"`head.scale` must be a number > 0, got 0"):
        registered.options_cls(scale=0).validate()


@pytest.mark.slow  # one `peft-ext run` of a 2-task sequence on a tiny BERT in a new process: about 15 s
def test_a_job_finds_the_head_by_its_entry_point_and_reports_it(site, tmp_path):
    backbone = save_tiny_bert(tmp_path / "bert", num_layers=1, seed=0)

    def edit(data: dict) -> None:
        data["model"]["backbone"] = str(backbone)
        data["data"].update(n_tasks=2, classes_per_task=2, train_per_class=8, test_per_class=4)
        data["train"].update(epochs=1, batch_size=8)
        data["methods"] = [{"name": "frozen_linear", "lr": 5e-3, "head": {"name": "euclidean", "scale": 2.0}}]

    cfg = job_config(tmp_path, "quickstart", edit)
    env = offline_env(threads=1)
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    proc = subprocess.run(
        [sys.executable, "-m", "peft_ext", "run", str(cfg), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'broken'" in proc.stderr and "failed to load" in proc.stderr  # the broken plug-in: warned, skipped
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    assert row["extras"]["head"]["name"] == "euclidean"
    assert "| frozen_linear | euclidean |" in (tmp_path / "out" / "results.md").read_text()
    assert 0.0 <= row["metrics"]["final_acc"] <= 1.0
