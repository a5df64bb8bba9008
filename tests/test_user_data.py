"""Classification sequences from a user's own files (peft_ext.data.user_data and ``data.dataset: files``): every format
``datasets`` reads gives the same sequence, the splits are carved by a seeded hash, tokenization happens once, and
every bad input is one line naming the file, column or row."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

datasets = pytest.importorskip("datasets")

from peft_ext.data.collate import TextCollator  # noqa: E402
from peft_ext.data.user_data import Tokenized, file_task_sequence  # noqa: E402
from peft_ext_cli import main  # noqa: E402

from .helpers import ROOT, save_tiny_bert  # noqa: E402

CLASSES = ["bird", "boat", "cake", "door", "fish", "lamp"]


def rows(per_class: int = 10) -> list[dict]:
    return [
        {"text": f"a {c} sentence number {i} about {c}s", "label": c, "domain": "ab"[CLASSES.index(c) % 2]}
        for c in CLASSES
        for i in range(per_class)
    ]


def write_csv(path: Path, data: list[dict]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(data[0]))
        writer.writeheader()
        writer.writerows(data)
    return path


def summary(seq) -> list:
    return [
        (t.name, [seq.class_names[c] for c in t.classes], [e.inputs for e in t.train], [e.inputs for e in t.test])
        for t in seq.tasks
    ]


def test_a_csv_becomes_a_class_incremental_sequence_with_a_hash_carved_test_split(tmp_path):
    path = write_csv(tmp_path / "d.csv", rows())
    seq = file_task_sequence(path, n_tasks=3, classes_per_task=2, seed=0)
    assert len(seq) == 3 and sorted(seq.class_names) == CLASSES
    assert seq.meta["carved"] == ["test"]
    train = {e.inputs for t in seq.tasks for e in t.train}
    test = {e.inputs for t in seq.tasks for e in t.test}
    assert not train & test and len(train) + len(test) == 60
    assert 4 <= len(test) <= 24  # about 20 %
    assert summary(seq) == summary(file_task_sequence(path, n_tasks=3, classes_per_task=2, seed=0))  # reproducible
    other = file_task_sequence(path, n_tasks=3, classes_per_task=2, seed=1)
    assert [t.classes for t in other.tasks] != [t.classes for t in seq.tasks] or summary(other) != summary(seq)
    for task in seq.tasks:  # labels are global ids of the task's own classes
        assert {e.label for e in task.train + task.test} <= set(task.classes)


def test_every_format_gives_the_same_sequence(tmp_path):
    data = rows()
    csv_path = write_csv(tmp_path / "d.csv", data)
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in data))
    table = datasets.Dataset.from_list(data)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    tsv = tmp_path / "d.tsv"
    tsv.write_text("text\tlabel\n" + "".join(f"{r['text']}\t{r['label']}\n" for r in data))
    expected = summary(file_task_sequence(csv_path, n_tasks=3, classes_per_task=2))
    for source in (jsonl, tmp_path / "d.parquet", tmp_path / "saved", table, tsv, [str(csv_path)]):
        assert summary(file_task_sequence(source, n_tasks=3, classes_per_task=2)) == expected, source


def test_given_test_file_explicit_classes_caps_and_a_task_column(tmp_path):
    train = write_csv(tmp_path / "train.csv", rows(10))
    test = write_csv(tmp_path / "test.csv", [{**r, "text": r["text"] + " (test)"} for r in rows(4)])
    seq = file_task_sequence(train, test, classes=["lamp", "bird", "fish", "cake"], n_tasks=2, classes_per_task=2)
    assert [[seq.class_names[c] for c in t.classes] for t in seq.tasks] == [["lamp", "bird"], ["fish", "cake"]]
    assert all(len(t.test) == 8 and len(t.train) == 20 for t in seq.tasks) and seq.meta["carved"] == []
    capped = file_task_sequence(train, test, n_tasks=2, classes_per_task=2, train_per_class=3, test_per_class=2)
    assert all(len(t.train) == 6 and len(t.test) == 4 for t in capped.tasks)
    by_domain = file_task_sequence(train, test, task_column="domain", protocol="task-incremental")
    assert [t.name for t in by_domain.tasks] == ["t0:a", "t1:b"]
    assert [by_domain.class_names[c] for c in by_domain.tasks[0].classes] == ["a/bird", "a/cake", "a/fish"]
    nested = file_task_sequence(train, test, classes=[["door"], ["boat", "lamp"]])
    assert [len(t.classes) for t in nested.tasks] == [1, 2]


def test_tokenized_once_and_padded_exactly_as_tokenizing_the_text(tmp_path):
    from transformers import AutoTokenizer

    from peft_ext.models import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    path = write_csv(tmp_path / "d.csv", rows())
    plain = file_task_sequence(path, n_tasks=3, classes_per_task=2)
    tokenized = file_task_sequence(path, n_tasks=3, classes_per_task=2, tokenizer=tokenizer, max_length=8)
    assert tokenized.meta["truncated"] == 60  # every text is longer than 8 tokens
    examples = tokenized.tasks[0].train[:5]
    assert all(isinstance(e.inputs, Tokenized) and len(e.inputs.input_ids) == 8 for e in examples)
    collate = TextCollator(tokenizer, max_length=8)
    from_ids = collate(examples)
    from_text = collate(plain.tasks[0].train[:5])
    for key in ("input_ids", "attention_mask", "labels"):
        assert from_ids[key].tolist() == from_text[key].tolist(), key


def test_tokenization_is_cached_on_disk_for_the_next_run(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from peft_ext.data.user_data import tokenize_sequence
    from peft_ext.models import minilm_path

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    seq = file_task_sequence(write_csv(tmp_path / "d.csv", rows()), n_tasks=3, classes_per_task=2)
    calls = []
    original = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    first = tokenize_sequence(seq, tokenizer, 16, progress=False)
    assert calls and list((tmp_path / "cache" / "peft_ext_tokenized").glob("*.arrow"))
    calls.clear()
    again = tokenize_sequence(seq, tokenizer, 16, progress=False)
    assert not calls, "the second run tokenized again instead of reading the cache"
    assert summary(again) == summary(first) and again.meta["truncated"] == first.meta["truncated"]
    other = tokenize_sequence(seq, tokenizer, 12, progress=False)  # another max_length: another cache entry
    assert calls and all(len(e.inputs.input_ids) <= 12 for e in other.tasks[0].train)


def _write(path, text: str):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (lambda p: p / "nope.csv", {}, "data file '{p}/nope.csv' does not exist"),
        (lambda p: write_csv(p / "d.csv", rows()), {"label_column": "class"}, "has no column 'class'; its columns: "),
        (lambda p: write_csv(p / "d.csv", rows()), {"text_column": ["text", "txt"]}, "has no column 'txt'"),
        (
            lambda p: write_csv(p / "d.csv", rows()[:5] + [{"text": "x", "label": "", "domain": "a"}] + rows()[5:]),
            {},
            "row 6: the label (column 'label') is empty or NaN",
        ),
        (
            lambda p: write_csv(p / "d.csv", rows()[:3] + [{"text": "", "label": "bird", "domain": "a"}]),
            {},
            "row 4: the text (columns ['text']) is empty",
        ),
        (lambda p: write_csv(p / "d.csv", rows()), {"n_tasks": 4}, "4 x 2 = 8 classes needed, but the training data"),
        (lambda p: write_csv(p / "d.csv", rows()), {"classes": ["bird", "bridge"]}, "`classes` names 'bridge'"),
        (lambda p: write_csv(p / "d.yaml", rows()), {}, "files must share one of the formats"),
        (lambda p: "data/missing.csv", {}, "data file 'data/missing.csv' does not exist"),
        (lambda p: _write(p / "e.csv", ""), {}, "data file '{p}/e.csv' is empty: it needs one example per row"),
        (lambda p: _write(p / "h.csv", "text,label\n"), {}, "data file '{p}/h.csv' has a header and no rows"),
        (lambda p: _write(p / "e.jsonl", "\n\n"), {}, "data file '{p}/e.jsonl' is empty"),
        (
            lambda p: _write(p / "one.csv", "text,label\nhello,a\nthere,a\n"),
            {},
            "the label column holds one class only ('a'): a classifier needs at least 2",
        ),
        (
            lambda p: "nobody/no-such-data-xyz",
            {},
            "'nobody/no-such-data-xyz' is not a local file or folder, and as a hub",
        ),
    ],
)
def test_bad_input_is_one_line_naming_what_is_wrong(tmp_path, make, kwargs, message):
    source = make(tmp_path)
    options = {"n_tasks": 3, "classes_per_task": 2, **kwargs}
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        file_task_sequence(source, **options)
    assert message.format(p=tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_not_utf8_unseen_test_labels_and_shared_texts(tmp_path):
    latin = tmp_path / "latin.csv"
    latin.write_bytes("text,label\ncaf\xe9 au lait,drink\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"'.*latin.csv' is not UTF-8 \(line 2, byte 3"):
        file_task_sequence(latin, n_tasks=1, classes_per_task=1)
    train = write_csv(tmp_path / "train.csv", rows())
    odd = write_csv(tmp_path / "odd.csv", rows(2) + [{"text": "a wheel", "label": "wheel", "domain": "a"}])
    with pytest.raises(ValueError, match=r"test labels \['wheel'\] never occur in the training data"):
        file_task_sequence(train, odd, n_tasks=3, classes_per_task=2)
    with pytest.warns(UserWarning, match=r"12 test examples have the same text as a training example"):
        file_task_sequence(train, write_csv(tmp_path / "same.csv", rows(2)), n_tasks=3, classes_per_task=2)


# --- the job ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=1, seed=0)


def test_the_shipped_csv_example_runs_as_written(tmp_path, tiny_backbone, capsys):
    """``configs/wordnet_csv.yaml`` (two CSV files shipped beside it) on a tiny backbone, one method, one epoch."""
    out = tmp_path / "out"
    args = ["--no-progress", "--only", "seq_lora", "--set", f"model.backbone={tiny_backbone}"]
    assert main(["run", "wordnet_csv", *args, "--set", f"output.dir={out}", "--set", "train.epochs=1"]) == 0
    printed = capsys.readouterr().out
    assert "4 tasks, 8 classes, 320 train / 160 test examples" in printed
    result = json.loads((out / "results.json").read_text())
    assert result["meta"]["sequence_meta"]["source"].endswith("wordnet_train.csv")
    assert len(result["results"][0]["accuracy_matrix"]) == 4


def test_the_job_refuses_bad_data_before_any_work(tmp_path, tiny_backbone, capsys):
    data = yaml.safe_load((ROOT / "configs" / "wordnet_csv.yaml").read_text())
    data["data"]["train"] = str(ROOT / "configs" / "data" / "wordnet_train.csv")
    data["data"]["test"] = str(ROOT / "configs" / "data" / "wordnet_test.csv")
    data["data"]["label_column"] = "supersense"
    data["model"]["backbone"] = str(tiny_backbone)
    data["output"]["dir"] = str(tmp_path / "out")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no column 'supersense'; its columns: ['text', 'label']" in err[0]
    assert main(["run", str(cfg), "--set", "data.label_column=label", "--set", "data.n_tasks=5"]) == 2
    assert "5 x 2 = 10 classes needed, but the training data has 8 classes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
