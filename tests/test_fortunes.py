"""The second shipped data set, Debian fortunes by topic: the filter, the reproducible builder, the packaged file as
documented, task sequences (shapes, determinism, disjoint splits), the config's `dataset: fortunes` and a short run of
configs/fortunes.yaml."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from peft_ext.continual.config import ConfigError, config_from_dict
from peft_ext.data import FORTUNES, SHIPPED, wordnet_task_sequence
from peft_ext.data.__main__ import main
from peft_ext.data.build import build_shipped, installed_version
from peft_ext.data.fortunes import (
    CATEGORIES,
    DEFAULT_PATH,
    TEST_PERCENT,
    FortuneExample,
    class_counts,
    fortunes_task_sequence,
    load_fortunes,
    read_fortune_file,
    split_of,
)
from peft_ext.data.fortunes_build import MAX_CHARS, clean_entry, parse_fortune_file
from peft_ext.data.provenance import hash_split

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "fortunes.yaml"
README = ROOT / "peft_ext" / "data" / "files" / "README.md"
SHA256 = "49c2046f279582b47ae953abe9f693e7cd51d32c4a51126da2da1f9dd34203f0"
ROWS = 4155


# ---------------------------------------------------------------------------------------------------------------
# the filter and the builder


def test_parse_splits_on_percent_lines_only():
    text = "first\n  line two\n%\n100% sure\n%\n\n%\nlast, no trailing percent\n"
    assert parse_fortune_file(text) == ["first\n  line two", "100% sure", "", "last, no trailing percent\n"]


def test_clean_entry_drops_attribution_overstrike_and_whitespace():
    entry = 'A "critic" is a man who creates nothing\n-- he hates all equally.\n\t\t-- Robert Heinlein\n'
    # a `--` line at column 0 is part of the text; the indented one at the end is the attribution
    assert clean_entry(entry) == 'A "critic" is a man who creates nothing -- he hates all equally.'
    multi_line = 'The most elementary and valuable statement\n\t\t-- Spock, "The Menagerie",\n\t\t   stardate 3012.4\n'
    assert clean_entry(multi_line) == "The most elementary and valuable statement"
    overstruck = "b\bbo\bol\bld\bd and _\bu_\bn_\bd_\be_\br words\n\n   two   paragraphs\n"
    assert clean_entry(overstruck) == "bold and under words two paragraphs"
    assert clean_entry("\t\t-- a first line is never an attribution, even here") is not None


def test_clean_entry_refusals():
    assert clean_entry("Ring the bell, Jim, and leave a message\x07") is None  # control character
    assert clean_entry("You don\u00e2\u0080\u0099t want mojibake in training data") is None  # non-ASCII
    assert clean_entry("Too short.") is None
    assert clean_entry("word " * (MAX_CHARS // 5 + 1)) is None
    assert clean_entry("x" * MAX_CHARS) == "x" * MAX_CHARS


def test_build_dedups_within_and_across_categories(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shared = "Good government never depends upon laws, but upon people."
    for name in CATEGORIES:
        entries = [f"An entry about {name} number {i}, long enough to keep." for i in range(3)]
        if name == "law":
            entries += [shared, entries[0]]  # a repeat within law is kept once
        if name == "politics":
            entries += [shared]  # in two categories: dropped from both
        (src / name).write_text("\n%\n".join(entries) + "\n%\n")
    out = build_shipped("fortunes", src, tmp_path / "f.tsv.xz")
    records = read_fortune_file(out)
    assert Counter(r.category for r in records) == {name: 3 for name in CATEGORIES}
    assert all(r.text != shared for r in records)
    assert [r.id for r in records][:3] == ["art/0000", "art/0001", "art/0002"]
    assert all(r.split == split_of(r.text) for r in records)
    assert build_shipped("fortunes", src, tmp_path / "again.tsv.xz").read_bytes() == out.read_bytes()
    (src / "food").unlink()
    with pytest.raises(FileNotFoundError, match="apt-get install fortunes"):
        build_shipped("fortunes", src, tmp_path / "x.tsv.xz")


@pytest.mark.skipif(
    installed_version("fortunes") != FORTUNES.source.version or not Path(FORTUNES.source.folder).is_dir(),
    reason=f"needs Debian's fortunes {FORTUNES.source.version} in {FORTUNES.source.folder} (apt-get install fortunes)",
)
def test_rebuild_from_the_debian_package_equals_committed(tmp_path, capsys):
    out = tmp_path / "fortunes.tsv.xz"
    assert main(["build", "fortunes", "--out", str(out)]) == 0
    assert f"{ROWS} entries" in capsys.readouterr().out
    assert out.read_bytes() == DEFAULT_PATH.read_bytes()


def test_rebuild_of_real_source_entries_gives_the_committed_rows(tmp_path):
    """Runs everywhere: the first 15 real entries of each category file (tests/debian_sources) rebuilt give,
    verbatim, rows of the committed file: the same filter, text cleaning, ids and categories as the full rebuild."""
    import lzma

    out = build_shipped("fortunes", Path(__file__).parent / "debian_sources" / "fortunes", tmp_path / "f.tsv.xz")
    rows = lzma.decompress(out.read_bytes()).decode().splitlines()
    committed = set(lzma.decompress(DEFAULT_PATH.read_bytes()).decode().splitlines())
    assert rows[0] == "id\tcategory\ttext" and len(rows) == 1 + 147  # 180 entries, 33 dropped by the filter
    missing = [row for row in rows if row not in committed]
    assert not missing, missing[:3]
    assert {row.split("\t")[1] for row in rows[1:]} == set(CATEGORIES)


# ---------------------------------------------------------------------------------------------------------------
# the packaged file, as documented


def test_packaged_file_matches_its_documentation():
    assert hashlib.sha256(DEFAULT_PATH.read_bytes()).hexdigest() == SHA256
    records = read_fortune_file()
    assert len(records) == ROWS
    assert [r.id for r in records] == sorted(r.id for r in records)
    assert len({r.text for r in records}) == ROWS  # no text twice, in any category or split
    assert {r.category for r in records} == set(CATEGORIES)
    assert all(20 <= len(r.text) <= MAX_CHARS and r.text.isascii() and "\t" not in r.text for r in records)
    readme = README.read_text()
    assert SHA256 in readme and f"{ROWS:,}" in readme
    assert FORTUNES.stats_markdown() in readme  # the per-class table is the file's
    assert (DEFAULT_PATH.parent / "FORTUNES_LICENSE").read_text().count("Regents of the University of California")
    counts = class_counts()
    assert min(c["train"] for c in counts.values()) >= 80 and min(c["test"] for c in counts.values()) >= 30
    share = sum(c["test"] for c in counts.values()) / ROWS
    assert abs(share - TEST_PERCENT / 100) < 0.02


def test_load_caps_and_arguments():
    capped = load_fortunes("train", ["food", "law"], max_per_class=25, seed=0)
    assert Counter(r.category for r in capped) == {"food": 25, "law": 25}
    assert capped == load_fortunes("train", ["food", "law"], max_per_class=25, seed=0)
    smaller = load_fortunes("train", ["food", "law"], max_per_class=10, seed=0)
    assert {r.id for r in smaller} < {r.id for r in capped}
    assert {r.id for r in load_fortunes("train", ["food", "law"], max_per_class=25, seed=1)} != {r.id for r in capped}
    assert isinstance(capped[0], FortuneExample)
    with pytest.raises(ValueError, match=r"Unknown categories \['sport'\]"):
        load_fortunes(categories=["sport"])
    with pytest.raises(ValueError, match="not the string"):
        load_fortunes(categories="food")
    with pytest.raises(ValueError, match="'train', 'test'"):
        load_fortunes(split="dev")


# ---------------------------------------------------------------------------------------------------------------
# task sequences


def test_sequence_shapes_disjoint_classes_and_splits():
    seq = fortunes_task_sequence(val_per_class=20)
    assert len(seq) == 4 and seq.num_classes == 12 and sorted(seq.class_names) == sorted(CATEGORIES)
    assert seq.name == "fortunes-4x3-seed0" and seq.meta["n_eligible"] == 12
    assert seq.meta["source_sha256"] == SHA256 and seq.meta["test_percent"] == TEST_PERCENT
    by_text = {r.text: r for r in read_fortune_file()}
    seen: set[int] = set()
    for t, task in enumerate(seq.tasks):
        assert task.classes == [3 * t, 3 * t + 1, 3 * t + 2]
        assert not seen & set(task.classes)
        seen |= set(task.classes)
        assert Counter(ex.label for ex in task.train) == {c: 60 for c in task.classes}
        assert Counter(ex.label for ex in task.test) == {c: 30 for c in task.classes}
        assert Counter(ex.label for ex in task.validation) == {c: 20 for c in task.classes}
        for split, examples in (("train", task.train), ("test", task.test), ("train", task.validation)):
            for ex in examples:
                record = by_text[ex.inputs]
                assert record.split == split and record.category == seq.class_names[ex.label]
    texts = {
        split: [ex.inputs for task in seq.tasks for ex in getattr(task, split)]
        for split in ("train", "test", "validation")
    }
    assert not set(texts["train"]) & set(texts["test"])
    assert not set(texts["validation"]) & set(texts["test"])
    assert not set(texts["validation"]) & set(texts["train"])
    # asking for a validation split changes neither train nor test
    plain = fortunes_task_sequence()
    assert [t.train for t in plain.tasks] == [t.train for t in seq.tasks]
    assert [t.test for t in plain.tasks] == [t.test for t in seq.tasks]


def test_sequence_is_deterministic_per_seed():
    a = fortunes_task_sequence(seed=3, val_per_class=5)
    b = fortunes_task_sequence(seed=3, val_per_class=5)
    assert a.class_names == b.class_names
    assert [(t.train, t.test, t.validation) for t in a.tasks] == [(t.train, t.test, t.validation) for t in b.tasks]
    c = fortunes_task_sequence(seed=4)
    assert c.class_names != a.class_names
    assert fortunes_task_sequence(n_tasks=6, classes_per_task=2).class_names == fortunes_task_sequence().class_names


def test_sequence_with_given_categories_and_errors():
    seq = fortunes_task_sequence(
        n_tasks=2, classes_per_task=2, categories=["food", "law", "love", "startrek"], train_per_class=10,
        test_per_class=5, protocol="task-incremental",
    )  # fmt: skip
    assert [t.name for t in seq.tasks] == ["t0:food+law", "t1:love+startrek"] and seq.protocol == "task-incremental"
    assert seq.meta["class_selection"] == "given"
    with pytest.raises(ValueError, match="only 12 categories have at least 60 train and 30 test entries"):
        fortunes_task_sequence(n_tasks=13, classes_per_task=1)
    with pytest.raises(ValueError, match=r"Categories love \(95/44\) have fewer than 100 train"):
        fortunes_task_sequence(n_tasks=1, classes_per_task=2, categories=["food", "love"], train_per_class=100)
    with pytest.raises(ValueError, match=r"Unknown categories \['sports'\]"):
        fortunes_task_sequence(n_tasks=1, classes_per_task=2, categories=["food", "sports"])
    with pytest.raises(ValueError, match="`categories` repeats"):
        fortunes_task_sequence(n_tasks=1, classes_per_task=2, categories=["food", "food"])
    with pytest.raises(ValueError, match="val_per_class"):
        fortunes_task_sequence(val_per_class=-1)


def test_shared_helpers_keep_wordnet_as_it_was():
    from peft_ext.data.wordnet import split_of as wordnet_split

    # the shared hash split is WordNet's, unchanged (values of the file's first synsets)
    assert [wordnet_split(s) for s in ("a00001740", "a00001740", "n02084071")] == [
        hash_split(s, 20) for s in ("a00001740", "a00001740", "n02084071")
    ]
    seq = wordnet_task_sequence(n_tasks=2, classes_per_task=2, train_per_class=5, test_per_class=3, val_per_class=2)
    assert seq.name == "wordnet-supersenses-2x2-seed0" and list(seq.meta)[:5] == [
        "dataset", "source", "source_sha256", "license", "input",
    ]  # fmt: skip
    assert set(SHIPPED) == {"wordnet", "fortunes"}
    assert SHIPPED["fortunes"].names() == CATEGORIES


# ---------------------------------------------------------------------------------------------------------------
# the config and the job


@pytest.fixture
def config_data():
    return yaml.safe_load(CONFIG.read_text())


def test_shipped_config(config_data):
    cfg = config_from_dict(config_data)
    assert cfg.data.dataset == "fortunes" and (cfg.data.n_tasks, cfg.data.classes_per_task) == (4, 3)
    assert cfg.data.val_per_class == 20 and cfg.tune.lr_factors == [0.316, 1.0, 3.16]
    quickstart = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())

    # quickstart's methods and settings, except the heads each data set measured best (docs/continual_heads.md)
    def without_head(methods):
        return [{k: v for k, v in m.items() if k != "head"} for m in methods]

    assert without_head(config_data["methods"]) == without_head(quickstart["methods"])
    assert config_data["train"] == quickstart["train"]
    heads = {m["name"]: (m.get("head"), q.get("head")) for m, q in zip(config_data["methods"], quickstart["methods"])}
    assert {name for name, (here, there) in heads.items() if here != there} == {"olora", "osf"}
    assert heads["olora"] == heads["osf"] == ("analytic", "prototype")
    for key in ("n_tasks", "classes_per_task", "train_per_class", "test_per_class"):
        del config_data["data"][key]
    defaults = config_from_dict(config_data).data
    assert [defaults.n_tasks, defaults.classes_per_task, defaults.train_per_class, defaults.test_per_class] == [
        4, 3, 60, 30,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        ({"val_per_class": -1}, r"`data.val_per_class` must be >= 0, got -1"),
        ({"train": "mine.csv"}, r"`data.train` is for `dataset: files`, not `fortunes`"),
        ({"n_tasks": 0}, r"`data.n_tasks` must be a positive integer"),
        ({"classes": ["food"]}, r"`data.classes` lists 1 names"),
    ],
)
def test_config_errors_name_the_key(config_data, change, message):
    config_data["data"].update(change)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config_data)


def test_files_take_no_val_per_class(config_data):
    config_data["data"].update(dataset="files", train="mine.csv", val_per_class=5)
    with pytest.raises(ConfigError, match=r"`data.val_per_class` is for the shipped data sets .*wordnet / fortunes"):
        config_from_dict(config_data)


def test_preflight_names_unknown_classes_and_too_many(config_data):
    from peft_ext.jobs.preflight import check_data

    config_data["data"].update(n_tasks=1, classes_per_task=2, classes=["food", "sport"])
    with pytest.raises(ConfigError, match=r"`data.classes\[1\]`.*'sport'"):
        check_data(config_from_dict(config_data))
    config_data["data"].update(n_tasks=7, classes=None)
    with pytest.raises(ConfigError, match=r"`data` \(n_tasks=7, classes_per_task=2\).*only 12 categories"):
        check_data(config_from_dict(config_data))


def test_run_fortunes_config_through_the_cli(tmp_path, capsys):
    """configs/fortunes.yaml with the real MiniLM-L6, shrunk: 2 tasks x 2 topics, 24 entries each, 3 epochs, two
    methods."""
    from peft_ext_cli import main as cli_main

    out = tmp_path / "out"
    overrides = [
        "train.epochs=3",
        "train.batch_size=8",
        "data.n_tasks=2",
        "data.classes_per_task=2",
        "data.train_per_class=24",
        "data.test_per_class=12",
        "data.val_per_class=0",
        "model.max_length=32",
        f"output.dir={out}",
    ]
    argv = ["run", str(CONFIG), "--no-progress", "--only", "frozen_linear,seq_lora"]
    assert cli_main(argv + [a for o in overrides for a in ("--set", o)]) == 0
    assert "fortunes-2x2-seed0" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["sequence_meta"]["dataset"].startswith("Debian fortunes")
    assert [r["method"] for r in results["results"]] == ["frozen_linear", "seq_lora"]
    for row in results["results"]:
        matrix = row["accuracy_matrix"]
        assert len(matrix) == 2 and all(len(r) == 2 for r in matrix)
        assert matrix[0][1] is None and all(0 <= v <= 1 for r in matrix for v in r if v is not None)
        # both learn each task: right after training it, its 24 test entries score above chance among the classes
        # seen (1/2, then 1/4) by at least 0.15 (measured: 0.79 and 0.54 for frozen_linear, 0.75 and 0.50 for seq_lora)
        assert matrix[0][0] >= 0.5 + 0.15 and matrix[1][1] >= 0.25 + 0.15, (row["method"], matrix)
