"""Instruction sequences from files in TRL's formats (peft_ext.data.user_instructions): prompt-completion and
conversational rows, one file per task or a task column, hash-carved splits, bad rows named, and a run of the
engine on the shipped JSONL tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from peft_ext.data.tasks import Instruction  # noqa: E402
from peft_ext.data.user_instructions import instruction_sequence_from_files  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs" / "data" / "instructions").glob("*.jsonl"))
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>"
    "{% endif %}"
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat_tokenizer():
    from transformers import AutoTokenizer

    from peft_ext.models import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path())
    tok.chat_template = TEMPLATE
    return tok


def test_one_file_per_task_in_the_prompt_completion_format():
    seq = instruction_sequence_from_files(SHIPPED, seed=0)
    assert seq.kind == "generation" and seq.class_names == ["first_letter", "reverse", "upper"]
    for t, task in enumerate(seq.tasks):
        assert task.classes == [t] and all(isinstance(e.inputs, Instruction) and e.label == t for e in task.train)
        train, test = {e.inputs.prompt for e in task.train}, {e.inputs.prompt for e in task.test}
        assert not train & test and len(train) + len(test) == 24 and test
    reverse = seq.tasks[1]
    assert all(e.inputs.answer == e.inputs.prompt.rsplit(" ", 1)[1][::-1] for e in reverse.train)
    again = instruction_sequence_from_files(SHIPPED, seed=0)
    assert [[e.inputs for e in t.test] for t in again.tasks] == [[e.inputs for e in t.test] for t in seq.tasks]


def test_conversational_rows_render_the_prompt_with_the_chat_template(tmp_path, chat_tokenizer):
    messages = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
        for w in ("one", "two", "three", "four", "five", "six", "seven", "eight")
    ]
    pc = [
        {"prompt": [{"role": "user", "content": f"echo {w}"}], "completion": [{"role": "assistant", "content": w}]}
        for w in ("red", "blue", "green", "pink", "gray", "teal", "gold", "navy")
    ]
    seq = instruction_sequence_from_files(
        [write_jsonl(tmp_path / "say.jsonl", messages), write_jsonl(tmp_path / "echo.jsonl", pc)],
        tokenizer=chat_tokenizer,
        test_share=0.25,
    )
    example = (seq.tasks[0].train + seq.tasks[0].test)[0].inputs
    assert example.prompt.startswith("<user>say ") and example.prompt.endswith("<assistant>")
    assert example.answer == example.prompt[len("<user>say ") : -len("<assistant>")]
    echo = (seq.tasks[1].train + seq.tasks[1].test)[0].inputs
    assert echo.prompt.startswith("<user>echo ") and echo.answer in {
        "red",
        "blue",
        "green",
        "pink",
        "gray",
        "teal",
        "gold",
        "navy",
    }


def test_one_file_with_a_task_column(tmp_path):
    rows = [{"prompt": f"{task}: {w}", "completion": w, "task": task} for task in ("a", "b") for w in "pqrstuvwxyz"]
    seq = instruction_sequence_from_files(source=write_jsonl(tmp_path / "all.jsonl", rows), task_column="task")
    assert [t.name for t in seq.tasks] == ["t0:a", "t1:b"] and seq.class_names == ["a", "b"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "p", "completion": ""}], "row 1: the completion (the answer) is empty"),
        ([{"prompt": "p", "completion": "c"}, {"prompt": " ", "completion": "c"}], "row 2: the prompt is empty"),
        ([{"question": "p", "answer": "c"}], "is in neither of TRL's formats"),
        (
            [{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}],
            "row 1: the conversation must end with the assistant's message",
        ),
        (
            [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
            "row 1: a conversational row needs a tokenizer with a chat template",
        ),
    ],
)
def test_bad_rows_are_named(tmp_path, rows, message):
    with pytest.raises(ValueError) as info:
        instruction_sequence_from_files([write_jsonl(tmp_path / "t.jsonl", rows)])
    assert message in str(info.value) and "t.jsonl" in str(info.value)


def test_the_engine_trains_and_scores_the_shipped_tasks():
    """The shipped JSONL tasks through ``run_sequence`` on the tiny Llama with the character tokenizer."""
    from peft_ext.continual import TrainConfig, get_continual_method, run_sequence
    from peft_ext.data.collate import AsciiTokenizer, CausalLMCollator
    from peft_ext.models import tiny_llama

    tokenizer = AsciiTokenizer()
    seq = instruction_sequence_from_files(SHIPPED, seed=0)
    from peft_ext.continual.generation import generation_scores

    method = get_continual_method("seq_lora")(lr=3e-2, adapter={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    config = TrainConfig(epochs=3, batch_size=8, device="cpu", progress=False)
    collate = CausalLMCollator(tokenizer, 64)
    result = run_sequence(seq, method, tiny_llama(vocab_size=tokenizer.vocab_size), collate, config)
    R = result.accuracy_matrix
    assert len(R) == 3 and all(R[i][j] is not None for i in range(3) for j in range(i + 1))
    assert all(0.0 <= R[i][j] <= 1.0 for i in range(3) for j in range(i + 1))
    # it learns each task: the answers' loss right after training a task is below the untrained model's (measured:
    # 0.28, 0.16 and 0.09 nats lower; the third task has 15 examples, two steps an epoch)
    untrained = tiny_llama(vocab_size=tokenizer.vocab_size)
    before = [generation_scores(untrained, task.test, collate, "cpu")["answer_loss"] for task in seq.tasks]
    drops = [before[i] - result.extras["answer_loss_matrix"][i][i] for i in range(3)]
    assert min(drops) > 0.04 and sum(drops) / 3 > 0.1, drops


# --- the job ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_causal_lm(tmp_path_factory):
    """A tiny random Llama with MiniLM's real (WordPiece) tokenizer, saved as a user's local model folder."""
    from transformers import AutoTokenizer

    from peft_ext.models import minilm_path, tiny_llama

    path = tmp_path_factory.mktemp("tiny-causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    tokenizer.eos_token = "[unused1]"  # a causal LM's tokenizer ends answers with its own eos
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_the_shipped_instruction_example_runs_on_a_local_causal_lm(tmp_path, tiny_causal_lm, capsys):
    from peft_ext_cli import main

    out = tmp_path / "out"
    sets = [f"model.backbone={tiny_causal_lm}", "model.dtype=float32", "model.separator=null", f"output.dir={out}"]
    sets += ["train.epochs=1", "model.max_new_tokens=6"]
    sets += [f"methods.{m}.adapter.target_modules=[q_proj, v_proj]" for m in ("seq_lora", "splitlora")]
    sets += [
        "methods.pclr.adapter.pool_size=8",
        "methods.pclr.adapter.ranks_schedule=[4]",
        "methods.pclr.adapter.top_k=4",
    ]
    argv = ["run", "instructions_jsonl", "--no-progress"]  # every shipped method: seq_lora, splitlora, pclr
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "3 tasks" in printed and "t0:t0:reverse" not in printed
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [r["method"] for r in rows] == ["seq_lora", "splitlora", "pclr"]
    row = rows[0]
    R = row["accuracy_matrix"]
    assert [t for t in json.loads((out / "results.json").read_text())["tasks"]] == [
        "t0:reverse",
        "t1:upper",
        "t2:first_letter",
    ]
    assert all(R[i][j] is not None for i in range(3) for j in range(i + 1))
    for name in ("rouge_l_matrix", "answer_loss_matrix"):  # beside exact match, the same shape
        matrix = row["extras"][name]
        assert all((matrix[i][j] is not None) == (j <= i) for i in range(3) for j in range(3)), name
    assert all(0 <= row["extras"]["rouge_l_matrix"][i][j] <= 1 for i in range(3) for j in range(i + 1))
    assert all(row["extras"]["answer_loss_matrix"][i][j] > 0 for i in range(3) for j in range(i + 1))


def test_instruction_configs_are_checked_before_any_work(tmp_path, tiny_causal_lm, capsys):
    from peft_ext_cli import main

    base = [
        "--set",
        f"model.backbone={tiny_causal_lm}",
        "--set",
        "model.dtype=float32",
        "--set",
        f"output.dir={tmp_path}/o",
    ]
    assert main(["check", "instructions_jsonl", *base]) == 2  # the shipped separator is not in this vocabulary
    assert "`model.separator` '<|im_start|>' is not a token of the tokenizer's vocabulary" in capsys.readouterr().err
    base += ["--set", "model.separator=null"]
    assert main(["check", "instructions_jsonl", *base, "--set", "model.kind=classifier"]) == 2
    assert "`data.dataset: instructions` and `model.kind: causal_lm` go together" in capsys.readouterr().err
    osf = "methods=[{name: osf, target_modules: [q_proj]}]"  # (InfLoRA-style and O-LoRA run generation sequences)
    assert main(["check", "instructions_jsonl", *base, "--set", osf]) == 2
    assert "`methods.osf` runs ['classification'] sequences, not the generation tasks" in capsys.readouterr().err
    assert main(["check", "instructions_jsonl", *base, "--set", "model.max_length=8"]) == 2
    err = capsys.readouterr().err
    assert "`model.max_length` 8: " in err and "of 72 examples need more tokens" in err and "never truncated" in err
    assert main(["check", "instructions_jsonl", *base]) == 0
    assert not (tmp_path / "o").exists()


def test_the_instruction_job_on_a_4bit_bfloat16_base(tmp_path, tiny_causal_lm, capsys):
    """``model.load_in_4bit`` with ``dtype: bfloat16``: an NF4 base, float32 adapters, trained and scored."""
    pytest.importorskip("bitsandbytes")
    from peft_ext_cli import main

    out = tmp_path / "out"
    sets = [f"model.backbone={tiny_causal_lm}", "model.dtype=bfloat16", "model.load_in_4bit=true"]
    sets += ["model.separator=null", f"output.dir={out}", "train.epochs=1"]
    sets += ["methods.seq_lora.adapter.target_modules=[q_proj, v_proj]"]
    argv = ["run", "instructions_jsonl", "--no-progress", "--only", "seq_lora"]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    # it says what it scores: exact match of generated answers, not a classifier's accuracy
    assert "(instruction tasks, scored by exact match of the generated answers)" in printed
    assert "| final score | score after learning |" in printed and "| final acc |" not in printed
    assert "held-out ppl / base" in printed  # what tuning cost the model on text no task trains on
    (row,) = json.loads((out / "results.json").read_text())["results"]
    assert all(row["accuracy_matrix"][i][j] is not None for i in range(3) for j in range(i + 1))
    # the shipped r = 16 on q_proj (32 -> 32) and v_proj (32 -> 16, two key-value heads) of both layers
    assert row["trainable_params"] == 2 * (16 * (32 + 32) + 16 * (32 + 16))
