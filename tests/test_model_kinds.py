"""The model kinds (peft_ext/models/kinds.py): one object per ``model.kind`` owns what differs between a classifier and
a causal LM, and the data layer's sequence kinds say what their examples are."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
from transformers import BertConfig, LlamaConfig

from peft_ext.continual.config import ConfigError, ModelSection, config_from_dict
from peft_ext.continual.task_kinds import TASK_KINDS, Classification, task_kind
from peft_ext.continual.trained import FORMAT, MODEL_FILE, load_trained
from peft_ext.data.tasks import SEQUENCE_KINDS, Example, Instruction, Task, TaskSequence
from peft_ext.models.kinds import MODEL_KINDS, CausalLM, Classifier, model_kind

ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = r"unknown model kind 'regressor'; known kinds: \['causal_lm', 'classifier'\]"


def test_each_kind_is_found_by_its_name_and_an_unknown_one_names_the_known():
    assert isinstance(model_kind("classifier"), Classifier) and isinstance(model_kind("causal_lm"), CausalLM)
    with pytest.raises(ValueError, match=UNKNOWN):
        model_kind("regressor")


@pytest.mark.parametrize(
    ("registry", "base", "lookup"), [(MODEL_KINDS, CausalLM, model_kind), (TASK_KINDS, Classification, task_kind)]
)
def test_a_registered_kind_is_found_by_its_name_until_it_is_removed(registry, base, lookup):
    kind = registry.register(type("Ranking", (base,), {"name": "ranking"}))
    try:
        assert type(lookup("ranking")) is kind and isinstance(lookup("ranking"), base)
        with pytest.raises(ValueError, match="a .* kind named 'ranking' is already registered"):
            registry.register(type("Other", (base,), {"name": "ranking"}))
    finally:
        registry.unregister("ranking")
    with pytest.raises(ValueError, match="unknown .*'ranking'; known kinds"):
        lookup("ranking")


def test_the_config_offers_the_registered_kinds():
    """``model.kind`` is checked against its Literal (what the config reference lists): the same names."""
    assert set(typing.get_args(typing.get_type_hints(ModelSection)["kind"])) == set(MODEL_KINDS)
    assert ModelSection.kind in MODEL_KINDS


def test_each_kind_learns_a_task_kind_whose_examples_the_data_layer_declares():
    assert set(SEQUENCE_KINDS) == set(TASK_KINDS)
    for name, kind in SEQUENCE_KINDS.items():
        assert kind.holds_instructions == task_kind(name).causal
    assert model_kind("classifier").sequence_kind == "classification"
    assert model_kind("causal_lm").sequence_kind == "generation"
    for kind in MODEL_KINDS.values():
        assert kind.sequence_kind in TASK_KINDS


def test_a_sequence_says_whether_it_holds_instructions():
    texts = TaskSequence("t", ["a"], [Task("a", [0], [Example("x", 0)], [Example("y", 0)])])
    assert not texts.holds_instructions
    ex = Example(Instruction("say hi", "hi"), 0)
    assert TaskSequence("i", ["a"], [Task("a", [0], [ex], [ex])], kind="generation").holds_instructions
    with pytest.raises(TypeError, match="generation examples carry an Instruction"):
        TaskSequence("i", ["a"], [Task("a", [0], [Example("x", 0)], [Example("y", 0)])], kind="generation")


def test_a_classifier_refuses_the_causal_lm_options_and_a_causal_lm_takes_them():
    for key, value in (("dtype", "bfloat16"), ("max_new_tokens", 4), ("chat_template", True), ("separator", "<s>")):
        with pytest.raises(ValueError, match=rf"`{key}` is for `kind: causal_lm`; a classifier trains in float32"):
            ModelSection(**{key: value}).validate()
        ModelSection(kind="causal_lm", **{key: value}).validate()


def test_a_data_set_of_the_other_kind_names_what_goes_together():
    methods = [{"name": "seq_lora"}]
    with pytest.raises(ConfigError, match=r"`data.dataset: instruct` and `model.kind: causal_lm` go together \("):
        config_from_dict({"data": {"dataset": "instruct"}, "methods": methods})
    with pytest.raises(ConfigError, match=r"`model.kind: causal_lm` and `data.dataset: instruct / instructions` go"):
        config_from_dict({"model": {"kind": "causal_lm"}, "data": {"dataset": "wordnet"}, "methods": methods})


def test_the_kind_builds_model_and_sequence_in_its_order(monkeypatch):
    """A classifier's head needs the sequence's classes; a causal LM's tokenizer renders the sequence's rows."""
    calls = []

    def build(tokenizer):
        calls.append(("sequence", tokenizer))
        return TaskSequence("t", ["a", "b"], [Task("a", [0, 1], [Example("x", 0)], [Example("y", 1)])])

    def text_classifier(backbone, num_labels, dropout, seed):
        calls.append(("classifier", num_labels))
        return "encoder", "tokenizer"

    def causal_lm(backbone, dtype, load_in_4bit):
        calls.append(("causal_lm", dtype))
        return "lm", "lm tokenizer"

    monkeypatch.setattr("peft_ext.models.text.load_text_classifier", text_classifier)
    monkeypatch.setattr("peft_ext.models.text.load_causal_lm", causal_lm)
    model, tokenizer, _ = model_kind("classifier").load_for_job(ModelSection(), build, seed=0)
    assert (model, tokenizer) == ("encoder", "tokenizer")
    assert calls == [("sequence", None), ("classifier", 2)]
    calls.clear()
    model, tokenizer, _ = model_kind("causal_lm").load_for_job(ModelSection(kind="causal_lm"), build, seed=0)
    assert (model, tokenizer) == ("lm", "lm tokenizer")
    assert calls == [("causal_lm", "float32"), ("sequence", "lm tokenizer")]


def test_the_linear_layers_adapters_may_target_are_named_as_in_the_job_model():
    bert = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    names = model_kind("classifier").linear_layers(bert)
    assert "encoder.encoder.layer.0.attention.self.query" in names and all(n.startswith("encoder.") for n in names)
    llama = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    names = model_kind("causal_lm").linear_layers(llama)
    assert "model.layers.0.self_attn.q_proj" in names and not any(n.endswith("lm_head") for n in names)
    assert all(m.weight.is_meta for m in names.values())


def test_a_saved_description_records_what_loads_it_back(tmp_path):
    section = ModelSection(kind="causal_lm", backbone="smollm2", max_length=64, chat_template=True)
    assert model_kind("classifier").saved_settings(ModelSection()) == {}
    assert model_kind("causal_lm").saved_settings(section) == {"model": dataclasses.asdict(section)}

    def save(**meta):
        (tmp_path / MODEL_FILE).write_text(json.dumps({"format": FORMAT, **meta}))
        return tmp_path

    with pytest.raises(ValueError, match=UNKNOWN):
        load_trained(save(kind="regressor"))
    with pytest.raises(ValueError, match="a causal-LM method saved before its prompt settings were recorded"):
        load_trained(save(kind="causal_lm"))


def test_no_module_tests_a_model_or_sequence_kind_by_its_name():
    """peft_ext asks the kind objects (:mod:`peft_ext.models.kinds`, :mod:`peft_ext.continual.task_kinds`) or the
    data layer's declared :class:`~peft_ext.data.tasks.SequenceKind`; a kind's name is data, never a branch."""
    names = r"""["'](classifier|causal_lm|classification|generation)["']"""
    listed = r"""(["'][^"']*["']\s*,\s*)*"""  # the names before it in a literal tuple, list or set
    test = re.compile(rf"[!=]=\s*{names}|{names}\s*[!=]=|\bin\s*[(\[{{]\s*{listed}{names}")
    kind_modules = {"peft_ext/models/kinds.py", "peft_ext/continual/task_kinds.py"}
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "peft_ext").rglob("*.py"))
        if str(path.relative_to(ROOT)) not in kind_modules
        for n, line in enumerate(path.read_text().splitlines(), 1)
        # "classifier" also names modules (a model's `classifier` head): only a test that mentions a kind counts
        if (m := test.search(line)) and ("kind" in line or "classifier" not in m.group(0))
    ]
    assert not found, found
