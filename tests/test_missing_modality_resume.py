"""The ``job: missing_modality`` job never loses a finished grid cell: results on disk after every cell, a failed cell
recorded while the others run, Ctrl-C then ``--resume`` ending with the rows of an uninterrupted run, and a changed
config refused on ``--resume`` (tiny sizes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from peft_ext.cli import main
from peft_ext.fileperm import current_umask
from peft_ext.multimodal import experiment

from .helpers import job_config, save_tiny_bert

# two cells, linear probe then LoRA, under one missing setting and one seed (the cheapest grid with a cell after
# the one that fails or is interrupted)
METHODS = ["linear_probe", "lora"]
TIMING_KEYS = {"train_s"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny 3-layer BERT text tower and one backbone cache shared by every run of the module."""
    root = tmp_path_factory.mktemp("mm-resume")
    return {"text": save_tiny_bert(root / "bert", num_layers=3), "cache": root / "cache"}


def _config(folder: Path, tiny: dict[str, Path]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)

    def edit(data: dict) -> None:
        data["model"].update(
            text=str(tiny["text"]),
            vision_width=24,
            vision_layers=2,
            vision_heads=2,
            embed_dim=8,
            pretrain_epochs=1,
            train_limit=96,
            epochs=1,
            timing_batches=1,
            cache_dir=str(tiny["cache"]),
        )
        data["grid"].update(rates=[0.7], kinds=["both"], seeds=[0])
        data["methods"] = METHODS

    return job_config(folder, "mora_emoji", edit)


def _rows(out: Path) -> list[dict]:
    """The result rows without timings (the only part an interruption may change)."""
    rows = json.loads((out / "results.json").read_text())["results"]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny) -> dict:
    """An uninterrupted run (it pretrains the shared backbone cache)."""
    cfg = _config(tmp_path_factory.mktemp("reference"), tiny)
    assert main(["run", str(cfg)]) == 0
    out = cfg.parent / "out"
    return {"cfg": cfg, "out": out, "rows": _rows(out)}


def _count_cells(monkeypatch, fail_at: int | None = None, error: BaseException | None = None) -> list[tuple]:
    """Wrap :func:`experiment.run_method`: record each cell it runs; the ``fail_at``-th call (1-based) raises
    ``error`` instead."""
    calls: list[tuple] = []
    real = experiment.run_method

    def run_method(prep, method, spec, seed=0):
        calls.append((method, seed))
        if len(calls) == fail_at:
            raise error
        return real(prep, method, spec, seed)

    monkeypatch.setattr(experiment, "run_method", run_method)
    return calls


def test_reference_rows_are_written_with_the_config_hash_and_umask_modes(reference):
    out = reference["out"]
    assert [(r["method"], r["seed"]) for r in reference["rows"]] == [("linear_probe", 0), ("lora", 0)]
    payload = json.loads((out / "results.json").read_text())
    assert len(payload["meta"]["config_hash"]) == 16 and "failed" not in payload
    assert set(payload["meta"]["inference_ms_per_64"]) == set(METHODS)
    assert "| LoRA (both towers) |" in (out / "results.md").read_text()
    for name in ("results.json", "results.md"):
        assert os.stat(out / name).st_mode & 0o777 == 0o666 & ~current_umask()
    assert not list(out.glob(".*.tmp"))  # no temporary left behind


def test_a_failed_cell_is_recorded_and_the_others_still_run(tmp_path, tiny, reference, monkeypatch, capsys):
    cfg = _config(tmp_path, tiny)
    calls = _count_cells(monkeypatch, fail_at=1, error=ValueError("`r` 99 is above the width 24\nsecond line"))
    assert main(["run", str(cfg)]) == 1
    assert calls == [("linear_probe", 0), ("lora", 0)]  # the cell after the failed one ran
    err = capsys.readouterr().err
    label = "linear_probe (rate 0.7 both, seed 0)"
    assert f"peft-ext: method {label} failed: ValueError: `r` 99 is above the width 24\n" in err
    assert "second line" not in err and "Traceback" not in err
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert payload["failed"] == [
        {
            "rate": 0.7,
            "kind": "both",
            "method": "linear_probe",
            "seed": 0,
            "label": label,
            "error": "ValueError: `r` 99 is above the width 24",
        }
    ]
    # the other cell's row is on disk, equal to the uninterrupted run's: it does not depend on the cells before it
    assert _rows(tmp_path / "out") == reference["rows"][1:]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## failed" in md and f"- {label}: ValueError: `r` 99" in md
    assert set(payload["meta"]["inference_ms_per_64"]) == {"lora"}  # only a method that built is timed


def test_ctrl_c_then_resume_ends_with_the_rows_of_an_uninterrupted_run(tmp_path, tiny, reference, monkeypatch, capsys):
    cfg = _config(tmp_path, tiny)
    out = tmp_path / "out"
    _count_cells(monkeypatch, fail_at=2, error=KeyboardInterrupt())
    assert main(["run", str(cfg)]) == 130
    assert f"peft-ext run {cfg} --resume" in capsys.readouterr().err
    assert _rows(out) == reference["rows"][:1]  # the cell that finished is on disk
    assert "| frozen + linear head |" in (out / "results.md").read_text()

    monkeypatch.undo()
    calls = _count_cells(monkeypatch)
    assert main(["run", str(cfg), "--resume"]) == 0
    stdout = capsys.readouterr().out
    assert "loaded the pretrained dual encoder" in stdout  # the cached backbone, not pretrained again
    assert "linear_probe seed 0: finished in an earlier run" in stdout
    assert calls == [("lora", 0)]  # only the cell not finished
    assert _rows(out) == reference["rows"]
    payload = json.loads((out / "results.json").read_text())
    assert set(payload["meta"]["inference_ms_per_64"]) == set(METHODS)


def test_resume_with_a_changed_config_is_refused(reference, capsys):
    before = (reference["out"] / "results.json").read_text()
    assert main(["run", str(reference["cfg"]), "--set", "model.lr=0.02", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "peft-ext: config error: --resume: the results in" in err
    assert "were made with a different config (hash" in err
    assert (reference["out"] / "results.json").read_text() == before  # nothing touched
