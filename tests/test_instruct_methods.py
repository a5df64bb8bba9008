"""Instruction sequences on a chat LM: the chat rendering of prompts, PCLR's prompt query with a template that
writes the separator more than once, a task's own metric (ROUGE-L), the held-out perplexity, and the methods that
instruction sequences add (replay, zero_shot, O-LoRA and InfLoRA-style on generation), through the drivers users run.

Mechanics run on a tiny random Llama that reads SmolLM2's real tokenizer and chat template; one test trains the real
SmolLM2-135M-Instruct and fails if a method stops learning.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from peft_ext.continual import TrainConfig, get_continual_method, prompt_query, run_sequence
from peft_ext.continual.generation import rouge_l, text_perplexity
from peft_ext.continual.methods.replay import memory_shares
from peft_ext.data.collate import CausalLMCollator, assistant_turn_token
from peft_ext.data.tasks import Example, Instruction, Task, TaskSequence
from peft_ext.models import tiny_llama
from peft_ext.tuners.pclr import default_query

from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from peft_ext.models import smollm2_gguf, smollm2_path

    try:
        smollm2_gguf()
    except ImportError as err:
        pytest.skip(str(err))
    return AutoTokenizer.from_pretrained(smollm2_path())


@pytest.fixture(scope="module")
def collate(tokenizer) -> CausalLMCollator:
    return CausalLMCollator(tokenizer, max_length=64, chat_template=True, system_prompt="Answer briefly.")


def _words(prefix: str, n: int, label: int, answer=lambda w: w.upper()) -> list[Example]:
    return [Example(Instruction(f"{prefix} {w}", answer(w)), label) for w in (f"w{i}x" for i in range(n))]


@pytest.fixture(scope="module")
def sequence() -> TaskSequence:
    tasks = []
    for t, (prefix, metric) in enumerate((("shout", "exact_match"), ("echo", "rouge_l"), ("repeat", "exact_match"))):
        examples = _words(prefix, 20, t, (lambda w: w) if prefix == "echo" else (lambda w: w.upper()))
        tasks.append(Task(f"t{t}:{prefix}", [t], examples[:12], examples[12:16], examples[16:], metric=metric))
    return TaskSequence("chat-toy", ["shout", "echo", "repeat"], tasks, kind="generation",
                        held_out_text=["the cat sat on the mat", "a quiet evening by the sea"])  # fmt: skip


def _tiny(tokenizer) -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_llama(vocab_size=len(tokenizer))


def _train() -> TrainConfig:
    return TrainConfig(epochs=1, batch_size=6, eval_batch_size=8, device="cpu", progress=False, seed=0)


# --- the chat rendering -------------------------------------------------------------------------------------------


def test_chat_rendering_is_the_template_and_the_answer_its_reply(tokenizer, collate):
    sep = assistant_turn_token(tokenizer)
    assert tokenizer.convert_ids_to_tokens([sep]) == ["<|im_start|>"] and collate.separator_id == sep
    example = Example(Instruction("Name a colour.", "blue"), 0)
    batch = collate([example])
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "blue"}], tokenize=False)  # fmt: skip
    # the training row is the whole conversation up to the reply's end of turn (<|im_end|>, the eos)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert batch["input_ids"][0].tolist() == expected[: len(batch["input_ids"][0])]
    answer = [t for t in batch["labels"][0].tolist() if t != -100]
    assert tokenizer.decode(answer) == "blue<|im_end|>"
    prompt = collate.prompts([example])["input_ids"][0].tolist()
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert collate.length(example) == len(batch["input_ids"][0])
    # the template writes the separator three times (system, user, assistant): the prompt's ends at the last
    assert prompt.count(sep) == 3


def test_chat_rendering_refuses_what_it_cannot_route(tokenizer, collate):
    with pytest.raises(ValueError, match="answer .* contains the separator"):
        collate([Example(Instruction("say it", "<|im_start|>"), 0)])
    with pytest.raises(ValueError, match="`system_prompt` is a message of the chat template"):
        CausalLMCollator(tokenizer, system_prompt="x")
    from peft_ext.data.collate import AsciiTokenizer

    with pytest.raises(ValueError, match="no chat template"):
        CausalLMCollator(AsciiTokenizer(), chat_template=True)


def test_prompt_query_reads_up_to_the_last_separator(tokenizer, collate):
    model = _tiny(tokenizer)
    examples = [
        Example(Instruction("Name a colour.", "blue"), 0),
        Example(Instruction("Count to three please.", "1 2 3"), 0),
    ]
    train = collate(examples)
    query = prompt_query(collate.separator_id)(model, (), {"input_ids": train["input_ids"],
                                                           "attention_mask": train["attention_mask"]})  # fmt: skip
    for row, example in enumerate(examples):
        ids = collate.render(example.inputs.prompt)
        end = len(ids) - ids[::-1].index(collate.separator_id)  # "assistant\n" after it is the same in every prompt
        prompt = torch.tensor([ids[:end]])
        alone = default_query(model, (), {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)})
        torch.testing.assert_close(query[row], alone[0])
    # generation's left-padded prefill gives the same query as the training row
    gen = collate.prompts(examples)
    prefill = prompt_query(collate.separator_id)(model, (), dict(gen))
    torch.testing.assert_close(prefill, query)


# --- scores -------------------------------------------------------------------------------------------------------


def test_a_task_is_scored_by_its_own_metric(tokenizer, collate, sequence):
    result = run_sequence(sequence, get_continual_method("zero_shot")(), _tiny(tokenizer), collate, _train())
    R, rouge = result.accuracy_matrix, result.extras["rouge_l_matrix"]
    assert R[2][1] == rouge[2][1]  # the echo task (rouge_l) reports its ROUGE-L in the accuracy matrix
    assert R[2][0] != rouge[2][0] or R[2][0] == 0.0  # the others their exact match (ROUGE-L >= exact match)
    assert rouge_l("a b c", "a c") == pytest.approx(0.8)


def test_zero_shot_scores_each_task_once_and_the_rows_agree(tokenizer, collate, sequence, monkeypatch):
    from peft_ext.continual import task_kinds

    calls = []
    real = task_kinds.generation_scores
    monkeypatch.setattr(task_kinds, "generation_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    result = run_sequence(sequence, get_continual_method("zero_shot")(), _tiny(tokenizer), collate, _train())
    assert len(calls) == 3  # not 6: rows 1 and 2 reuse the earlier tasks' scores
    R = result.accuracy_matrix
    assert R[1][0] == R[0][0] and R[2][:2] == R[1][:2]
    assert result.extras["held_out_perplexity"]["ratio"] == 1.0


def test_held_out_perplexity_is_the_mean_next_token_loss(tokenizer, collate):
    model = _tiny(tokenizer).eval()
    texts = ["the cat sat on the mat", "a quiet evening by the sea today"]
    total, count = 0.0, 0
    for text in texts:  # one text at a time, no padding
        ids = torch.tensor([collate.encode(text) + [collate.eos_token_id]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    got = text_perplexity(model, texts, collate, torch.device("cpu"), batch_size=2)
    assert got == pytest.approx(math.exp(total / count), rel=1e-5)


# --- replay -------------------------------------------------------------------------------------------------------


def test_replay_memory_is_bounded_balanced_and_saved(tokenizer, collate, sequence):
    assert memory_shares(5, 2) == [3, 2] and memory_shares(4, 4) == [1, 1, 1, 1] and memory_shares(3, 0) == []
    method = get_continual_method("replay")(lr=1e-2, memory_size=5, adapter=dict(r=4, target_modules=TARGETS))
    seen: list[list[Example]] = []
    real = method.training_examples
    method.training_examples = lambda t, task, ctx: seen.append(real(t, task, ctx)) or seen[-1]
    result = run_sequence(sequence, method, _tiny(tokenizer), collate, _train())
    assert [len(s) for s in seen] == [12, 12 + 5, 12 + 5]  # the memory, full from the second task on
    second, third = seen[1][12:], seen[2][12:]
    assert {ex.label for ex in second} == {0}
    assert [sum(ex.label == t for ex in third) for t in (0, 1)] == [3, 2]  # shared between the finished tasks
    assert set(third) - set(sequence.tasks[0].train) - set(sequence.tasks[1].train) == set()
    assert set(ex for ex in third if ex.label == 0) <= set(second)  # a shrunk share keeps a prefix
    assert result.extras["memory_per_task"] == [2, 2, 1]
    # the memory travels with the method's state (weights_only), and a restored method remembers the same examples
    import io

    buffer = io.BytesIO()
    torch.save(method.state_dict(), buffer)
    buffer.seek(0)
    restored = get_continual_method("replay")(lr=1e-2, memory_size=5, adapter=dict(r=4, target_modules=TARGETS))
    restored.load_state_dict(torch.load(buffer, weights_only=True))

    class Ctx:
        pass

    ctx = Ctx()
    ctx.sequence = sequence
    assert restored.remembered(ctx) == method.remembered(ctx)
    with pytest.raises(ValueError, match="`memory_size` must be a positive integer"):
        get_continual_method("replay")(memory_size=0)
    with pytest.raises(ValueError, match="supports \\['generation'\\]"):
        from peft_ext.continual.engine import ContinualEngine
        from peft_ext.data.instruct import instruction_task_sequence  # noqa: F401

        classification = TaskSequence("c", ["a"], [Task("t", [0], [Example("x", 0)], [Example("y", 0)])])
        ContinualEngine(classification, get_continual_method("replay")(), collate, _train())


@pytest.mark.parametrize("name", ["olora", "inflora", "replay", "splitlora", "pclr", "seq_lora"])
def test_generation_methods_train_on_a_chat_sequence(tokenizer, collate, sequence, name):
    options = {
        "olora": dict(lr=1e-2, adapter=dict(r=4, target_modules=TARGETS)),
        "inflora": dict(lr=1e-2, r=4, target_modules=TARGETS),
        "replay": dict(lr=1e-2, memory_size=4, adapter=dict(r=4, target_modules=TARGETS)),
        "splitlora": dict(lr=1e-2, adapter=dict(r=4, target_modules=TARGETS)),
        "pclr": dict(lr=1e-2, adapter=dict(pool_size=12, ranks_schedule=[4], top_k=4, target_modules=TARGETS)),
        "seq_lora": dict(lr=1e-2, adapter=dict(r=4, target_modules=TARGETS)),
    }[name]
    base = _tiny(tokenizer)
    before = copy.deepcopy(base.state_dict())
    result = run_sequence(sequence, get_continual_method(name)(**options), base, collate, _train())
    assert all(base.state_dict()[k].equal(v) for k, v in before.items())  # the base is copied, never changed
    R = result.accuracy_matrix
    assert all(R[i][j] is not None for i in range(3) for j in range(i + 1))
    loss = result.extras["answer_loss_matrix"]
    assert all(loss[i][j] > 0 for i in range(3) for j in range(i + 1))
    ppl = result.extras["held_out_perplexity"]
    assert ppl["final"] != ppl["base"] and ppl["ratio"] == pytest.approx(ppl["final"] / ppl["base"])
    assert all(x is not None and math.isfinite(x) for x in result.task_losses)
