"""The job keeps what it trained (output.dir/adapters/<label>), and `peft-ext predict` / `load_trained` use it: each
reloaded method predicts what the run scored, exactly."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shutil

import pytest
import torch
import yaml

from peft_ext.continual.config import load_config
from peft_ext.continual.trained import MODEL_FILE, load_trained, read_texts
from peft_ext.jobs.resume import config_hash
from peft_ext.jobs.saved import trained_folder
from peft_ext.jobs.sequence import build_sequence
from peft_ext_cli import main

from .helpers import job_config, save_tiny_bert

#: One method per way a model is kept: a PEFT adapter scored by a feature head (splitlora + analytic), a PEFT adapter
#: with its linear head (seq_lora), the cosine head that replaces the classifier, a frozen backbone whose head alone
#: trains (frozen_linear: weights.safetensors), a training-free head (ncm: head.pt only), the upper bound (joint).
METHODS = [
    {"name": "splitlora", "head": "analytic", "lr": 0.005},
    {"name": "seq_lora", "lr": 0.003},
    {"name": "splitlora", "label": "split_cosine", "head": "cosine", "lr": 0.005},
    {"name": "frozen_linear", "lr": 0.01},
    {"name": "ncm"},
    {"name": "joint", "lr": 0.003},
]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    backbone = save_tiny_bert(tmp / "tiny-bert", num_layers=1, seed=0)

    def edit(data: dict) -> None:
        data["model"]["backbone"] = str(backbone)
        data["data"].update(n_tasks=2, classes_per_task=2, train_per_class=8, test_per_class=4)
        data["train"].update(epochs=2, batch_size=8, progress=False)
        data["methods"] = METHODS

    config = job_config(tmp, "quickstart", edit)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["run", str(config), "--no-progress"]) == 0
    return config, tmp / "out", printed.getvalue()


def test_every_method_is_saved_and_reloads_to_the_predictions_the_run_scored(job):
    config, out, _ = job
    results = {r.get("label") or r["method"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    sequence = build_sequence(load_config(config), None)
    tests = [example for task in sequence.tasks for example in task.test]
    kept = {}
    for label in ["splitlora", "seq_lora", "split_cosine", "frozen_linear", "ncm", "joint"]:
        folder = out / "adapters" / label
        kept[label] = sorted(p.name for p in folder.iterdir())
        model = load_trained(folder)
        predicted = model.scores([e.inputs for e in tests]).argmax(-1)
        accuracy = (predicted == torch.tensor([e.label for e in tests])).float().mean().item()
        # every task has the same number of test examples, so the final row's mean is the overall accuracy
        assert accuracy == pytest.approx(results[label]["metrics"]["final_acc"], abs=1e-9), label
        assert model.class_names == list(sequence.class_names)
        assert set(model.predict(["a dog", "to run"])) <= set(sequence.class_names)
    assert {"adapter_config.json", "adapter_model.safetensors", "head.pt", MODEL_FILE} <= set(kept["splitlora"])
    assert "weights.safetensors" not in kept["splitlora"]
    assert kept["frozen_linear"] == ["head.pt", MODEL_FILE, "weights.safetensors"]  # the trained classifier only
    assert kept["ncm"] == ["head.pt", MODEL_FILE]
    meta = json.loads((out / "adapters" / "splitlora" / MODEL_FILE).read_text())
    assert meta["head"]["name"] == "analytic" and meta["method"] == "splitlora" and meta["num_classes"] == 4


def test_the_frozen_backbone_keeps_only_the_tensors_it_changed(job):
    from safetensors.torch import load_file

    _, out, _ = job
    saved = load_file(str(out / "adapters" / "frozen_linear" / "weights.safetensors"))
    assert set(saved) == {"classifier.weight", "classifier.bias"}


def test_predict_picks_the_best_continual_method_and_prints_one_line_per_text(job, tmp_path, capsys):
    config, out, _ = job
    texts = tmp_path / "texts.txt"
    texts.write_text("a domestic animal\n\n  a tall plant with a trunk  \n")
    capsys.readouterr()
    assert main(["predict", str(config), str(texts)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert [line.split("\t")[1] for line in lines] == ["a domestic animal", "a tall plant with a trunk"]
    results = [r for r in json.loads((out / "results.json").read_text())["results"] if r["method"] != "joint"]
    # chosen on the validation split (the quickstart config has one), so the test figure stays a fair estimate
    validation = {r.get("label") or r["method"]: r["extras"]["final_validation"]["acc"] for r in results}
    best = max(validation, key=validation.get)
    # the job's last line suggests the same method predict picks, by the job's folder
    (advice,) = [line for line in job[2].splitlines() if "classify new texts" in line]
    assert (
        f"`peft-ext predict {out} TEXTS.txt` (it uses {best}, the best continual method of this run on the " in advice
    )
    assert (
        f"predicting with {best} (final accuracy {100 * validation[best]:.1f} % on the validation split"
        in captured.err
    )
    folder, _ = trained_folder(out, "seq_lora")
    assert main(["predict", str(folder), str(texts)]) == 0
    by_folder = capsys.readouterr().out
    assert by_folder.splitlines() and all(line.split("\t")[0] for line in by_folder.splitlines())
    assert main(["predict", str(out), str(texts), "--method", "seq_lora"]) == 0
    assert capsys.readouterr().out == by_folder


def test_predict_errors_name_the_file_and_the_fix(job, tmp_path, capsys):
    _, out, _ = job
    assert main(["predict", str(out), str(tmp_path / "t.txt"), "--method", "nope"]) == 2
    assert "no saved method 'nope'" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    assert main(["predict", str(out), str(empty)]) == 2
    assert "holds no text to classify" in capsys.readouterr().err
    table = tmp_path / "t.csv"
    table.write_text("sentence,label\nhello,x\n")
    with pytest.raises(ValueError, match=r"no column 'text'; columns: \['sentence', 'label'\] \(pass --column\)"):
        read_texts(table)
    assert read_texts(table, "sentence") == ["hello"]
    lines = tmp_path / "t.jsonl"
    lines.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert read_texts(lines) == ["one", "two"]
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        read_texts(latin)
    assert main(["predict", str(tmp_path), str(lines)]) == 2
    assert "no trained models under" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds the methods .* under adapters/"):
        load_trained(out)


def test_save_adapters_false_keeps_nothing_and_does_not_change_the_fingerprint(tmp_path):
    backbone = save_tiny_bert(tmp_path / "tiny-bert", num_layers=1, seed=0)

    def edit(data: dict) -> None:
        data["model"]["backbone"] = str(backbone)
        data["data"].update(n_tasks=2, classes_per_task=2, train_per_class=4, test_per_class=2)
        data["train"].update(epochs=1, batch_size=8, progress=False)
        data["methods"] = [{"name": "ncm"}]
        data["output"]["save_adapters"] = False

    config = job_config(tmp_path, "quickstart", edit)
    assert main(["run", str(config), "--no-progress"]) == 0
    assert not (tmp_path / "out" / "adapters").exists()
    off = load_config(config)
    on = dataclasses.replace(off, output=dataclasses.replace(off.output, save_adapters=True))
    assert config_hash(off) == config_hash(on)
    data = yaml.safe_load(config.read_text())
    data["output"]["save_adapters"] = "yes"
    config.write_text(yaml.safe_dump(data))
    assert main(["check", str(config)]) == 2


def test_a_saved_method_whose_config_says_lora_is_refused_by_verify_and_load_trained(job, tmp_path, capsys):
    """PEFT loads SplitLoRA tensors under ``"peft_type": "LORA"`` as an untrained LoRA (a warning about missing
    keys); ``peft-ext verify`` names the mismatch and ``load_trained`` refuses the folder before building anything."""
    _, out, _ = job
    folder = tmp_path / "splitlora"
    shutil.copytree(out / "adapters" / "splitlora", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["peft_type"] = "LORA"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    mismatch = r"is a SPLITLORA tensor \(name starts with 'splitlora_'\), but the config says peft_type 'LORA'"
    with pytest.raises(ValueError, match=mismatch):
        load_trained(folder)
    assert main(["verify", str(folder)]) != 0
    assert re.search(mismatch, capsys.readouterr().err)
    load_trained(out / "adapters" / "splitlora")  # the untouched folder still loads


def _saved(folder, label: str, method: str, **scores) -> None:
    (folder / "adapters" / label).mkdir(parents=True)
    (folder / "adapters" / label / MODEL_FILE).write_text(json.dumps({"method": method, **scores}))


def test_predict_chooses_on_validation_and_says_when_it_could_only_use_the_test_split(tmp_path):
    from peft_ext.jobs.saved import default_method

    _saved(tmp_path, "a", "seq_lora", final_acc=0.9, final_val_acc=0.5)
    _saved(tmp_path, "b", "splitlora", final_acc=0.6, final_val_acc=0.7)
    _saved(tmp_path, "joint", "joint", final_acc=0.99, final_val_acc=0.99)  # an upper bound: never chosen
    best, line, split = default_method(tmp_path)
    assert split == "validation" and best == "b"
    assert "70.0 % on the validation split" in line and "60.0 % on the test split" in line
    older = tmp_path / "older"
    _saved(older, "a", "seq_lora", final_acc=0.9, final_val_acc=None)
    _saved(older, "b", "splitlora", final_acc=0.6, final_val_acc=None)
    best, line, split = default_method(older)
    assert split == "test" and best == "a" and "on the test split" in line and "optimistic" in line


def test_the_validation_score_is_the_final_model_on_the_validation_split(job):
    config, out, _ = job
    results = {r.get("label") or r["method"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    sequence = build_sequence(load_config(config), None)
    examples = [example for task in sequence.tasks for example in task.validation]
    assert examples and all(task.validation for task in sequence.tasks)
    for label in ["splitlora", "seq_lora", "ncm"]:
        model = load_trained(out / "adapters" / label)
        predicted = model.scores([e.inputs for e in examples]).argmax(-1)
        accuracy = (predicted == torch.tensor([e.label for e in examples])).float().mean().item()
        validation = results[label]["extras"]["final_validation"]
        # per task means weighted by each task's size: the examples' mean when tasks are the same size
        sizes = [len(task.validation) for task in sequence.tasks]
        weighted = sum(a * n for a, n in zip(validation["per_task"], sizes)) / sum(sizes)
        assert accuracy == pytest.approx(weighted, abs=1e-6), label  # float32 mean; one example is 1e-2
        meta = json.loads((out / "adapters" / label / MODEL_FILE).read_text())
        assert meta["final_val_acc"] == pytest.approx(validation["acc"])
