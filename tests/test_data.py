"""WordNet gloss data: parser, reproducible builder, packaged file, splits, caps and task sequences; the registry of
shipped data sets, `python -m peft_ext.data` and the config's `data.dataset` check."""

from __future__ import annotations

import csv
import lzma
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from peft_ext.data import (
    DATASETS,
    FORTUNES,
    LEXNAMES,
    SHIPPED,
    WORDNET,
    GlossExample,
    check_dataset,
    class_counts,
    load_wordnet_glosses,
    parse_data_line,
    parse_data_lines,
    shipped_dataset,
    split_of,
    wordnet_task_sequence,
)
from peft_ext.data.__main__ import main
from peft_ext.data.build import build_shipped
from peft_ext.data.wordnet import DEFAULT_PATH

SYSTEM_WORDNET = Path(WORDNET.source.folder)
HEADER = "  1 This software and database is being provided to you, the LICENSEE, by  \n"

# w_cnt "0b" is hexadecimal for 11 words (decimal parsing fails on it); three pointers follow the words.
NOUN_11_WORDS = (
    "08000000 15 n 0b w0 0 w1 0 w2 0 w3 0 w4 0 w5 0 w6 0 w7 0 w8 0 w9 0 w10 0 003 @ 08001000 n 0000 "
    "~ 08002000 n 0000 %p 08003000 n 0000 | a place with eleven names  \n"
)
# A verb with examples (one attributed) and verb frames after the pointers.
VERB_WITH_EXAMPLES = (
    "00001740 29 v 02 breathe 0 respire 1 001 @ 00002000 v 0000 02 + 02 00 + 08 00 | draw air into, and expel out "
    'of, the lungs; "I can breathe better when the air is clean"; "The patient is respiring"- A. Doctor  \n'
)
# An adjective satellite ("s") with a syntactic marker on one lemma and no space before its example.
ADJ_SATELLITE = (
    "00003553 00 s 02 emergent 0 emerging(a) 0 001 & 00003356 a 0000 | "
    'coming into existence;"an emergent republic"  \n'
)


def test_parser_on_hand_written_lines():
    noun, verb, adj = parse_data_lines([HEADER, NOUN_11_WORDS, VERB_WITH_EXAMPLES, ADJ_SATELLITE])
    assert noun.synset == "n08000000"
    assert noun.supersense == "noun.location"
    assert noun.lemmas == tuple(f"w{i}" for i in range(11))
    assert noun.definition == "a place with eleven names"
    assert noun.examples == ()

    assert verb.synset == "v00001740"
    assert verb.supersense == "verb.body"
    assert verb.lemmas == ("breathe", "respire")
    assert verb.definition == "draw air into, and expel out of, the lungs"
    assert verb.text == verb.definition
    assert verb.examples == ("I can breathe better when the air is clean", "The patient is respiring - A. Doctor")

    assert adj.synset == "a00003553"
    assert adj.supersense == "adj.all"
    assert adj.lemmas == ("emergent", "emerging")
    assert adj.definition == "coming into existence"
    assert adj.examples == ("an emergent republic",)
    for record in (noun, verb, adj):
        assert record.split == split_of(record.synset)


def test_parser_skips_header_and_rejects_malformed_lines():
    assert parse_data_line(HEADER) is None
    assert parse_data_line("\n") is None
    # lex_filenum 29 is verb.body, impossible for a noun.
    with pytest.raises(ValueError, match="verb.body"):
        parse_data_line(NOUN_11_WORDS.replace(" 15 n ", " 29 n ", 1))
    with pytest.raises(ValueError, match="outside 0..44"):
        parse_data_line(NOUN_11_WORDS.replace(" 15 n ", " 45 n ", 1))
    # Claiming 12 words makes the pointer count land on a word.
    with pytest.raises(ValueError, match="w_cnt"):
        parse_data_line(NOUN_11_WORDS.replace(" 0b ", " 0c ", 1))
    with pytest.raises(ValueError, match="ss_type"):
        parse_data_line(NOUN_11_WORDS.replace(" 15 n ", " 15 x ", 1))


def _fake_wordnet(root: Path) -> Path:
    """A tiny WordNet ``dict`` directory; data.noun lists its synsets out of order to exercise sorting."""
    root.mkdir()
    lines = {
        "data.noun": [NOUN_11_WORDS, '00002000 05 n 01 dog 0 000 | a canine\tpet; "the dog barked"  \n'],
        "data.verb": [VERB_WITH_EXAMPLES],
        "data.adj": [ADJ_SATELLITE, "00001740 00 a 01 able 0 000 | having the means  \n"],
        "data.adv": ["00001000 02 r 01 well 0 000 | in a good way  \n"],
    }
    for name, body in lines.items():
        (root / name).write_text(HEADER + "".join(body), encoding="ascii")
    return root


def test_build_is_byte_for_byte_deterministic(tmp_path):
    wordnet = _fake_wordnet(tmp_path / "dict")
    first = build_shipped("wordnet", wordnet, tmp_path / "a.tsv.xz")
    second = build_shipped("wordnet", wordnet, tmp_path / "b.tsv.xz")
    assert first.read_bytes() == second.read_bytes()

    rows = lzma.decompress(first.read_bytes()).decode("utf-8").splitlines()
    assert rows[0] == "synset\tsupersense\tlemmas\tdefinition\texamples"
    assert [row.split("\t")[0] for row in rows[1:]] == [
        "a00001740",
        "a00003553",
        "n00002000",
        "n08000000",
        "r00001000",
        "v00001740",
    ]
    assert rows[3] == "n00002000\tnoun.animal\tdog\ta canine pet\tthe dog barked"  # the tab in the gloss is gone

    loaded = load_wordnet_glosses(path=first)
    assert [r.synset for r in loaded] == [row.split("\t")[0] for row in rows[1:]]
    assert loaded[1] == parse_data_line(ADJ_SATELLITE)
    assert loaded[3] == parse_data_line(NOUN_11_WORDS)


def test_build_cli_and_missing_files(tmp_path, capsys):
    wordnet = _fake_wordnet(tmp_path / "dict")
    out = tmp_path / "cli.tsv.xz"
    assert main(["build", "wordnet", "--source-dir", str(wordnet), "--out", str(out)]) == 0
    assert "6 synsets" in capsys.readouterr().out
    assert out.read_bytes() == build_shipped("wordnet", wordnet, tmp_path / "api.tsv.xz").read_bytes()

    (wordnet / "data.adv").write_text(HEADER + "00001000 02 r 01 well 0 000 in a good way\n", encoding="ascii")
    with pytest.raises(ValueError, match=r"data\.adv:2: Not a WordNet data line"):
        build_shipped("wordnet", wordnet, tmp_path / "never.tsv.xz")
    (wordnet / "data.verb").unlink()
    with pytest.raises(FileNotFoundError, match=r"data\.verb.*--source-dir.*apt-get install wordnet-base"):
        build_shipped("wordnet", wordnet, tmp_path / "never.tsv.xz")
    assert not (tmp_path / "never.tsv.xz").exists()
    assert main(["build", "wordnet", "--source-dir", str(tmp_path / "nowhere"), "--out", str(out)]) == 1
    assert "apt-get install wordnet-base" in capsys.readouterr().err


# Slow only by the test's standards (~10 s, almost all of it xz compression); CI machines skip it.
@pytest.mark.slow
@pytest.mark.skipif(not SYSTEM_WORDNET.is_dir(), reason="WordNet data not installed (apt-get install wordnet-base)")
def test_rebuild_matches_committed_file(tmp_path):
    rebuilt = build_shipped("wordnet", SYSTEM_WORDNET, tmp_path / "wordnet_glosses.tsv.xz")
    committed = DEFAULT_PATH.read_bytes()
    # Content first, so a liblzma difference cannot hide behind (or be mistaken for) a data difference.
    assert lzma.decompress(rebuilt.read_bytes()) == lzma.decompress(committed)
    assert rebuilt.read_bytes() == committed


def test_rebuild_of_real_source_lines_gives_the_committed_rows(tmp_path):
    """Runs everywhere: real lines of Debian's wordnet-base (tests/debian_sources) rebuilt give, verbatim, rows of
    the committed file: the same parse, supersense, lemmas, gloss and examples as the full rebuild above."""
    source = Path(__file__).parent / "debian_sources" / "wordnet"
    rows = lzma.decompress(build_shipped("wordnet", source, tmp_path / "w.tsv.xz").read_bytes()).decode().splitlines()
    committed = set(lzma.decompress(DEFAULT_PATH.read_bytes()).decode().splitlines())
    assert rows[0] == "synset\tsupersense\tlemmas\tdefinition\texamples"
    assert len(rows) == 1 + 25 * 4 + 1  # the first 25 synsets of each file and the dog
    missing = [row for row in rows if row not in committed]
    assert not missing, missing[:3]
    dog = next(row for row in rows if row.startswith("n02084071\t"))
    assert dog.split("\t")[1] == "noun.animal"


def test_committed_file_contents():
    records = load_wordnet_glosses()
    # WordNet 3.0 has 82,115 noun, 13,767 verb, 18,156 adjective (incl. satellite) and 3,621 adverb synsets.
    assert len(records) == 117659
    assert Counter(r.synset[0] for r in records) == {"n": 82115, "v": 13767, "a": 18156, "r": 3621}
    ids = [r.synset for r in records]
    assert ids == sorted(set(ids))
    labels = {r.supersense for r in records}
    assert labels == set(class_counts())
    assert labels <= set(LEXNAMES)
    assert len(labels) >= 40
    assert all(r.definition and "\t" not in r.definition for r in records)
    dog = next(r for r in records if r.synset == "n02084071")
    assert dog.supersense == "noun.animal"
    assert dog.lemmas == ("dog", "domestic_dog", "Canis_familiaris")
    assert dog.definition.startswith("a member of the genus Canis")
    assert dog.examples == ("the dog barked all night",)


def test_split_is_disjoint_stable_and_about_20_percent():
    train = load_wordnet_glosses(split="train")
    test = load_wordnet_glosses(split="test")
    assert {r.split for r in train} == {"train"} and {r.split for r in test} == {"test"}
    assert not {r.synset for r in train} & {r.synset for r in test}
    assert len(train) + len(test) == len(load_wordnet_glosses())
    assert 0.19 < len(test) / (len(train) + len(test)) < 0.21
    # Pinned: changing the hash scheme would silently reshuffle the split behind every published number.
    assert (len(train), len(test)) == (93984, 23675)
    assert [split_of(s) for s in ("a00003356", "a00003553", "a00003700", "a00003829")] == [
        "train",
        "test",
        "train",
        "test",
    ]


def test_caps_are_respected_deterministic_and_seeded():
    names = ["noun.animal", "verb.motion", "noun.feeling"]
    capped = load_wordnet_glosses(split="train", supersenses=names, max_per_class=30, seed=0)
    assert Counter(r.supersense for r in capped) == {name: 30 for name in names}
    assert {r.split for r in capped} == {"train"}
    assert capped == load_wordnet_glosses(split="train", supersenses=names, max_per_class=30, seed=0)
    other = load_wordnet_glosses(split="train", supersenses=names, max_per_class=30, seed=1)
    assert {r.synset for r in other} != {r.synset for r in capped}
    smaller = load_wordnet_glosses(split="train", supersenses=names, max_per_class=10, seed=0)
    assert {r.synset for r in smaller} < {r.synset for r in capped}
    # A cap above a class's size keeps the whole class.
    tops = load_wordnet_glosses(split="test", supersenses=["noun.Tops"], max_per_class=1000)
    assert len(tops) == class_counts()["noun.Tops"]["test"] > 0


def test_load_validates_arguments():
    with pytest.raises(ValueError, match="'train', 'test'"):
        load_wordnet_glosses(split="dev")
    with pytest.raises(ValueError, match=r"noun\.dog.*noun\.animal"):
        load_wordnet_glosses(supersenses=["noun.dog"])
    with pytest.raises(ValueError, match="not the string"):
        load_wordnet_glosses(supersenses="noun.animal")
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_per_class"):
            load_wordnet_glosses(max_per_class=bad)


SEED0_5X4 = [
    "noun.state", "noun.time", "adv.all", "noun.person",
    "verb.consumption", "verb.competition", "noun.substance", "noun.possession",
    "verb.communication", "noun.relation", "noun.plant", "verb.change",
    "noun.attribute", "verb.perception", "noun.animal", "noun.communication",
    "verb.social", "noun.act", "verb.contact", "noun.cognition",
]  # fmt: skip


def test_task_sequence_structure_and_global_labels():
    seq = wordnet_task_sequence()
    assert seq.class_names == SEED0_5X4  # the picks the docstring documents
    assert seq.meta["n_eligible"] == 41 and seq.meta["seed"] == 0 and seq.meta["train_per_class"] == 100
    assert len(seq) == 5 and seq.protocol == "class-incremental"
    by_text = {}
    for r in load_wordnet_glosses():
        by_text.setdefault(r.definition, set()).add(r.supersense)
    seen: set[int] = set()
    for t, task in enumerate(seq.tasks):
        assert task.classes == list(range(4 * t, 4 * t + 4))
        assert task.name == f"t{t}:" + "+".join(SEED0_5X4[4 * t : 4 * t + 4])
        assert not seen & set(task.classes)
        seen |= set(task.classes)
        assert Counter(ex.label for ex in task.train) == {c: 100 for c in task.classes}
        assert Counter(ex.label for ex in task.test) == {c: 40 for c in task.classes}
        for ex in task.train + task.test:
            assert isinstance(ex.inputs, str)
            assert seq.class_names[ex.label] in by_text[ex.inputs]
    # Test examples come from the test split only.
    test_texts = {r.definition for r in load_wordnet_glosses(split="test")}
    assert all(ex.inputs in test_texts for task in seq.tasks for ex in task.test)


def test_task_sequence_is_deterministic_per_seed():
    a = wordnet_task_sequence(n_tasks=10, classes_per_task=2, seed=3)
    b = wordnet_task_sequence(n_tasks=10, classes_per_task=2, seed=3)
    assert a.class_names == b.class_names
    assert [t.train for t in a.tasks] == [t.train for t in b.tasks]
    c = wordnet_task_sequence(n_tasks=10, classes_per_task=2, seed=4)
    assert c.class_names != a.class_names
    assert wordnet_task_sequence(n_tasks=10, classes_per_task=2).class_names == SEED0_5X4


def test_task_sequence_with_given_supersenses():
    names = ["verb.motion", "noun.animal", "adj.pert", "noun.food"]
    seq = wordnet_task_sequence(
        n_tasks=2, classes_per_task=2, supersenses=names, train_per_class=20, test_per_class=5,
        protocol="task-incremental",
    )  # fmt: skip
    assert seq.class_names == names
    assert [t.name for t in seq.tasks] == ["t0:verb.motion+noun.animal", "t1:adj.pert+noun.food"]
    assert seq.protocol == "task-incremental"
    assert {ex.label for ex in seq.tasks[1].train} == {2, 3}
    assert len(seq.tasks[1].test) == 10


def test_task_sequence_errors():
    with pytest.raises(ValueError, match="only 41 supersenses"):
        wordnet_task_sequence(n_tasks=7, classes_per_task=6)
    # Larger caps shrink the eligible set.
    big = [name for name, c in class_counts().items() if c["train"] >= 5000]
    assert 0 < len(big) < 41
    with pytest.raises(ValueError, match=f"only {len(big)} supersenses"):
        wordnet_task_sequence(n_tasks=len(big) + 1, classes_per_task=1, train_per_class=5000, test_per_class=1)
    assert wordnet_task_sequence(n_tasks=len(big), classes_per_task=1, train_per_class=5000, test_per_class=1)
    with pytest.raises(ValueError, match=r"noun\.dog"):
        wordnet_task_sequence(n_tasks=1, classes_per_task=2, supersenses=["noun.animal", "noun.dog"])
    with pytest.raises(ValueError, match=r"noun\.Tops"):
        wordnet_task_sequence(n_tasks=1, classes_per_task=2, supersenses=["noun.animal", "noun.Tops"])
    with pytest.raises(ValueError, match="3 names"):
        wordnet_task_sequence(n_tasks=1, classes_per_task=2, supersenses=["noun.animal", "noun.act", "noun.food"])
    with pytest.raises(ValueError, match="repeats"):
        wordnet_task_sequence(n_tasks=1, classes_per_task=2, supersenses=["noun.animal", "noun.animal"])
    with pytest.raises(ValueError, match="n_tasks"):
        wordnet_task_sequence(n_tasks=0)
    with pytest.raises(ValueError, match="protocol"):
        wordnet_task_sequence(protocol="domain-incremental")


def test_gloss_example_is_frozen():
    record = load_wordnet_glosses(max_per_class=1)[0]
    assert isinstance(record, GlossExample)
    with pytest.raises(AttributeError):
        record.supersense = "noun.act"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------------------
# the registry: every shipped data set declared, one build command for all, the config's `data.dataset` checked


def test_registry_declares_each_shipped_data_set():
    assert list(SHIPPED) == ["wordnet", "fortunes"]
    assert DATASETS == ("wordnet", "fortunes", "instruct", "files", "instructions")
    assert (WORDNET.source.package, WORDNET.source.version) == ("wordnet-base", "1:3.0-37")
    assert (FORTUNES.source.package, FORTUNES.source.version) == ("fortunes", "1:1.99.1-7.3")
    assert str(WORDNET.license) == "WordNet 3.0 license (peft_ext/data/files/WORDNET_LICENSE)"
    assert str(FORTUNES.license) == "fortune-mod BSD license (peft_ext/data/files/FORTUNES_LICENSE)"
    assert (WORDNET.split_rule.column, WORDNET.split_rule.test_percent) == ("synset", 20)
    assert (FORTUNES.split_rule.column, FORTUNES.split_rule.test_percent) == ("text", 30)
    assert FORTUNES.source.files == FORTUNES.class_names  # one fortune file per class
    readme = (WORDNET.path.parent / "README.md").read_text()
    for data in SHIPPED.values():
        assert data.rebuild == f"python -m peft_ext.data build {data.name}"
        assert "Copyright" in (data.path.parent / data.license.file).read_text()
        header = lzma.decompress(data.path.read_bytes()).split(b"\n", 1)[0].decode()
        assert tuple(header.split("\t")) == data.columns
        assert {data.key, data.label, data.text, data.split_rule.column} <= set(data.columns)
        records = data.read()
        assert len({data.key_of(r) for r in records}) == len(records)  # the key identifies a record
        assert {data.label_of(r) for r in records} <= set(data.class_names)
        # each record's split is the declared rule's
        assert all(r.split == data.split_rule.of(getattr(r, data.split_rule.column)) for r in records)
        assert data.stats_markdown() in readme  # files/README.md shows each file's per-class table


def test_build_command_reproduces_the_rows_of_the_committed_files(tmp_path, capsys):
    """`python -m peft_ext.data build NAME` on the Debian excerpts of tests/debian_sources (fortunes in a fresh
    interpreter, the entry point users run; wordnet in this one): the same bytes as the API's build, every row
    verbatim a row of the committed file."""
    for data in SHIPPED.values():
        source = Path(__file__).parent / "debian_sources" / data.name
        out = tmp_path / f"cli-{data.file}"
        argv = ["build", data.name, "--source-dir", str(source), "--out", str(out)]
        if data.name == "fortunes":
            done = subprocess.run([sys.executable, "-m", "peft_ext.data", *argv], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            printed = done.stdout
        else:
            assert main(argv) == 0
            printed = capsys.readouterr().out
        assert f"{data.item_word})" in printed
        assert out.read_bytes() == build_shipped(data.name, source, tmp_path / data.file).read_bytes()
        rows = lzma.decompress(out.read_bytes()).decode().splitlines()
        committed = set(lzma.decompress(data.path.read_bytes()).decode().splitlines())
        assert len(rows) > 100 and not [row for row in rows if row not in committed]


def test_unknown_names_are_refused_with_the_valid_ones(capsys, tmp_path):
    for argv in (["build", "wordnt"], ["stats", "fortune"], ["export", "files", "--out", str(tmp_path / "x.csv")]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"no shipped data set {argv[1]!r}" in err and "shipped: wordnet, fortunes" in err
    assert "did you mean 'wordnet'?" in check_message("wordnt") and "did you mean 'fortunes'?" in check_message(
        "fortune"
    )
    with pytest.raises(ValueError, match=r"no shipped data set 'files'; shipped: wordnet, fortunes"):
        shipped_dataset("files")
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert "wordnet-base 1:3.0-37" in listed and "fortune-mod BSD license" in listed


def check_message(name: str) -> str:
    with pytest.raises(ValueError) as err:
        check_dataset(name)
    return str(err.value)


def test_config_refuses_an_unknown_dataset_naming_the_valid_ones():
    from peft_ext.continual.config import ConfigError, DataSection, config_from_dict
    from peft_ext.jobs.reference import docstring_args

    config = {"data": {"dataset": "fortune"}, "methods": [{"name": "seq_lora", "lr": 1e-3}]}
    with pytest.raises(ConfigError) as err:
        config_from_dict(config)
    assert str(err.value) == (
        "`data.dataset` must be one of ['wordnet', 'fortunes', 'instruct', 'files', 'instructions'], got 'fortune' "
        "(did you mean 'fortunes'?)"
    )
    config["data"]["dataset"] = "fortunes"
    assert config_from_dict(config).data.n_tasks == FORTUNES.defaults["n_tasks"]
    documented = docstring_args(DataSection)["dataset"]  # the config reference's line
    assert all(f"``{name}``" in documented for name in DATASETS)


def test_export_writes_any_shipped_data_set(tmp_path, capsys):
    out = tmp_path / "food.csv"
    assert main(["export", "fortunes", "--out", str(out), "--split", "test", "--classes", "food", "law"]) == 0
    rows = list(csv.reader(out.open(encoding="utf-8")))
    expected = [r for r in FORTUNES.read() if r.split == "test" and r.category in ("food", "law")]
    assert rows == [["text", "label"]] + [[r.text, r.category] for r in expected]
    assert main(["export", "fortunes", "--out", str(out)]) == 1
    assert "exists" in capsys.readouterr().err
