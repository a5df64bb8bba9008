"""Continual instruction tuning on a tiny Llama: generated instruction tasks, the causal-LM collate, the answer-only
loss, exact-match accuracy matrices checked against an independent greedy decoder, the four methods that run
generation sequences (seq_lora, joint, splitlora, pclr), PCLR's prompt routing (KV cache == no cache), the Trainer
driver, bad input.

The tiny random model learns little in a few steps; these tests check the harness, not the numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peft_ext.continual import TrainConfig, get_continual_method, next_token_loss, prompt_query
from peft_ext.continual.engine import ContinualEngine, RunRecord, training_loss
from peft_ext.continual.generation import generate_answers
from peft_ext.continual.runner import LoopTrainer
from peft_ext.data.collate import AsciiTokenizer, CausalLMCollator, TextCollator
from peft_ext.data.instruct import INSTRUCTION_FAMILIES, instruction_task_sequence
from peft_ext.data.tasks import Example, Instruction, Task, TaskSequence
from peft_ext.integrations import run_continual_with_trainer
from peft_ext.models import tiny_llama
from peft_ext.tuners.pclr import default_query

from .single_thread import one_thread, single_thread  # noqa: F401  (fixture)
from .test_continual_trainer import targs

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models; see tests/single_thread.py

TOK = AsciiTokenizer()
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
METHODS = {
    "seq_lora": dict(lr=3e-2, adapter=dict(r=4, lora_alpha=8, target_modules=TARGETS)),
    "joint": dict(lr=3e-2, adapter=dict(r=4, lora_alpha=8, target_modules=TARGETS)),
    "splitlora": dict(lr=3e-2, adapter=dict(r=4, target_modules=TARGETS)),
    "pclr": dict(lr=3e-2, adapter=dict(target_modules=TARGETS, pool_size=16, ranks_schedule=[4], top_k=4, alpha=8.0)),
}


@pytest.fixture(scope="module")
def seq() -> TaskSequence:
    return instruction_task_sequence(("first", "length", "last"), train_per_task=24, test_per_task=8, seed=0)


@pytest.fixture(scope="module")
def collate() -> CausalLMCollator:
    return CausalLMCollator(TOK, max_length=48)


def _greedy(model: torch.nn.Module, prompt: str, budget: int) -> str:
    """Reference decoder: one prompt, no padding, no KV cache, argmax of the full sequence's last logits each step,
    stopping at eos; the printable characters before eos."""
    ids = [ord(c) for c in prompt] + [TOK.sep_token_id]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(budget):
            logits = model(input_ids=torch.tensor([ids + new])).logits
            token = int(logits[0, -1].argmax())
            if token == TOK.eos_token_id:
                break
            new.append(token)
    return "".join(chr(t) for t in new if 32 <= t < 127)


def _exact_match(model: torch.nn.Module, examples: list[Example]) -> float:
    budget = max(len(ex.inputs.answer) for ex in examples) + 1  # the harness's budget: longest answer + eos
    model.eval()
    hits = [_greedy(model, ex.inputs.prompt, budget) == ex.inputs.answer for ex in examples]
    return sum(hits) / len(examples)


class _CheckingTrainer(LoopTrainer):
    """Trains like the runner; after each phase re-scores every evaluated task with the reference decoder."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reference: dict[int, list[float]] = {}

    def phase_done(self, model, phase, record) -> None:
        tasks = self.ctx.sequence.tasks[: phase.row + 1]
        self.reference[phase.row] = [_exact_match(model, task.test) for task in tasks]


def _run(seq: TaskSequence, collate: CausalLMCollator, name: str):
    method = get_continual_method(name)(**METHODS[name])
    train = TrainConfig(epochs=6, batch_size=8, progress=False, device="cpu", seed=0)
    engine = ContinualEngine(seq, method, collate, train)
    model = engine.build(tiny_llama(vocab_size=TOK.vocab_size, hidden_size=32))
    record = RunRecord.empty(len(seq))
    trainer = _CheckingTrainer(engine)
    model = engine.run(model, trainer, record)
    return engine, model, record, trainer.reference


@pytest.fixture(scope="module")
def runs(seq, collate):
    with one_thread():  # module fixtures run outside the function-scoped single_thread fixture
        return {name: _run(seq, collate, name) for name in METHODS}


# --- data and collate ------------------------------------------------------------------------------------------------


def test_instruction_sequence_is_deterministic_and_its_splits_are_disjoint(seq):
    again = instruction_task_sequence(("first", "length", "last"), train_per_task=24, test_per_task=8, seed=0)
    assert again.tasks[1].test == seq.tasks[1].test and seq.kind == "generation"
    assert seq.class_names == ["first", "length", "last"]
    for label, task in enumerate(seq.tasks):
        prompts = [ex.inputs.prompt for ex in task.train + task.test]
        assert len(set(prompts)) == len(prompts)
        instruction, answer = INSTRUCTION_FAMILIES[seq.class_names[label]]
        for ex in task.test:
            word = ex.inputs.prompt.removeprefix(instruction + ": ")
            assert ex.label == label and ex.inputs.answer == answer(word)
    assert seq.evaluated_on("test").kind == "generation"


def test_collate_labels_only_the_answer_and_pads_correctly(seq, collate):
    examples = [Example(Instruction("ab", "xyz"), 0), Example(Instruction("abcd", "q"), 0)]
    batch = collate(examples)
    # right-padded training rows: prompt, separator, answer, eos, padding
    assert batch["input_ids"].tolist() == [[97, 98, 3, 120, 121, 122, 2], [97, 98, 99, 100, 3, 113, 2]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 120, 121, 122, 2], [-100] * 5 + [113, 2]]
    short = collate([examples[1], Example(Instruction("a", "b"), 0)])
    assert short["attention_mask"].tolist() == [[1] * 7, [1, 1, 1, 1, 0, 0, 0]]
    assert short["labels"][1].tolist() == [-100, -100, 98, 2, -100, -100, -100]
    # left-padded prompts: every row ends with the separator, where its answer starts
    prompts = collate.prompts(examples)
    assert prompts["input_ids"].tolist() == [[0, 0, 97, 98, 3], [97, 98, 99, 100, 3]]
    assert prompts["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1] * 5]
    assert collate.answer_budget(examples) == 4
    assert collate.decode([120, 121, 2, 122]) == "xy"


@torch.no_grad()
def test_loss_is_next_token_cross_entropy_on_answer_tokens_only(seq, collate):
    model = tiny_llama(vocab_size=TOK.vocab_size, hidden_size=32)
    examples = seq.tasks[0].train[:3] + seq.tasks[1].train[:3]
    batch = collate(examples)
    assert batch["attention_mask"].min() == 0  # the batch has padding
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = float(next_token_loss(logits, batch["labels"]))
    # reference: each example alone, unpadded; -log p of every answer token and of the eos after it
    nll = []
    for ex in examples:
        prompt = [ord(c) for c in ex.inputs.prompt] + [TOK.sep_token_id]
        answer = [ord(c) for c in ex.inputs.answer] + [TOK.eos_token_id]
        logp = F.log_softmax(model(input_ids=torch.tensor([prompt + answer])).logits[0].double(), -1)
        nll += [-logp[len(prompt) - 1 + i, token] for i, token in enumerate(answer)]
    assert loss == pytest.approx(float(torch.stack(nll).mean()), rel=1e-5)
    # labelling the prompt and the padding as well would change the loss
    leaky = batch["labels"].where(batch["labels"] != -100, batch["input_ids"])
    assert abs(float(next_token_loss(logits, leaky)) - loss) > 1e-3
    # the engine's training loss dispatches a 2-D-label batch to the same loss
    method = get_continual_method("seq_lora")(**METHODS["seq_lora"])
    ctx = ContinualEngine(seq, method, collate, TrainConfig(progress=False)).ctx
    assert float(training_loss(model, method, batch, 0, None, ctx)[0]) == pytest.approx(loss, rel=1e-6)


# --- the four methods end to end -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(METHODS))
def test_accuracy_matrix_is_exact_match_of_greedy_generation(runs, seq, name):
    engine, model, record, reference = runs[name]
    R = record.accuracy_matrix
    T = len(seq)
    assert len(R) == T and all(len(row) == T for row in R)
    rows = [T - 1] if name == "joint" else list(range(T))
    assert sorted(reference) == rows
    for i in range(T):
        if i not in rows:  # joint trains once: a single, final row
            assert R[i] == [None] * T
            continue
        assert R[i][i + 1 :] == [None] * (T - 1 - i)
        assert R[i][: i + 1] == pytest.approx(reference[i])
        assert all(
            x * len(seq.tasks[j].test) == round(x * len(seq.tasks[j].test)) for j, x in enumerate(R[i][: i + 1])
        )
    assert len(record.task_losses) == len(rows)
    result = engine.result(model, record)
    assert result.metrics["final_acc"] == pytest.approx(sum(R[T - 1]) / T)
    if name == "joint":
        assert result.metrics["forgetting"] is None


def test_every_method_learns_each_task_it_trains(runs, seq, collate):
    """The answers' per-token loss on each task right after training it is at least 0.2 nats below the untrained
    model's (measured: 0.33 to 0.51 lower; the untrained model is near ln(128) = 4.85, uniform over the characters).
    A method whose update stopped reaching the model would fail here; exact match is too coarse at this size."""
    from peft_ext.continual.generation import generation_scores

    untrained = tiny_llama(vocab_size=TOK.vocab_size, hidden_size=32)
    before = [generation_scores(untrained, task.test, collate, "cpu")["answer_loss"] for task in seq.tasks]
    for name, (_, _, record, _) in runs.items():
        losses, T = record.scores["answer_loss"], len(seq)
        cells = [(T - 1, j) for j in range(T)] if name == "joint" else [(i, i) for i in range(T)]  # joint: one row
        for i, j in cells:
            assert losses[i][j] < before[j] - 0.2, (name, i, j, losses[i][j], before[j])
    # and the matrices compared above are not all zero, so the comparison checks real generations
    assert max(x for _, _, record, _ in runs.values() for row in record.accuracy_matrix for x in row if x) > 0


def test_pclr_generation_routes_by_the_prompt_with_and_without_cache(runs, seq, collate):
    _, model, _, _ = runs["pclr"]
    model.eval()
    examples = [ex for task in seq.tasks for ex in task.test]
    prompts = collate.prompts(examples)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=TOK.eos_token_id)
    with torch.no_grad():
        cached = model.generate(**prompts, use_cache=True, **options)
        uncached = model.generate(**prompts, use_cache=False, **options)
    assert torch.equal(cached, uncached)
    assert generate_answers(model, examples, collate, torch.device("cpu"), use_cache=False) == generate_answers(
        model, examples, collate, torch.device("cpu")
    )
    # the training batch (prompt + answer, right-padded) and the generation prompt (left-padded) route alike ...
    state = model.base_model.routing_state
    assert state.query_fn.__qualname__ == prompt_query(3).__qualname__
    train = collate(examples)
    inputs = {k: train[k] for k in ("input_ids", "attention_mask")}
    backbone = model.base_model.model
    torch.testing.assert_close(state.query_fn(backbone, (), inputs), state.query_fn(backbone, (), prompts))
    # ... which the default query (mean over every token) would not
    assert not torch.allclose(default_query(backbone, (), inputs), default_query(backbone, (), prompts), atol=1e-3)


def test_pclr_kept_prototypes_and_pool(runs, seq):
    engine, model, _, _ = runs["pclr"]
    assert model.base_model.finished_tasks() == len(seq)
    assert len(engine.method.report(engine.ctx)["pool_ranks"]) == len(seq)


def test_the_trainer_driver_runs_a_generation_sequence(seq, collate, tmp_path):
    two = TaskSequence("two", seq.class_names[:2], seq.tasks[:2], kind="generation")
    method = get_continual_method("seq_lora")(**METHODS["seq_lora"])
    args = targs(tmp_path, save_strategy="no", num_train_epochs=3)
    result, model = run_continual_with_trainer(two, method, tiny_llama(vocab_size=TOK.vocab_size), collate, args)
    R = result.accuracy_matrix
    assert R[0][1] is None and all(loss > 0 for loss in result.task_losses)
    assert R[1] == pytest.approx([_exact_match(model, task.test) for task in two.tasks])


# --- bad input -------------------------------------------------------------------------------------------------------


def test_bad_input_is_refused_before_training(seq, collate):
    with pytest.raises(ValueError, match="empty `answer`"):
        Instruction("reverse: abc", "")
    with pytest.raises(ValueError, match="supports \\['classification'\\].*methods that run generation"):
        ContinualEngine(seq, get_continual_method("osf")(), collate, TrainConfig(device="cpu"))
    with pytest.raises(TypeError, match="CausalLMCollator"):
        ContinualEngine(seq, get_continual_method("seq_lora")(), TextCollator(object()), TrainConfig(device="cpu"))
    with pytest.raises(TypeError, match="Instruction"):
        TaskSequence("bad", ["a"], [Task("t", [0], [Example("text", 0)], [])], kind="generation")
    with pytest.raises(ValueError, match="`kind`"):
        TaskSequence("bad", ["a"], [Task("t", [0], [Example("text", 0)], [])], kind="chat")
    with pytest.raises(ValueError, match="max_length"):
        CausalLMCollator(TOK, max_length=8)([Example(Instruction("reverse: abcdef", "fedcba"), 0)])
    with pytest.raises(ValueError, match="printable ASCII"):
        collate([Example(Instruction("caf\u00e9", "x"), 0)])
    with pytest.raises(ValueError, match="`separator_id`"):
        CausalLMCollator(TOK, separator_id=TOK.eos_token_id)
    with pytest.raises(ValueError, match="families"):
        instruction_task_sequence(("reverse", "nope"))


def test_the_docs_cpu_example_runs_as_written():
    """docs/continual_instruct.md's "On a CPU, as written" example, exactly as printed there."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "continual_instruct.md").read_text()
    section = text[text.index("## On a CPU, as written") : text.index("## A real run")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "continual_instruct.md", "exec"), scope)
    result = scope["result"]
    assert len(result.accuracy_matrix) == 3 and set(result.metrics) >= {"final_acc", "forgetting"}


def test_rouge_l_against_a_full_lcs_table():
    import random

    from peft_ext.continual.generation import rouge_l

    def reference(a: str, b: str) -> float:
        x, y = a.split(), b.split()
        if not x or not y:
            return float(x == y)
        table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
        for i in range(1, len(x) + 1):
            for j in range(1, len(y) + 1):
                table[i][j] = (
                    table[i - 1][j - 1] + 1 if x[i - 1] == y[j - 1] else max(table[i - 1][j], table[i][j - 1])
                )
        lcs = table[-1][-1]
        return 0.0 if lcs == 0 else 2 * lcs / (len(x) + len(y))  # F1 of P = lcs/|x|, R = lcs/|y|

    assert rouge_l("the cat sat", "the cat sat") == 1.0 and rouge_l("a b", "c d") == 0.0 and rouge_l("", "") == 1.0
    assert rouge_l("the cat", "the cat sat on") == pytest.approx(2 * (1.0 * 0.5) / 1.5)
    rng = random.Random(0)
    for _ in range(200):
        a = " ".join(rng.choice("abcde") for _ in range(rng.randint(0, 8)))
        b = " ".join(rng.choice("abcde") for _ in range(rng.randint(0, 8)))
        assert rouge_l(a, b) == pytest.approx(reference(a, b))


def test_generation_scores_and_the_answers_per_token_loss(seq, collate):
    """``generation_scores``: exact match as ``evaluate_generation``, ROUGE-L of the same answers, and the answers'
    loss as the token-weighted mean of each example's own next-token loss."""
    from peft_ext.continual.generation import evaluate_generation, generation_scores, next_token_loss, rouge_l

    model = tiny_llama(vocab_size=TOK.vocab_size, hidden_size=32).eval()
    test = seq.tasks[0].test
    scores = generation_scores(model, test, collate, torch.device("cpu"), batch_size=3)
    assert scores["exact_match"] == evaluate_generation(model, test, collate, torch.device("cpu"), batch_size=5)
    answers = generate_answers(model, test, collate, torch.device("cpu"))
    assert scores["rouge_l"] == pytest.approx(
        sum(rouge_l(a, e.inputs.answer) for a, e in zip(answers, test)) / len(test)
    )
    total = tokens = 0.0
    with torch.no_grad():
        for example in test:
            batch = collate([example])
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += float(next_token_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])) * n
            tokens += n
    assert scores["answer_loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_a_set_max_new_tokens_is_the_generation_budget(seq):
    fixed = CausalLMCollator(TOK, max_length=48, max_new_tokens=3)
    examples = seq.tasks[0].test[:4]
    assert fixed.answer_budget(examples) == 3
    assert (
        CausalLMCollator(TOK, max_length=48).answer_budget(examples) == max(len(e.inputs.answer) for e in examples) + 1
    )
    model = tiny_llama(vocab_size=TOK.vocab_size, hidden_size=32).eval()
    answers = generate_answers(model, examples, fixed, torch.device("cpu"))
    assert all(len(a) <= 3 for a in answers)
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be a positive integer or None, got 0"):
        CausalLMCollator(TOK, max_length=48, max_new_tokens=0)
