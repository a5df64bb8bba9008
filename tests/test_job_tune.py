"""``peft-ext run --tune``: each method's learning rate chosen on the validation split inside the job, with the same
grid budget for every method, under both protocols; resumable; refused before any training without validation data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peft_ext.continual.report import published_table
from peft_ext_cli import main

from .helpers import job_config, save_tiny_bert

METHODS = ["seq_lora", "splitlora"]


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=1, seed=0)


def _cfg(tmp_path: Path, backbone: Path, val_per_class: int | None = 2, protocol: str = "sequence") -> Path:
    def edit(data: dict) -> None:
        data["model"].update(backbone=str(backbone), dropout=0.0)
        data["data"].update(n_tasks=2, classes_per_task=2, train_per_class=8, test_per_class=4)
        if val_per_class is not None:
            data["data"]["val_per_class"] = val_per_class
        data["train"].update(epochs=1, batch_size=4)
        data["methods"] = [m for m in data["methods"] if m["name"] in METHODS]
        for m in data["methods"]:
            m["adapter"]["r"] = 2
            m["lr"] = 1e-3
        data["tune"] = {"protocol": protocol, "lr_factors": [0.1, 10.0]}

    return job_config(tmp_path, "quickstart", edit)


def test_tune_chooses_each_lr_on_validation_and_runs_the_best_on_test(tmp_path, backbone, capsys):
    cfg = _cfg(tmp_path, backbone)
    assert main(["run", str(cfg), "--no-progress", "--tune"]) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    tuning = json.loads((tmp_path / "out" / "tuning.json").read_text())
    assert tuning["config_hash"] == results["meta"]["config_hash"] and tuning["protocol"] == "sequence"
    for row in results["results"]:
        chosen = row["extras"]["tuning"]
        grid = {float(k): v for k, v in chosen["validation"].items()}
        assert sorted(grid) == [1e-4, 1e-2]  # the same budget for every method: lr x each factor
        assert chosen["lr"] == max(grid, key=grid.get) and chosen["protocol"] == "sequence"
        assert tuning["scores"][row["label"]] == chosen["validation"]
        assert f"{row['label']}: lr {chosen['lr']:g} chosen on validation (the whole sequence" in out
        # the report and the published table carry the same choice and the whole grid's scores
        scores = ", ".join(f"{lr:.3g}: {100 * acc:.1f}" for lr, acc in sorted(grid.items()))
        line = f"| {row['label']} | sequence | {chosen['lr']:.3g} | {scores} |"
        assert line in (tmp_path / "out" / "results.md").read_text()
        assert line in published_table(tmp_path / "out" / "results.json")

    # --resume of the finished, tuned job trains nothing again
    before = (tmp_path / "out" / "tuning.json").read_text()
    assert main(["run", str(cfg), "--no-progress", "--tune", "--resume"]) == 0
    assert capsys.readouterr().out.count("finished in the run being resumed") == len(METHODS)
    assert (tmp_path / "out" / "tuning.json").read_text() == before
    again = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["accuracy_matrix"] for r in again["results"]] == [r["accuracy_matrix"] for r in results["results"]]


def test_first_task_protocol_scores_the_first_task_only(tmp_path, backbone, monkeypatch, capsys):
    from peft_ext.jobs import tuning

    seen = []
    original = tuning.run_sequence

    def spy(sequence, *args, **kwargs):
        seen.append((len(sequence), sequence.meta.get("split")))
        return original(sequence, *args, **kwargs)

    monkeypatch.setattr(tuning, "run_sequence", spy)
    cfg = _cfg(tmp_path, backbone, protocol="first_task")
    assert main(["run", str(cfg), "--no-progress", "--tune", "--only", "seq_lora"]) == 0
    assert seen == [(1, "validation"), (1, "validation")]  # two grid points, one task each, on validation data
    assert "(the first task;" in capsys.readouterr().out


def test_tune_without_validation_data_is_refused_before_training(tmp_path, backbone, capsys):
    cfg = _cfg(tmp_path, backbone, val_per_class=None)
    assert main(["run", str(cfg), "--no-progress", "--tune"]) == 2
    err = capsys.readouterr().err
    assert "--tune needs validation examples in every task" in err and "data.val_per_class" in err
    assert not (tmp_path / "out" / "tuning.json").exists()


def test_tune_settings_are_checked(tmp_path, backbone, capsys):
    cfg = _cfg(tmp_path, backbone)
    assert main(["check", str(cfg), "--set", "tune.protocol=first", "--tune"]) == 2
    assert "`tune.protocol` must be one of ('sequence', 'first_task'), got 'first'" in capsys.readouterr().err
    assert main(["check", str(cfg), "--set", "tune.lr_factors=[1, 1]"]) == 2
    assert "`tune.lr_factors` lists a factor twice" in capsys.readouterr().err


def test_an_interrupted_tuning_resumes_from_the_finished_grid_points(tmp_path, backbone, monkeypatch, capsys):
    """Grid points finished before an interruption are read from tuning.json, not trained again, and decide the lr."""
    from peft_ext.jobs import tuning

    cfg = _cfg(tmp_path, backbone)
    assert main(["run", str(cfg), "--no-progress", "--tune", "--only", "seq_lora"]) == 0
    out = tmp_path / "out"
    # as if the job stopped after seq_lora's grid, before its run: no result yet, and the grid now favours lr 1e-4
    results = json.loads((out / "results.json").read_text())
    results["results"] = []
    (out / "results.json").write_text(json.dumps(results))
    saved = json.loads((out / "tuning.json").read_text())
    saved["scores"]["seq_lora"] = {"0.0001": 0.9, "0.01": 0.1}
    (out / "tuning.json").write_text(json.dumps(saved))
    grid_runs = []
    monkeypatch.setattr(tuning, "run_sequence", lambda *a, **k: grid_runs.append(a) or pytest.fail("grid re-run"))
    capsys.readouterr()
    assert main(["run", str(cfg), "--no-progress", "--tune", "--only", "seq_lora", "--resume"]) == 0
    assert grid_runs == [] and "seq_lora: lr 0.0001 chosen on validation" in capsys.readouterr().out
    row = json.loads((out / "results.json").read_text())["results"][0]
    assert row["extras"]["tuning"]["lr"] == 1e-4
