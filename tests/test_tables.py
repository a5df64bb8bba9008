"""Published numbers come from files that runs write: every generated table in the README and docs/ equals the
table its results file gives, and ``peft-ext table`` prints and rewrites them."""

from __future__ import annotations

import json
import re
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


def _summary(config: str = "quickstart") -> dict:
    """A heads protocol summary with per-draw values: SplitLoRA's highest row (``lda``) is not the head
    configs/quickstart.yaml gives it (``analytic``), and slda, not SimpleCIL, is the strongest training-free
    baseline."""

    def cell(*values):
        return {"values": list(values), "mean": 100 * sum(values) / len(values), "half_width": 1.0}

    methods = {
        "seq_lora": {"heads": {"linear": cell(0.30, 0.32, 0.31), "first_task+lda": cell(0.66, 0.65, 0.67)}},
        "inflora": {"heads": {"analytic": cell(0.55, 0.56, 0.57), "first_task+analytic": cell(0.64, 0.62, 0.65)}},
        "splitlora": {
            "heads": {
                "analytic": cell(0.66, 0.67, 0.69),
                "lda": cell(0.70, 0.71, 0.72),
                "first_task+analytic": cell(0.62, 0.64, 0.63),
                "cosine+lda": cell(0.60, 0.70, 0.65),
            }
        },
        "joint": {"heads": {"linear": cell(0.70, 0.70, 0.71), "lda": cell(0.72, 0.73, 0.74)}},
        "ncm": {"heads": {"prototype": cell(0.60, 0.61, 0.62)}},
        "slda": {"heads": {"lda": cell(0.62, 0.63, 0.64)}},
        "ranpac": {"heads": {"analytic": cell(0.61, 0.60, 0.62)}},
    }
    return {"kind": "continual_heads", "config": config, "draws": [0, 1, 2], "methods": methods, "command": "cmd"}


def test_a_claim_compares_the_head_the_config_gives_not_the_highest_row():
    """configs/quickstart.yaml gives SplitLoRA ``analytic``; its ``lda`` row is higher on these draws, and no claim
    picks it unless it says the pick is optimistic."""
    summary = _summary()
    said = heads_claim(summary, "vs_free:splitlora")
    # analytic - slda: +4, +4, +5 points; lda's +8 would be the test-draw pick
    assert said.startswith(
        "beats streaming LDA (slda), the strongest training-free baseline on WordNet, trained on every task with the "
        "analytic head its config gives it (+4.3 points ["
    )
    assert heads_claim(summary, "vs_simplecil:splitlora").startswith("beats SimpleCIL on WordNet, trained on every")
    first = heads_claim(summary, "vs_free_first_task:splitlora")  # 0, +1, -1: a tie
    assert first.startswith("ties streaming LDA (slda)") and "trained on the first task only, then scored by" in first
    assert heads_claim(summary, "vs_free:inflora").startswith("trails streaming LDA (slda)")
    best = heads_claim(summary, "best_variant:splitlora")
    assert best.startswith(
        "its best of 4 variants on these test draws, picked on the draws it is scored on (optimistic)"
    )
    assert "is trained on every task with the lda head" in best
    with pytest.raises(ValueError, match=r"no row 'first_task\+configured' of 'seq_lora'"):
        heads_claim(summary, "vs_free_first_task:seq_lora")  # its config gives it linear: no first-task run of that


def test_winners_are_against_the_strongest_free_baseline_and_say_how_each_method_trained():
    summary = _summary()
    assert heads_claim(summary, "winners") == (
        "on WordNet, of the 3 adapter methods trained on every task with the head its config gives each, 1 beats "
        "streaming LDA (slda), the strongest training-free baseline: splitlora (analytic, +4.3 points [+2.9, +5.8]) "
        "(3 class draws)"
    )
    first = heads_claim(summary, "winners_first_task")  # seq_lora's config head is linear: no first-task row
    assert first.startswith(
        "on WordNet, of the 2 adapter methods trained on the first task only, then scored by the head its config "
        "gives each, none beats streaming LDA (slda), the strongest training-free baseline (closest: inflora"
    )
    # the training-free baselines' order decides which one is named
    summary["methods"]["slda"]["heads"]["lda"]["values"] = [0.55, 0.55, 0.55]
    summary["methods"]["ranpac"]["heads"]["analytic"]["values"] = [0.55, 0.55, 0.55]
    assert "beats SimpleCIL, the strongest training-free baseline" in heads_claim(summary, "winners")
    verdicts = heads_claim(summary, "verdicts:simplecil:configured")
    assert "beat it: splitlora (analytic, +6.3 [" in verdicts and "trail it: seq_lora (linear, " in verdicts
    with pytest.raises(ValueError, match=r"unknown claim 'vs_simplecil_every_task:pclr'"):
        heads_claim(summary, "vs_simplecil_every_task:pclr")  # the old test-draw pick is no claim any more
    with pytest.raises(ValueError, match=r"no method 'nobody' here"):
        heads_claim(summary, "vs_free:nobody")


def test_a_summary_of_no_shipped_config_says_its_pick_is_optimistic():
    said = heads_claim(_summary("toy"), "vs_free:splitlora")  # no config gives a head: the highest row
    assert "(+8.0 points [" in said and "optimistic" in said


def test_the_configured_heads_are_read_from_the_shipped_configs():
    import yaml

    from peft_ext.continual.methods import method_capability
    from peft_ext.continual.published import configured_heads

    for name in ("quickstart", "fortunes"):
        raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())["methods"]
        expected = {}
        for entry in raw:
            head = entry.get("head")
            head = head.get("name") if isinstance(head, dict) else head
            expected[entry.get("label", entry["name"])] = head or method_capability(entry["name"], "default_head")
        assert configured_heads(name) == expected
    assert configured_heads("no_such_config") == {}


def test_the_first_task_tie_of_the_issue_is_what_the_config_head_gives():
    """InfLoRA-style after first-task adaptation with the head its config gives it (analytic) ties SimpleCIL on
    WordNet; the highest first-task row (lda) was what used to be quoted as "beats"."""
    said = published_claim(ROOT / "docs" / "results" / "heads_quickstart.json", "vs_simplecil_first_task:inflora")
    assert said.startswith("ties SimpleCIL on WordNet") and "(+3.0 points [-0.2, +6.3]" in said


def test_table_rewrites_claims_inside_sentences_and_refuses_a_bad_one_leaving_the_page(tmp_path, capsys):
    (tmp_path / "heads.json").write_text(json.dumps(_summary()))
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
    assert "no method 'nope' here" in capsys.readouterr().err
    assert page.read_text() == before


def test_a_results_file_claims_its_rows(tmp_path):
    results = _results(tmp_path / "r.json", 0.65)
    assert published_claim(results, "row:seq_lora") == "65.0 / 40.0 / 85.0 (linear head)"
    assert published_claim(results, "final:seq_lora") == "65.0"
    with pytest.raises(ValueError, match=r"keys row:METHOD and final:METHOD, methods \['seq_lora'\]"):
        published_claim(results, "row:pclr")


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


#: Words that rank or compare: in the heads page's prose only a generated claim says them, from an interval.
COMPARATIVES = (
    r"\b(the best|is best|highest|lowest|least|fastest|slowest|beats?|ties|trails?|ahead|behind|better|worse|wins?|"
    r"above|below|as good)\b"
)
#: A verdict and the paired intervals it speaks for, as the heads claims write them: one verb for one interval
#: ("beats X ... (+4.3 points [+2.6, +6.0]") or a group ("beat it: a (analytic, +3.4 [+1.0, +5.9]), b (...)").
_ONE = re.compile(r"^(beats|ties|trails) .*?\(([+-]\d+\.\d) points \[([+-]\d+\.\d), ([+-]\d+\.\d)\]")
_GROUP = re.compile(r"(beat it|tie|trail it|beats it for|ties it for|trails it for): (.*?)(?=; [a-z ]+(?: for)?: |$)")
_ITEM = re.compile(r"([+-]\d+\.\d) \[([+-]\d+\.\d), ([+-]\d+\.\d)\]")


def _verdicts_said(text: str) -> list[tuple[str, float, float]]:
    """``(verb, low, high)`` of every verdict a claim's text says."""
    said = []
    one = _ONE.match(text)
    if one:
        said.append((one[1], float(one[3]), float(one[4])))
    for verb, items in _GROUP.findall(text.split("): ", 1)[-1] if "): " in text else text):
        said += [(verb.split()[0], float(lo), float(hi)) for _, lo, hi in _ITEM.findall(items)]
    return said


def _agrees(verb: str, low: float, high: float) -> bool:
    if verb.startswith("beat"):
        return low > 0
    if verb.startswith("trail"):
        return high < 0
    return low <= 0 <= high


def test_the_heads_page_says_its_figures_and_verdicts_only_through_claims():
    """docs/continual_heads.md's "What the tables say": no figure and no ranking word typed by hand (each sits in a
    claim that a re-run rewrites, tests above), and every verdict word of every claim there agrees with the sign of
    the interval it names."""
    page = (ROOT / "docs" / "continual_heads.md").read_text()
    prose = page[page.index("## What the tables say") :].split("\n## ")[0]
    claims = generated_claims(prose)
    assert len(claims) >= 15 and all(source.startswith("results/heads_") for source, _, _ in claims)
    by_hand = re.sub(r"<!-- claim .*?<!-- /claim -->", "", prose, flags=re.S)
    assert not re.findall(r"\d+\.\d+|\d+ ?%|\[", by_hand), f"a figure typed by hand: {by_hand}"
    assert not re.findall(COMPARATIVES, by_hand, re.I), f"a ranking typed by hand: {by_hand}"
    checked = 0
    for _, _, body in claims:
        for verb, low, high in _verdicts_said(body):
            assert _agrees(verb, low, high), f"{verb!r} for [{low}, {high}] in: {body}"
            checked += 1
    assert checked >= 40


def test_the_verdict_check_catches_a_word_the_interval_does_not_back():
    assert _verdicts_said("ties X on WordNet, trained (+3.0 points [-0.2, +6.3], 5 class draws)") == [
        ("ties", -0.2, 6.3)
    ]
    said = _verdicts_said("against X (paired): beat it: a (analytic, +3.4 [+1.0, +5.9]); tie: b (+2.2 [-1.9, +6.2])")
    assert said == [("beat", 1.0, 5.9), ("tie", -1.9, 6.2)]
    assert not _agrees("beats", -0.2, 6.3) and not _agrees("ties", 0.5, 2.0) and _agrees("trails", -3.0, -1.0)


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
    assert said == (
        "ties SimpleCIL on fortunes, trained on every task with the analytic head (+1.3 points [-3.8, +6.5], 3 class "
        "draws)"
    )
    with pytest.raises(ValueError, match=r"no row 'lda' of 'splitlora' in this summary .*its rows: \['analytic'\]"):
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
        "Who won (final accuracy, paired over the same 200 test examples, 95 % intervals; joint, trained on all "
        "tasks at once, left out): best 90.0 % leads, but this run cannot tell it from close (+2.0 points ["
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
