"""The shipped instruction job, ``peft-ext run instruct``, end to end through the CLI on a tiny random Llama that reads
SmolLM2's real tokenizer and chat template (the real model is trained in tests/test_instruct_learning.py): every
method of the config, the report's held-out perplexity, the saved adapters answering prompts through ``peft-ext
predict``, and the bad input the job refuses.
"""

from __future__ import annotations

import json

import pytest

from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
METHODS = ["zero_shot", "seq_lora", "replay", "olora", "inflora", "splitlora", "pclr", "joint"]


@pytest.fixture(scope="module")
def tiny_chat_lm(tmp_path_factory):
    """A tiny random Llama (512 positions) with SmolLM2's tokenizer and chat template, saved as a local model."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from peft_ext.models import smollm2_gguf, smollm2_path

    try:
        smollm2_gguf()
    except ImportError as err:
        pytest.skip(str(err))
    path = tmp_path_factory.mktemp("tiny-chat-lm")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _sets(backbone, out, *more: str) -> list[str]:
    sets = [f"model.backbone={backbone}", f"output.dir={out}", "train.epochs=1", "train.batch_size=4"]
    sets += ["data.tasks=[part_of_speech, define, fortune_topic]", "data.train_per_task=6", "data.test_per_task=3"]
    sets += ["data.val_per_task=0", "model.max_new_tokens=4", *more]
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def job(tiny_chat_lm, tmp_path_factory):
    from peft_ext_cli import main

    out = tmp_path_factory.mktemp("instruct-job") / "out"
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["run", "instruct", "--no-progress", *_sets(tiny_chat_lm, out)])
    return code, printed.getvalue(), out


def test_every_method_of_the_shipped_job_runs_and_reports_general_ability(job):
    code, printed, out = job
    assert code == 0, printed
    results = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in results["results"]}
    assert list(rows) == METHODS
    assert results["tasks"] == ["t0:part_of_speech", "t1:define", "t2:fortune_topic"]
    assert "scored by exact match / ROUGE-L" in printed and "| held-out ppl / base |" in printed
    bases = set()
    for name, row in rows.items():
        R = row["accuracy_matrix"]
        if name == "joint":  # one phase over the union: the last row only
            assert all(x is not None for x in R[2])
        else:
            assert all(R[i][j] is not None for i in range(3) for j in range(i + 1)), name
        ppl = row["extras"]["held_out_perplexity"]
        bases.add(round(ppl["base"], 6))
        assert ppl["final"] > 1 and ppl["ratio"] == pytest.approx(ppl["final"] / ppl["base"])
        assert (ppl["ratio"] == 1.0) == (name == "zero_shot"), name  # every trained method moved the model
    assert len(bases) == 1  # one base model for all
    # 6 examples per task: the memory of 24 holds every finished task's 6
    assert rows["replay"]["extras"] | {} and rows["replay"]["extras"]["memory_per_task"] == [6, 6, 6]
    assert rows["replay"]["extras"]["memory_size"] == 24
    # the define task is scored by ROUGE-L in the matrix, the others by exact match
    row = rows["seq_lora"]
    assert row["accuracy_matrix"][2][1] == row["extras"]["rouge_l_matrix"][2][1]


def test_the_saved_adapters_answer_prompts_through_predict(job, tmp_path, capsys):
    from peft_ext_cli import main

    code, _, out = job
    assert code == 0
    saved = sorted(p.name for p in (out / "adapters").iterdir())
    assert set(METHODS) - {"zero_shot"} <= set(saved)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('Is "quickly" a noun, a verb, an adjective or an adverb?\nDefine "dog" in a few words.\n')
    for method in ("pclr", "inflora", "seq_lora"):  # an adapter pool, merged earlier tasks, a plain LoRA
        assert main(["predict", str(out), str(prompts), "--method", method]) == 0, capsys.readouterr().err
        lines = capsys.readouterr().out.rstrip("\n").split("\n")  # an untrained model's answer may be empty
        assert len(lines) == 2 and lines[0].endswith('\tIs "quickly" a noun, a verb, an adjective or an adverb?')
    # the saved model is the trained one: its answers equal the run's own model's on the same prompts
    from peft_ext.continual.trained import load_trained

    model = load_trained(out / "adapters" / "inflora")
    assert model.collate.chat_template and model.collate.system_prompt == "Answer briefly."
    long = tmp_path / "long.txt"
    long.write_text("word " * 600 + "\n")
    assert main(["predict", str(out), str(long), "--method", "pclr"]) == 2
    err = capsys.readouterr().err
    assert "tokens long; the model answers prompts of at most" in err and "max_length 160" in err


def test_instruction_job_refuses_bad_input_before_any_work(tiny_chat_lm, tmp_path, capsys):
    from peft_ext_cli import main

    out = tmp_path / "o"
    # a model that reads fewer positions than an example needs
    assert main(["check", "instruct", *_sets(tiny_chat_lm, out, "model.max_new_tokens=500")]) == 2
    err = capsys.readouterr().err
    assert "reads at most 512 positions" in err and "plus 500 generated" in err
    assert (
        main(["check", "instruct", *_sets(tiny_chat_lm, out, "model.system_prompt=hi", "model.chat_template=false")])
        == 2
    )
    assert "`model.system_prompt` is a message of the chat template" in capsys.readouterr().err
    assert main(["check", "instruct", *_sets(tiny_chat_lm, out, "methods.replay.memory_size=0")]) == 2
    assert "`methods[2].memory_size` must be a positive integer, got 0" in capsys.readouterr().err
    assert not out.exists()


def test_replay_resumed_after_an_interruption_equals_an_uninterrupted_run(tiny_chat_lm, tmp_path, monkeypatch):
    """The replay memory travels with the end-of-task snapshot: a run stopped after its second task and resumed
    trains the third on the same remembered examples, so its results equal an uninterrupted run's."""
    from peft_ext.continual.progress import TaskProgress
    from peft_ext_cli import main

    def results(out) -> dict:
        (row,) = json.loads((out / "results.json").read_text())["results"]
        return row

    whole = tmp_path / "whole"
    assert main(["run", "instruct", "--no-progress", "--only", "replay", *_sets(tiny_chat_lm, whole)]) == 0
    original = TaskProgress.save

    def save_then_stop(self, model, method_state, record):
        original(self, model, method_state, record)
        if record.completed == 2:
            raise KeyboardInterrupt

    cut = tmp_path / "cut"
    with monkeypatch.context() as patch:
        patch.setattr(TaskProgress, "save", save_then_stop)
        assert main(["run", "instruct", "--no-progress", "--only", "replay", *_sets(tiny_chat_lm, cut)]) == 130
    assert main(["run", "instruct", "--no-progress", "--only", "replay", "--resume", *_sets(tiny_chat_lm, cut)]) == 0
    a, b = results(whole), results(cut)
    assert a["accuracy_matrix"] == b["accuracy_matrix"]
    flat = [[x for row in r["extras"]["answer_loss_matrix"] for x in row if x is not None] for r in (a, b)]
    assert flat[0] == pytest.approx(flat[1], rel=1e-6) and len(flat[0]) == 6
    assert b["extras"]["memory_per_task"] == [6, 6, 6]
