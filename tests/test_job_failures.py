"""A job never loses finished work: each method's results are written as soon as it finishes, a failing method is
recorded with its error while the others still run, and the user sees one clear line per failure."""

import json

import pytest

from peft_ext_cli import main

from .helpers import TEST_HEAD_DIM, job_config, save_tiny_bert


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=1, seed=0)


def _three_methods(tmp_path, backbone, splitlora_r):
    def edit(data: dict) -> None:
        data["model"]["backbone"] = str(backbone)
        data["data"].update(n_tasks=2, classes_per_task=2, train_per_class=4, test_per_class=2)
        data["train"].update(epochs=1, batch_size=8)
        keep = {"frozen_linear", "splitlora", "seq_lora"}
        data["methods"] = [m for m in data["methods"] if m["name"] in keep]
        order = ["frozen_linear", "splitlora", "seq_lora"]
        data["methods"].sort(key=lambda m: order.index(m["name"]))
        data["methods"][1]["adapter"]["r"] = splitlora_r
        data["methods"][2]["adapter"]["r"] = 2

    return job_config(tmp_path, "quickstart", edit)


def test_failed_method_is_recorded_and_the_others_finish(tmp_path, tiny_backbone, capsys, monkeypatch):
    # r=40 is above the tiny model's width (32). `run` now rejects that up front (test_preflight.py); with the dry
    # build switched off it stands for any failure found late: SplitLoRA fails when it draws A, after method 1 ran.
    from peft_ext.jobs import preflight

    monkeypatch.setattr(preflight, "check_adapters", lambda config, model_config: None)
    cfg = _three_methods(tmp_path, tiny_backbone, splitlora_r=40)
    assert main(["run", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    failed = [line for line in err.splitlines() if " failed: " in line]
    assert len(failed) == 1 and "splitlora" in failed[0] and "40" in failed[0], err
    assert "Traceback" not in err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["method"] for r in results["results"]] == ["frozen_linear", "seq_lora"]
    assert [f["method"] for f in results["failed"]] == ["splitlora"]
    assert "40" in results["failed"][0]["error"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## failed" in md and "splitlora" in md.split("## failed")[1]
    assert (tmp_path / "out" / "accuracy_matrix.png").stat().st_size > 1000


def test_results_accumulate_after_each_method(tmp_path, tiny_backbone, monkeypatch):
    """After method k the report on disk holds methods 1..k: snapshot results.json when each method starts."""
    from peft_ext.jobs import continual

    seen = []
    real = continual.run_sequence

    def spy(sequence, method, *args, **kwargs):
        path = tmp_path / "out" / "results.json"
        seen.append([r["method"] for r in json.loads(path.read_text())["results"]] if path.exists() else [])
        return real(sequence, method, *args, **kwargs)

    monkeypatch.setattr(continual, "run_sequence", spy)
    cfg = _three_methods(tmp_path, tiny_backbone, splitlora_r=2)
    assert main(["run", str(cfg), "--no-progress"]) == 0
    assert seen == [[], ["frozen_linear"], ["frozen_linear", "splitlora"]]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["method"] for r in results["results"]] == ["frozen_linear", "splitlora", "seq_lora"]
    assert "failed" not in results
    # every row records what its method ran with: the options with their defaults filled in, the training settings
    split = results["results"][1]["extras"]["settings"]
    assert split["options"]["adapter"]["r"] == 2 and split["options"]["lr"] == pytest.approx(5e-3)
    assert split["options"]["head"] == {"name": "analytic", "dim": TEST_HEAD_DIM} and split["train"]["epochs"] == 1
    assert "progress" not in split["train"]
    # the report says how many test examples there are and what one run can tell apart
    assert results["meta"]["test_examples"] == [4, 4]
    assert "Test examples: 4 per task, 8 in all" in (tmp_path / "out" / "results.md").read_text()
    assert results["results"][2]["extras"]["settings"]["options"]["adapter"]["target_modules"]


def test_unexpected_error_is_one_line_and_debug_shows_the_traceback(tmp_path, tiny_backbone, capsys, monkeypatch):
    from peft_ext.jobs import continual

    def boom(config, tokenizer=None):
        raise OSError("disk on fire: /nowhere")

    monkeypatch.setattr(continual, "build_sequence", boom)
    cfg = _three_methods(tmp_path, tiny_backbone, splitlora_r=2)
    assert main(["run", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "peft-ext: error: OSError: disk on fire: /nowhere (run with --debug for the traceback)"
    ]
    with pytest.raises(OSError, match="disk on fire"):
        main(["run", str(cfg), "--no-progress", "--debug"])
