"""The shipped instruction tasks (peft_ext.data.instruct_tasks): every family built from the real data, its answers
checked against WordNet and the fortunes independently of the builders, the hash splits, the seeded sample, the TRL
files (committed and read back), and the `dataset: instruct` config path."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import yaml

from peft_ext.continual.config import ConfigError, DataSection, config_from_dict, load_config
from peft_ext.data import (
    DATASETS,
    FORTUNES,
    INSTRUCTION_TASKS,
    MAX_WORDS,
    WORDNET,
    check_dataset,
    instruction_candidates,
    is_instruction_dataset,
    shipped_instruction_sequence,
    write_trl_files,
)
from peft_ext.data.__main__ import main
from peft_ext.data.user_instructions import instruction_sequence_from_files

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "configs" / "data" / "instruct"
SPLITS = ("train", "validation", "test")
POS = {"n": "noun", "v": "verb", "a": "adjective", "r": "adverb"}


def quoted(prompt: str) -> str:
    """The first double-quoted part of a prompt (the word, definition or sentence it asks about)."""
    return re.search(r'"(.*?)"', prompt, re.S)[1]


@pytest.fixture(scope="module")
def wordnet_index():
    """Every WordNet lemma (lower case, spaces) with the synsets that list it, built here, not by the module."""
    index = defaultdict(list)
    for r in WORDNET.read():
        for lemma in r.lemmas:
            index[lemma.lower().replace("_", " ")].append(r)
    return index


@pytest.fixture(scope="module")
def default_sequence():
    return shipped_instruction_sequence()


def items(family):
    candidates = instruction_candidates(family)
    return [(split, *item) for split in ("train", "test") for item in candidates[split]]


# ---------------------------------------------------------------------------------------------------------------
# the families: enough items, short, one split per key, answers that are right and unambiguous


def test_every_family_builds_enough_short_items_each_key_in_one_split():
    assert list(INSTRUCTION_TASKS) == [
        "supersense",
        "gloss_to_word",
        "part_of_speech",
        "fortune_topic",
        "define",
        "example_to_word",
    ]
    assert {spec.source for spec in INSTRUCTION_TASKS.values()} == {"wordnet", "fortunes"}
    for family, spec in INSTRUCTION_TASKS.items():
        candidates = instruction_candidates(family)
        assert len(candidates["train"]) >= 200 and len(candidates["test"]) >= 60, family
        keys = {split: [key for key, _, _ in candidates[split]] for split in ("train", "test")}
        assert not set(keys["train"]) & set(keys["test"]), family
        assert all(len(set(k)) == len(k) for k in keys.values()), family  # deduplicated by key
        for split, key, prompt, answer in items(family):
            assert spec.split_rule.of(key) == split  # a fixed function of the key, whatever the sizes
            assert answer.strip() == answer and answer, (family, prompt)
            assert len(prompt.split()) + len(answer.split()) <= MAX_WORDS, (family, prompt)
        # the hash split is near its declared share, so neither split is starved
        share = len(keys["test"]) / (len(keys["train"]) + len(keys["test"]))
        assert abs(share - spec.split_rule.test_percent / 100) < 0.03, family


def test_a_word_is_in_the_same_split_in_every_wordnet_family():
    split_of = {}
    for family, spec in INSTRUCTION_TASKS.items():
        if spec.source != "wordnet":
            continue
        for split, key, _, _ in items(family):
            assert split_of.setdefault(key, split) == split, (family, key)


def test_metrics_and_answer_shapes():
    metrics = {family: spec.metric for family, spec in INSTRUCTION_TASKS.items()}
    assert metrics == {
        "supersense": "exact_match",
        "gloss_to_word": "exact_match",
        "part_of_speech": "exact_match",
        "fortune_topic": "exact_match",
        "define": "rouge_l",
        "example_to_word": "exact_match",
    }
    for family, spec in INSTRUCTION_TASKS.items():
        answers = [answer for _, _, _, answer in items(family)]
        if spec.labels is not None:  # label families: lower-case labels, every one used
            assert Counter(answers).keys() == set(spec.labels), family
            assert all(label == label.lower() and " " not in label for label in spec.labels), family
        elif spec.metric == "exact_match":  # a word: at most three lower-case words, no punctuation
            assert all(re.fullmatch(r"[a-z-]+( [a-z-]+){0,2}", a) for a in answers), family
        else:  # the ROUGE family: definitions of several words
            lengths = [len(a.split()) for a in answers]
            assert min(lengths) >= 3 and max(lengths) <= 12 and sum(lengths) / len(lengths) > 5, family


def test_supersense_answers_are_the_category_of_every_noun_sense(wordnet_index):
    names = {
        "animal": "noun.animal",
        "artifact": "noun.artifact",
        "body": "noun.body",
        "food": "noun.food",
        "location": "noun.location",
        "person": "noun.person",
        "plant": "noun.plant",
        "time": "noun.time",
    }
    assert INSTRUCTION_TASKS["supersense"].labels == tuple(names)
    for _, key, prompt, answer in items("supersense"):
        word = quoted(prompt)
        assert word == key and all(name in prompt for name in names)
        # every noun sense of the word, in the whole of WordNet, is in the answer's category
        assert {r.supersense for r in wordnet_index[word] if r.synset[0] == "n"} == {names[answer]}, word
    answers = {key: answer for _, key, _, answer in items("supersense")}
    assert [answers.get(w) for w in ("giraffe", "kidney", "tulip", "dentist")] == ["animal", "body", "plant", "person"]
    assert "tomato" in wordnet_index and "tomato" not in answers  # a food and a plant: no one answer


def test_part_of_speech_answers_are_unambiguous(wordnet_index):
    answers = {key: answer for _, key, _, answer in items("part_of_speech")}
    for word, answer in answers.items():
        assert {POS[r.synset[0]] for r in wordnet_index[word]} == {answer}, word
    # a noun lemma that is also a regular form of a verb ("building" of "build") is left out
    assert "building" in wordnet_index and "building" not in answers
    assert answers.get("quickly") == "adverb" and answers.get("vacillate") == "verb"
    assert Counter(answers.values()).keys() == {"noun", "verb", "adjective", "adverb"}


def test_gloss_to_word_answers_are_the_one_first_lemma_of_the_definition():
    first_lemmas = defaultdict(set)
    for r in WORDNET.read():
        first_lemmas[r.definition].add(r.lemmas[0].replace("_", " "))
    for _, key, prompt, answer in items("gloss_to_word"):
        definition = quoted(prompt)
        assert key == answer and first_lemmas[definition] == {answer}, definition
        assert len(definition.split()) <= 14
        assert not re.search(rf"\b{re.escape(answer)}\b", definition.lower())  # the definition does not give it away


def test_define_words_have_one_sense_and_their_definition(wordnet_index):
    for _, key, prompt, answer in items("define"):
        assert quoted(prompt) == key
        (synset,) = wordnet_index[key]  # one sense in the whole of WordNet
        assert synset.definition == answer


def test_example_to_word_answers_appear_in_their_sentence(wordnet_index):
    for _, key, prompt, answer in items("example_to_word"):
        sentence = quoted(prompt)
        assert key == answer
        assert re.search(rf"(?<![a-z-]){re.escape(answer)}(?![a-z-])", sentence.lower()), (sentence, answer)
        # the sentence is an example of a synset that lists the answer
        assert any(sentence in r.examples for r in wordnet_index[answer]), sentence


def test_fortune_topic_answers_are_the_fortunes_topic_among_the_twelve():
    category = {r.text: r.category for r in FORTUNES.read()}
    assert INSTRUCTION_TASKS["fortune_topic"].labels == FORTUNES.class_names and len(FORTUNES.class_names) == 12
    for split, key, prompt, answer in items("fortune_topic"):
        assert answer in FORTUNES.class_names and category[key] == answer
        assert f'"{key}"' in prompt and len(key.split()) <= 30
        assert all(topic in prompt for topic in FORTUNES.class_names)
        assert FORTUNES.split_rule.of(key) == split  # the split of the shipped classification data


# ---------------------------------------------------------------------------------------------------------------
# the sequence: sizes, the seeded sample, validation from the train split


def test_the_default_sequence(default_sequence):
    seq = default_sequence
    assert seq.kind == "generation" and seq.class_names == list(INSTRUCTION_TASKS)
    assert seq.name == "instruct-" + "-".join(INSTRUCTION_TASKS) + "-seed0"
    for i, (task, family) in enumerate(zip(seq.tasks, INSTRUCTION_TASKS)):
        assert task.name == f"t{i}:{family}" and task.classes == [i]
        assert task.metric == INSTRUCTION_TASKS[family].metric
        assert (len(task.train), len(task.validation), len(task.test)) == (64, 16, 32)
        assert all(ex.label == i for split in SPLITS for ex in getattr(task, split))
        split_of = {prompt: split for split, _, prompt, _ in items(family)}
        pairs = {s: {(ex.inputs.prompt, ex.inputs.answer) for ex in getattr(task, s)} for s in SPLITS}
        assert sum(map(len, pairs.values())) == 112  # no example twice
        assert {split_of[p] for p, _ in pairs["train"] | pairs["validation"]} == {"train"}  # never from test
        assert {split_of[p] for p, _ in pairs["test"]} == {"test"}
    assert seq.meta["seed"] == 0 and seq.meta["sources"].keys() == {"wordnet", "fortunes"}
    assert (seq.meta["train_per_task"], seq.meta["test_per_task"], seq.meta["val_per_task"]) == (64, 32, 16)
    assert seq.meta["families"]["define"] == {"source": "wordnet", "metric": "rouge_l"}
    assert seq.meta["candidates"]["fortune_topic"] == {"train": 1807, "test": 757}


def test_label_families_are_sampled_balanced(default_sequence):
    for task, family in zip(default_sequence.tasks, INSTRUCTION_TASKS):
        labels = INSTRUCTION_TASKS[family].labels
        if labels is None:
            continue
        counts = Counter(ex.inputs.answer for ex in task.train)
        assert set(counts) == set(labels) and max(counts.values()) - min(counts.values()) <= 1, (family, counts)


def test_the_sample_is_deterministic_seeded_and_independent_of_the_task_order(default_sequence):
    def pairs(seq):
        return {
            seq.class_names[t.classes[0]]: {
                s: [(e.inputs.prompt, e.inputs.answer) for e in getattr(t, s)] for s in SPLITS
            }
            for t in seq.tasks
        }

    again = shipped_instruction_sequence()
    assert pairs(again) == pairs(default_sequence)  # the same, in the same order
    reordered = shipped_instruction_sequence(["define", "supersense"])
    assert reordered.class_names == ["define", "supersense"]
    assert reordered.tasks[0].name == "t0:define" and reordered.tasks[1].metric == "exact_match"
    for family, by_split in pairs(reordered).items():
        assert by_split == pairs(default_sequence)[family]
    other = pairs(shipped_instruction_sequence(seed=1))
    for family in INSTRUCTION_TASKS:
        assert set(other[family]["train"]) != set(pairs(default_sequence)[family]["train"])


def test_sizes_are_honoured_and_a_bigger_train_sample_keeps_the_validation_disjoint():
    seq = shipped_instruction_sequence(
        ["fortune_topic", "part_of_speech"], train_per_task=5, test_per_task=3, val_per_task=0
    )
    assert [(len(t.train), len(t.validation), len(t.test)) for t in seq.tasks] == [(5, 0, 3), (5, 0, 3)]
    big = shipped_instruction_sequence(["define"], train_per_task=300, test_per_task=100, val_per_task=50)
    (task,) = big.tasks
    assert (len(task.train), len(task.validation), len(task.test)) == (300, 50, 100)
    train = {e.inputs.prompt for e in task.train}
    assert not train & {e.inputs.prompt for e in task.validation}
    assert len(train) == 300


def test_errors_name_the_bad_value_and_what_is_valid():
    with pytest.raises(ValueError, match=r"unknown family 'supersens' \(did you mean 'supersense'\?\); valid: \["):
        shipped_instruction_sequence(["supersens"])
    with pytest.raises(ValueError, match=r"lists \['define'\] more than once"):
        shipped_instruction_sequence(["define", "supersense", "define"])
    with pytest.raises(ValueError, match="not the string 'define'"):
        shipped_instruction_sequence("define")
    with pytest.raises(ValueError, match="`tasks` is empty"):
        shipped_instruction_sequence([])
    for kwargs, message in (
        ({"train_per_task": 0}, r"`train_per_task` must be an int >= 1, got 0"),
        ({"test_per_task": -1}, r"`test_per_task` must be an int >= 1, got -1"),
        ({"val_per_task": -1}, r"`val_per_task` must be an int >= 0, got -1"),
        ({"train_per_task": 2.5}, r"`train_per_task` must be an int >= 1, got 2.5"),
    ):
        with pytest.raises(ValueError, match=message):
            shipped_instruction_sequence(["define"], **kwargs)
    have = len(instruction_candidates("fortune_topic")["test"])
    with pytest.raises(ValueError, match=rf"'fortune_topic' has {have} items in its test split.*at most {have}"):
        shipped_instruction_sequence(["fortune_topic"], test_per_task=have + 1)
    have = len(instruction_candidates("fortune_topic")["train"])
    with pytest.raises(ValueError, match=rf"has {have} items in its train split, fewer than train_per_task \+ val"):
        shipped_instruction_sequence(["fortune_topic"], train_per_task=have, val_per_task=1)
    shipped_instruction_sequence(["fortune_topic"], train_per_task=have - 1, val_per_task=1)  # exactly all: fine


# ---------------------------------------------------------------------------------------------------------------
# TRL files: written, read back, committed


def test_trl_files_read_back_to_the_same_prompts_and_answers(tmp_path):
    seq = shipped_instruction_sequence(["supersense", "define", "fortune_topic"], train_per_task=12, test_per_task=4)
    written = write_trl_files(seq, tmp_path / "out")
    names = [p.name for p in written]
    assert names == [f"{f}.{s}.jsonl" for f in ("supersense", "define", "fortune_topic") for s in SPLITS]
    train_files = [tmp_path / "out" / f"{f}.train.jsonl" for f in seq.class_names]
    back = instruction_sequence_from_files(train_files, test_share=0.25, seed=0)
    assert back.class_names == ["supersense.train", "define.train", "fortune_topic.train"]
    for original, read in zip(seq.tasks, back.tasks):
        rows = [(e.inputs.prompt, e.inputs.answer) for s in SPLITS for e in getattr(read, s)]
        assert sorted(rows) == sorted((e.inputs.prompt, e.inputs.answer) for e in original.train)
    no_validation = shipped_instruction_sequence(["define"], train_per_task=3, test_per_task=2, val_per_task=0)
    assert [p.name for p in write_trl_files(no_validation, tmp_path / "nv")] == [
        "define.train.jsonl",
        "define.test.jsonl",
    ]
    with pytest.raises(ValueError, match="holds classification tasks"):
        write_trl_files(WORDNET.task_sequence(1, 2, 0, 3, 2), tmp_path / "wn")


def test_the_committed_files_are_what_the_code_builds_now(tmp_path, default_sequence):
    written = write_trl_files(default_sequence, tmp_path)
    assert sorted(p.name for p in COMMITTED.glob("*.jsonl")) == sorted(p.name for p in written)
    for path in written:
        assert (COMMITTED / path.name).read_bytes() == path.read_bytes(), (
            f"{path.name} differs: run `python -m peft_ext.data export-instructions configs/data/instruct`"
        )
    readme = (COMMITTED / "README.md").read_text()
    assert "python -m peft_ext.data export-instructions configs/data/instruct" in readme
    assert all(f"`{family}`" in readme for family in INSTRUCTION_TASKS)
    import tomllib

    # they ship in the wheel: the folder is a data package (tests/test_wheel.py checks the built wheel itself)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "peft_ext.configs.data.instruct" in setuptools["packages"]
    assert {"*.jsonl", "*.md"} <= set(setuptools["package-data"]["peft_ext.configs.data.instruct"])


def test_export_instructions_command(tmp_path, capsys):
    argv = ["export-instructions", str(tmp_path), "--tasks", "define", "supersense", "--seed", "3"]
    assert main([*argv, "--train-per-task", "4", "--val-per-task", "0", "--test-per-task", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        f"wrote {tmp_path / f'{f}.{s}.jsonl'}" for f in ("define", "supersense") for s in ("train", "test")
    ]
    expected = shipped_instruction_sequence(["define", "supersense"], 4, 2, 0, seed=3)
    check = write_trl_files(expected, tmp_path / "api")
    assert all((tmp_path / p.name).read_bytes() == p.read_bytes() for p in check)
    assert main(["export-instructions", str(tmp_path), "--tasks", "defin"]) == 1
    assert "did you mean 'define'?" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# the registry and the job config: `dataset: instruct` with a causal LM


def test_the_registry_declares_instruct_as_instruction_data():
    assert check_dataset("instruct") == "instruct" and "instruct" in DATASETS
    assert {name: is_instruction_dataset(name) for name in DATASETS} == {
        "wordnet": False,
        "fortunes": False,
        "instruct": True,
        "files": False,
        "instructions": True,
    }
    with pytest.raises(ValueError, match=r"did you mean 'instruct'"):
        is_instruction_dataset("instrct")


def instruct_config(**data):
    return {
        "name": "instruct_test",
        "model": {"kind": "causal_lm", "backbone": "HuggingFaceTB/SmolLM2-135M-Instruct", "max_length": 96},
        "data": {"dataset": "instruct", **data},
        "methods": [{"name": "seq_lora", "lr": 1e-3}],
    }


def test_a_config_builds_the_sequence(tmp_path):
    from peft_ext.jobs.preflight import check_data
    from peft_ext.jobs.sequence import build_sequence, sequence_summary

    path = tmp_path / "instruct.yaml"
    tasks = ["part_of_speech", "define", "supersense"]
    path.write_text(yaml.safe_dump(instruct_config(tasks=tasks, train_per_task=10, test_per_task=5, seed=2)))
    config = load_config(path)
    seq = build_sequence(config)
    expected = shipped_instruction_sequence(tasks, train_per_task=10, test_per_task=5, seed=2)
    assert seq.class_names == tasks and [t.metric for t in seq.tasks] == ["exact_match", "rouge_l", "exact_match"]
    for got, want in zip(seq.tasks, expected.tasks):
        assert (got.train, got.validation, got.test) == (want.train, want.validation, want.test)
    assert [len(t.validation) for t in seq.tasks] == [16, 16, 16]  # the API's default
    assert check_data(config).class_names == tasks  # what `peft-ext check` builds and checks (seq_lora runs it)
    head = sequence_summary("instruct_test", seq)[0]
    assert "scored by exact match / ROUGE-L of the generated answers" in head and "30 train / 48 validation" in head
    # every family by default, in the registry's order
    assert build_sequence(config_from_dict(instruct_config())).class_names == list(INSTRUCTION_TASKS)


def test_instruct_needs_a_causal_lm_and_its_own_keys():
    classifier = instruct_config()
    classifier["model"] = {"kind": "classifier", "backbone": "minilm"}
    with pytest.raises(ConfigError, match=r"`data.dataset: instruct` and `model.kind: causal_lm` go together"):
        config_from_dict(classifier)
    causal_on_wordnet = instruct_config()
    causal_on_wordnet["data"] = {"dataset": "wordnet"}
    with pytest.raises(ConfigError, match=r"`model.kind: causal_lm` and `data.dataset: instruct / instructions` go"):
        config_from_dict(causal_on_wordnet)
    for data, message in (
        ({"tasks": ["supersens"]}, r"`data.tasks` names an unknown family 'supersens' \(did you mean 'supersense'"),
        ({"tasks": ["define", "define"]}, r"`data.tasks` lists \['define'\] more than once"),
        ({"train_per_task": 0}, r"`data.train_per_task` must be an integer >= 1, got 0"),
        ({"val_per_task": -2}, r"`data.val_per_task` must be an integer >= 0, got -2"),
        ({"n_tasks": 3}, r"`data.n_tasks` is not a key of `dataset: instruct`: it takes `tasks`"),
        ({"train": "x.jsonl"}, r"`data.train` is not a key of `dataset: instruct`"),
    ):
        with pytest.raises(ConfigError, match=message):
            config_from_dict(instruct_config(**data))
    wordnet = {"data": {"dataset": "wordnet", "train_per_task": 8}, "methods": [{"name": "seq_lora", "lr": 1e-3}]}
    with pytest.raises(ConfigError, match=r"`data.train_per_task` is for `dataset: instruct`"):
        config_from_dict(wordnet)
    # more examples than a split holds: `peft-ext check` says so before any work
    from peft_ext.jobs.preflight import check_data

    too_many = config_from_dict(instruct_config(tasks=["fortune_topic"], test_per_task=10**4))
    with pytest.raises(ConfigError, match=r"`data`: instruction task 'fortune_topic' has 757 items in its test split"):
        check_data(too_many)


def test_the_config_reference_names_every_family():
    from peft_ext.jobs.reference import docstring_args

    documented = docstring_args(DataSection)
    assert all(f"``{family}``" in documented["tasks"] for family in INSTRUCTION_TASKS)
    assert {"train_per_task", "test_per_task", "val_per_task"} <= documented.keys()
