"""Published numbers come from files that runs write: every generated table in the README and docs/ equals the
table its results file gives, and ``peft-ext table`` prints and rewrites them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peft_ext.continual.published import (
    CLAIM_CLOSE,
    CLAIM_OPEN,
    GENERATED_CLOSE,
    GENERATED_OPEN,
    generated_blocks,
    generated_claims,
    heads_claim,
    published_claim,
    published_table,
)
from peft_ext_cli import main

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_publishes_the_make_run_table_from_its_results_file():
    sources = [source for source, _ in generated_blocks((ROOT / "README.md").read_text())]
    assert "docs/results/quickstart.json" in sources


@pytest.mark.parametrize("markdown", MARKDOWN, ids=lambda p: p.name)
def test_every_generated_table_equals_its_results_file(markdown):
    for source, body in generated_blocks(markdown.read_text()):
        assert body == published_table(markdown.parent / source), (
            f"{markdown.name}'s table from {source} was edited by hand or its results changed: run "
            f"`peft-ext table --into {markdown.relative_to(ROOT)}`"
        )


@pytest.mark.parametrize("markdown", MARKDOWN, ids=lambda p: p.name)
def test_every_generated_claim_equals_its_results_file(markdown):
    for source, key, body in generated_claims(markdown.read_text()):
        assert body == published_claim(markdown.parent / source, key), (
            f"{markdown.name}'s claim {key} from {source} was edited by hand or its results changed: run "
            f"`peft-ext table --into {markdown.relative_to(ROOT)}`"
        )


def _summary(**vs: tuple[float, float, float]) -> dict:
    methods = {
        label: {
            "best_head": "analytic",
            "best_every_task_head": "lda",
            "vs_ncm": list(v),
            "vs_ncm_every_task": list(v),
        }
        for label, v in vs.items()
    }
    methods["pclr"] |= {"best_head": "first_task+lda"}
    methods["ncm"] = {"best_head": "prototype"}
    return {"kind": "continual_heads", "config": "quickstart", "draws": [0, 1, 2], "methods": methods}


def test_a_claim_says_beats_only_when_the_interval_clears():
    summary = _summary(splitlora=(4.3, 2.6, 6.0), inflora=(-0.4, -3.0, 2.2), pclr=(-3.0, -5.0, -1.0))
    said = heads_claim(summary, "vs_simplecil:splitlora")
    assert said == "beats SimpleCIL on WordNet (+4.3 points [+2.6, +6.0], analytic head, 3 class draws)"
    assert heads_claim(summary, "vs_simplecil:inflora").startswith(
        "ties SimpleCIL on WordNet (-0.4 points [-3.0, +2.2]"
    )
    pclr = heads_claim(summary, "vs_simplecil:pclr")
    assert pclr.startswith("trails SimpleCIL") and "trained on the first task only, lda head" in pclr
    assert "lda head" in heads_claim(summary, "vs_simplecil_every_task:splitlora")
    summary["methods"]["inflora"]["best_head"] = "cosine+lda"  # trained with SEQ*'s cosine head, scored by lda
    assert "(-0.4 points [-3.0, +2.2], trained with the cosine head, lda head, 3 class draws)" in heads_claim(
        summary, "vs_simplecil:inflora"
    )
    winners = heads_claim(summary, "winners")  # a summary without a best training-free baseline: SimpleCIL
    assert winners == (
        "on WordNet these beat SimpleCIL, the strongest training-free baseline: splitlora (analytic head, +4.3 points "
        "[+2.6, +6.0]) (3 class draws)"
    )
    # against the strongest baseline of the draws when the summary names one (slda here): only who clears it
    summary["best_training_free"] = "slda"
    summary["methods"]["splitlora"]["vs_best_free"] = [2.0, 0.5, 3.5]
    summary["methods"]["inflora"]["vs_best_free"] = [4.0, -0.1, 8.1]
    assert heads_claim(summary, "winners") == (
        "on WordNet these beat streaming LDA (slda), the strongest training-free baseline: splitlora (analytic head, "
        "+2.0 points [+0.5, +3.5]) (3 class draws)"
    )
    assert heads_claim(summary, "vs_best_free:inflora").startswith(
        "ties streaming LDA (slda), the strongest training-free baseline on WordNet (+4.0 points [-0.1, +8.1]"
    )
    del summary["best_training_free"]
    summary["config"] = "fortunes"
    summary["methods"]["splitlora"]["vs_ncm"] = [1.0, -0.5, 2.5]
    assert heads_claim(summary, "winners").startswith("on fortunes no adapter method here beats SimpleCIL")
    with pytest.raises(ValueError, match=r"'joint' is not compared with SimpleCIL here; one of \['splitlora'"):
        heads_claim(summary, "vs_simplecil:joint")
    with pytest.raises(ValueError, match=r"unknown claim 'best:splitlora'"):
        heads_claim(summary, "best:splitlora")


def test_table_rewrites_claims_inside_sentences_and_refuses_a_bad_one_leaving_the_page(tmp_path, capsys):
    summary = _summary(splitlora=(4.3, 2.6, 6.0), inflora=(-0.4, -3.0, 2.2), pclr=(-3.0, -5.0, -1.0))
    (tmp_path / "heads.json").write_text(json.dumps(summary))
    claim = CLAIM_OPEN.format(source="heads.json", key="vs_simplecil:splitlora") + "beats it by 9" + CLAIM_CLOSE
    page = tmp_path / "page.md"
    page.write_text(f"| row | SplitLoRA {claim}; more |\n")
    assert main(["table", "--into", str(page)]) == 0
    assert page.read_text() == (
        "| row | SplitLoRA "
        + CLAIM_OPEN.format(source="heads.json", key="vs_simplecil:splitlora")
        + published_claim(tmp_path / "heads.json", "vs_simplecil:splitlora")
        + CLAIM_CLOSE
        + "; more |\n"
    )
    before = page.read_text()
    page.write_text(before + CLAIM_OPEN.format(source="heads.json", key="vs_simplecil:nope") + "x" + CLAIM_CLOSE)
    before = page.read_text()
    assert main(["table", "--into", str(page)]) == 2
    assert "'nope' is not compared with SimpleCIL" in capsys.readouterr().err
    assert page.read_text() == before


def _results(path: Path, final: float) -> Path:
    row = {
        "method": "seq_lora",
        "label": "seq_lora",
        "accuracy_matrix": [[0.9, None], [0.5, 0.8]],
        "metrics": {"final_acc": final, "avg_incremental_acc": 0.8, "bwt": -0.4, "forgetting": 0.4},
        "trainable_params": 1234,
        "total_params": 99999,
        "train_seconds": 10.0,
        "eval_seconds": 2.0,
        "task_losses": [0.5, 0.6],
        "extras": {},
    }
    meta = {"name": "x", "torch": "2.13.0", "threads": 2, "machine": "x86_64", "wall_seconds": 13.0}
    path.write_text(json.dumps({"meta": meta, "tasks": ["a", "b"], "results": [row]}))
    return path


def test_table_prints_and_rewrites_only_the_generated_block(tmp_path, capsys):
    results = _results(tmp_path / "r.json", 0.65)
    assert main(["table", str(results)]) == 0
    printed = capsys.readouterr().out
    # "acc after learning" (85.0) comes from the matrix's diagonal: results saved before the metric existed
    assert "| seq_lora | 65.0 | 85.0 | 80.0 | -40.0 | 40.0 | 1,234 |" in printed
    assert "10 s training + 2 s evaluation in all, 13 s for the job" in printed  # no heads time recorded
    # the job's own phases, where the results file has them; the heads' time comes out of training
    data = json.loads(results.read_text())
    data["results"][0]["head_seconds"] = 3.0
    data["meta"]["phase_seconds"] = {"model and data": 1.0, "saving adapters": 0.4}
    results.write_text(json.dumps(data))
    assert main(["table", str(results)]) == 0
    printed = capsys.readouterr().out
    assert (
        "7 s training + 3 s heads + 2 s evaluation in all, model and data 1.0 s, saving adapters 0.4 s, 13 s"
        in printed
    )

    page = tmp_path / "page.md"
    stale = GENERATED_OPEN.format(source="r.json") + "\n| old |\n" + GENERATED_CLOSE
    page.write_text(f"# Title\n\nbefore\n\n{stale}\n\nafter\n")
    assert main(["table", "--into", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "| old |" not in text and published_table(results) in text

    _results(results, 0.7)  # a new run: the page follows
    assert main(["table", "--into", str(page)]) == 0
    assert "| seq_lora | 70.0 |" in page.read_text()


def test_table_refuses_a_file_that_is_not_results_and_leaves_the_page(tmp_path, capsys):
    (tmp_path / "bad.json").write_text('{"meta": {}}')
    page = tmp_path / "page.md"
    before = GENERATED_OPEN.format(source="bad.json") + "\n| kept |\n" + GENERATED_CLOSE + "\n"
    page.write_text(before)
    assert main(["table", "--into", str(page)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "is not a results.json of a continual job" in err
    assert page.read_text() == before
    assert main(["table", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def _numbers(value) -> list[float]:
    """Every number in a parsed JSON value, and each times 100 (results files keep some shares as fractions)."""
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, (int, float)):
        return [float(value), 100.0 * value]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def test_the_heads_page_says_only_figures_of_its_results_files():
    """docs/continual_heads.md's prose under "What the tables say": every decimal it writes is, to the digits shown,
    a figure of the heads protocol summaries it discusses (a re-run that moves one fails here until the sentence
    follows); the tables above it are generated."""
    import re

    page = (ROOT / "docs" / "continual_heads.md").read_text()
    prose = page[page.index("## What the tables say") :].split("\n## ")[0]
    figures = [
        n
        for path in sorted((ROOT / "docs" / "results").glob("heads_*.json"))
        for n in _numbers(json.loads(path.read_text()))
    ]
    shown = re.findall(r"(?<![\w.])[-+]?\d+\.\d+", prose)
    assert len(shown) >= 10
    for number in shown:
        digits = len(number.partition(".")[2])
        value = abs(float(number))
        assert any(round(abs(f), digits) == value for f in figures), (
            f"{number} is no figure of docs/results/heads_*.json"
        )


def test_the_noise_line_says_what_one_run_can_tell_apart():
    from peft_ext.continual.engine import MethodResult
    from peft_ext.continual.report import noise_line

    def result(final):
        return MethodResult("m", "m", [[final]], {"final_acc": final}, 1, 1, 0.0, 0.0, [0.1], {})

    line = noise_line([result(0.55), result(0.65)], [160] * 5)
    # p = 0.6, 800 examples: 1.96 * sqrt(2 * 0.24 / 800) = 4.8 points
    assert line.startswith("Test examples: 160 per task, 800 in all (one example is 0.6 points of its task).")
    assert "by up to about ±4.8 points (binomial 95 %): smaller differences are ties" in line
    assert "40-48 per task" in noise_line([result(0.5)], [40, 48])
    assert noise_line([], [10]) == "" and noise_line([result(0.5)], []) == ""


def test_a_claim_about_one_head_row_pairs_its_draws_with_simplecils():
    summary = {
        "kind": "continual_heads",
        "config": "fortunes",
        "draws": [0, 1, 2],
        "methods": {
            "splitlora": {"heads": {"analytic": {"values": [0.62, 0.60, 0.65]}}},
            "ncm": {"heads": {"prototype": {"values": [0.60, 0.61, 0.62]}}},
        },
    }
    # differences +2, -1, +3 points: mean 1.33, sd 2.08, t(2) = 4.303: half-width 5.17
    said = heads_claim(summary, "vs_simplecil_head:splitlora:analytic")
    assert said == "ties SimpleCIL on fortunes (+1.3 points [-3.8, +6.5], analytic head, 3 class draws)"
    with pytest.raises(ValueError, match=r"no row 'lda' of 'splitlora' beside SimpleCIL here; rows: \['analytic'\]"):
        heads_claim(summary, "vs_simplecil_head:splitlora:lda")


def _paired_result(label, hits_per_task, method=None):
    from peft_ext.continual.engine import MethodResult

    final = sum(t.count("1") / len(t) for t in hits_per_task) / len(hits_per_task)
    extras = {"final_correct": hits_per_task}
    return MethodResult(method or label, label, [[final]], {"final_acc": final}, 1, 1, 0.0, 0.0, [0.1], extras)


def test_the_leader_is_named_only_when_the_paired_interval_clears():
    from peft_ext.continual.report import leader_line, paired_final

    tasks = 2
    best = _paired_result("best", ["1" * 90 + "0" * 10] * tasks)
    # 2 points behind on 200 examples, wrong on other examples than best: a tie
    close = _paired_result("close", ["0" * 12 + "1" * 88] * tasks)
    far = _paired_result("far", ["1" * 50 + "0" * 50] * tasks)
    joint = _paired_result("joint", ["1" * 100] * tasks)  # the upper bound is never the leader
    d, lo, hi = paired_final(best, close)
    assert d == pytest.approx(2.0) and lo < 0 < hi
    d, lo, hi = paired_final(best, far)
    assert d == pytest.approx(40.0) and lo > 30
    line = leader_line([far, joint, close, best])
    assert line.startswith(
        "Who won (final accuracy, paired over the same 200 test examples, 95 % intervals; joint, the upper bound, "
        "left out): best 90.0 % leads, but this run cannot tell it from close (+2.0 points ["
    )
    assert line.endswith("]): ties; it is ahead of the other 1.")
    clear = leader_line([far, best])
    # 40 of each task's 100 examples differ, all in best's favour: 40 points, sd 3.5 (by hand)
    assert clear.endswith("best 90.0 %, ahead of every other method (the closest, far: +40.0 points [+33.2, +46.8]).")
    # a run without per-example outcomes (results from before they were recorded) is left out, never guessed
    old = _paired_result("old", ["1" * 100] * tasks)
    old.extras.clear()
    assert leader_line([old, best]) == ""
    assert paired_final(best, _paired_result("short", ["1"] * tasks)) is None  # other test sets: no pairing


def test_a_run_records_which_final_test_examples_it_got_right():
    """``extras.final_correct`` of a real run reproduces its final row: each task's share of "1" is its accuracy."""
    from peft_ext.continual import TrainConfig, get_continual_method, run_sequence

    from .helpers import lora_adapter, stack_collate, tiny_classifier, token_sequence

    sequence = token_sequence()
    method = get_continual_method("seq_lora")(lr=5e-3, adapter=lora_adapter(4), head="prototype")
    train = TrainConfig(epochs=1, batch_size=8, progress=False, device="cpu")
    result = run_sequence(sequence, method, tiny_classifier(sequence.num_classes), stack_collate, train)
    hits = result.extras["final_correct"]
    assert [len(t) for t in hits] == [len(t.test) for t in sequence.tasks]
    assert [t.count("1") / len(t) for t in hits] == pytest.approx(result.accuracy_matrix[-1])


def test_the_per_example_outcomes_follow_the_examples_order_not_the_length_sorted_one():
    """Evaluation scores examples shortest first; the recorded outcomes map back to the order of the test set, so two
    methods are paired example by example."""
    from peft_ext.continual.evaluation import evaluate_heads
    from peft_ext.data.tasks import Example

    class Parity(torch.nn.Module):
        def forward(self, input_ids):  # predicts class 0 for an even length, 1 for an odd one
            odd = (input_ids[:, 0] % 2).float()
            return torch.stack([1 - odd, odd], dim=1)

    lengths = [7, 2, 9, 4, 4, 1, 12, 3]
    examples = [Example("x" * n, 0) for n in lengths]

    def collate(batch):
        return {
            "input_ids": torch.tensor([[len(e.inputs)] for e in batch]),
            "labels": torch.tensor([e.label for e in batch]),
        }

    hits: list[bool] = []
    accuracy = evaluate_heads(Parity(), examples, [0, 1], 2, collate, torch.device("cpu"), {"": None}, 3, hits=hits)
    assert hits == [n % 2 == 0 for n in lengths]
    assert accuracy[""] == pytest.approx(sum(hits) / len(hits))


def test_protocol_columns_come_from_the_summary_grouped_by_what_each_head_does():
    """No hand-kept list of heads: every plain head a summary scored is a column (a head another package registers
    too), the model's own output layer first, the training-shaping cosine head next, then the feature readers."""
    from peft_ext.continual.published import protocol_columns

    methods = {
        "a": {"heads": {"analytic": {}, "cosine": {}, "first_task+lda": {}, "linear": {}, "my_head": {}}},
        "b": {"heads": {"prototype": {}, "cosine+lda": {}, "lda": {}}},
    }
    assert protocol_columns(methods) == ["linear", "cosine", "analytic", "prototype", "lda", "my_head"]
