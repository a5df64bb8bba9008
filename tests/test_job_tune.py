"""``peft-ext run --tune``: each method's learning rate chosen on the validation split inside the job, with the same
grid budget for every method, under both protocols; resumable; refused before any training without validation data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from peft_ext.continual.published import published_table
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
        if val_per_class is None:  # the shipped config has a validation split: this run has none
            data["data"].pop("val_per_class", None)
        else:
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
        # a 2-point grid has no interior: every choice is at its edge, and said to be
        edge = "low" if chosen["lr"] == min(grid) else "high"
        assert chosen["edge"] == edge and f"{row['label']}: the chosen lr is the {edge} edge of the grid" in out
        line = f"| {row['label']} | sequence | {chosen['lr']:.3g} ({edge} edge of the grid) | {scores} |"
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
    # `check --tune` says so too, and `check` without --tune still passes the same config
    assert main(["check", str(cfg), "--tune"]) == 2
    assert "--tune needs validation examples in every task" in capsys.readouterr().err
    assert main(["check", str(cfg)]) == 0


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


def test_one_method_setting_is_tuned_at_the_chosen_lr_for_the_test_run(tmp_path, backbone, monkeypatch, capsys):
    """``tune.settings``: SplitLoRA's trade-off tried at its chosen lr (the configured value is the lr grid's run),
    the best value used for the test run, reported, cached for --resume; a method without a setting is unchanged."""
    from peft_ext.jobs import tuning

    seen = []
    original = tuning.run_sequence

    def spy(sequence, method, *args, **kwargs):
        options = method.options
        seen.append((method.name, options.lr, getattr(getattr(options, "adapter", None), "trade_off", None)))
        return original(sequence, method, *args, **kwargs)

    monkeypatch.setattr(tuning, "run_sequence", spy)
    cfg = _cfg(tmp_path, backbone)
    data = yaml.safe_load(cfg.read_text())
    data["tune"]["settings"] = {"splitlora": {"adapter.trade_off": [20.0, 2.0]}}
    cfg.write_text(yaml.safe_dump(data))
    assert main(["run", str(cfg), "--no-progress", "--tune"]) == 0
    out = capsys.readouterr().out
    results = {r["label"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["results"]}
    split = results["splitlora"]["extras"]["tuning"]
    # the lr grid at the configured trade-off (20), then one more run: trade-off 2 at the chosen lr
    assert [s for s in seen if s[0] == "splitlora"] == [
        ("splitlora", 1e-4, 20.0),
        ("splitlora", 1e-2, 20.0),
        ("splitlora", split["lr"], 2.0),
    ]
    setting = split["setting"]
    assert setting["key"] == "adapter.trade_off" and list(setting["validation"]) == ["20.0", "2.0"]
    assert setting["validation"]["20.0"] == split["validation"][f"{split['lr']:g}"]
    best = max(setting["validation"].values())
    assert setting["value"] == (20.0 if setting["validation"]["20.0"] == best else 2.0)
    assert f"splitlora: adapter.trade_off {json.dumps(setting['value'])} chosen at lr {split['lr']:g}" in out
    assert "setting" not in results["seq_lora"]["extras"]["tuning"]
    report = (tmp_path / "out" / "results.md").read_text()
    assert (
        f"`adapter.trade_off` {json.dumps(setting['value'])} (20.0: " in report and "| seq_lora | sequence |" in report
    )
    # the options of the test run carry the chosen value
    entry = next(
        e
        for e in __import__("peft_ext.continual.config", fromlist=["x"]).load_config(cfg).methods
        if e.name == "splitlora"
    )
    assert tuning.tuned_options(entry, split).adapter.trade_off == setting["value"]
    assert tuning.tuned_options(entry, split).lr == split["lr"]
    # --resume trains no grid point again
    seen.clear()
    monkeypatch.setattr(tuning, "run_sequence", lambda *a, **k: pytest.fail("grid re-run"))
    assert main(["run", str(cfg), "--no-progress", "--tune", "--resume"]) == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"nope": {"lr": [1.0]}}, "tune.settings"),
        ({"splitlora": {"adapter.trade_of": [2.0]}}, "unknown key `adapter.trade_of` (did you mean `trade_off`?)"),
        ({"splitlora": {"adapter.trade_off": [-1.0]}}, "`adapter.trade_off: -1.0`"),
        ({"splitlora": {"adapter.trade_off": [2.0], "adapter.r": [4]}}, "exactly one setting"),
        ({"splitlora": {"adapter.trade_off": [2.0, 2.0]}}, "lists a value twice"),
        ({"splitlora": {"adapter.trade_off": []}}, "at least one value"),
    ],
)
def test_a_bad_tuned_setting_is_refused_before_training(tmp_path, backbone, capsys, settings, message):
    cfg = _cfg(tmp_path, backbone)
    data = yaml.safe_load(cfg.read_text())
    data["tune"]["settings"] = settings
    cfg.write_text(yaml.safe_dump(data))
    assert main(["run", str(cfg), "--no-progress", "--tune"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "tuning.json").exists()


def test_a_choice_at_the_edge_of_the_grid_is_flagged_with_the_wider_grid_to_try():
    from peft_ext.continual.engine import MethodResult
    from peft_ext.continual.report import tuning_table
    from peft_ext.jobs.tuning import edge_advice, grid_edge

    grid = [0.000316, 0.001, 0.00316]
    assert grid_edge(0.00316, grid) == "high" and grid_edge(0.000316, grid) == "low"
    assert grid_edge(0.001, grid) is None and grid_edge(0.001, [0.001]) is None
    assert edge_advice("high", [0.316, 1.0, 3.16]) == (
        "the chosen lr is the high edge of the grid, so a higher one may score better: widen the grid "
        "(e.g. --set tune.lr_factors=[0.316,1,3.16,9.99])"
    )
    assert "tune.lr_factors=[0.1,0.316,1,3.16]" in edge_advice("low", [0.316, 1.0, 3.16])
    tuning = {"protocol": "sequence", "validation": {"0.001": 0.5, "0.00316": 0.6}, "lr": 0.00316, "edge": "high"}
    result = MethodResult("m", "m", [[0.5]], {"final_acc": 0.5}, 1, 1, 0.0, 0.0, [0.1], {"tuning": tuning})
    assert "| m | sequence | 0.00316 (high edge of the grid) |" in tuning_table([result])
