"""benchmarks/continual_instruct.py: the smoke run end to end on the real SmolLM2's first 2 decoder layers (2 tasks, 8
examples, 1 order), finished runs kept and reused; and the claims its results file makes, whose verb follows the
paired interval."""

from __future__ import annotations

import json

import pytest

from peft_ext.continual.published import published_claim

from .helpers import run_module

METHODS = "zero_shot,seq_lora,replay,splitlora,pclr,joint"


@pytest.mark.slow  # 6 methods on 2 of SmolLM2's 30 decoder layers: about a minute of CPU
def test_quick_run_prints_the_table_and_every_target_verdict(tmp_path):
    out = tmp_path / "quick"
    stdout = run_module("benchmarks.continual_instruct", "--quick", "--methods", METHODS, "--out", out).stdout
    assert (
        "| method | orders | final average | learned | forgetting | BWT | held-out ppl / base | supersense "
        "| gloss_to_word |" in stdout
    )
    verdicts = [line for line in stdout.splitlines() if line.startswith("- ")]
    assert len(verdicts) == 4, verdicts  # PCLR's forgetting, SplitLoRA and PCLR over replay, the moonshot
    assert all(line.endswith(("-> met", "-> NOT met")) for line in verdicts)
    assert "NOT met" in verdicts[0]  # one order: an interval cannot clear anything
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["layers"] == 2
    assert results["kind"] == "continual_instruct" and results["settings"]["families"] == [
        "supersense",
        "gloss_to_word",
    ]
    assert results["machine"]["commit"]
    assert sorted(r["method"] for r in results["runs"]) == sorted(METHODS.split(","))
    for run in results["runs"]:
        assert run["extras"]["held_out_perplexity"]["base"] > 1
    # a second call reuses every finished run: nothing trains again
    again = run_module("benchmarks.continual_instruct", "--quick", "--methods", METHODS, "--out", out).stdout
    assert "order 0" not in again and "| seq_lora | 1 |" in again


def _payload(pclr: list[float], seq: list[float], forgetting: list[float]) -> dict:
    runs = []
    for order, (a, b, f) in enumerate(zip(pclr, seq, forgetting)):
        for method, final, forget in (("pclr", a, f), ("seq_lora", b, 0.3)):
            extras = {"held_out_perplexity": {"ratio": 1.02 if method == "pclr" else 1.1}}
            runs.append({"method": method, "order": order, "metrics": {"final_acc": final, "forgetting": forget},
                         "extras": extras})  # fmt: skip
    settings = {"model": "smollm2-135m", "families": ["a", "b", "c"]}
    return {"kind": "continual_instruct", "command": "python -m benchmarks.continual_instruct", "settings": settings,
            "runs": runs}  # fmt: skip


def test_the_table_separates_what_a_method_learned_from_what_it_forgot():
    """'learned' is the mean of each task's score right after its training (learning_acc), beside the final average
    and forgetting: a method that forgets nothing but learns little shows it."""
    from peft_ext.continual.published_instruct import instruct_table

    def run(order, learned, final):
        metrics = {"final_acc": final, "learning_acc": learned, "forgetting": 0.0, "bwt": 0.0}
        return {"method": "m", "order": order, "metrics": metrics, "tasks": ["t0:a"], "accuracy_matrix": [[final]],
                "extras": {"held_out_perplexity": {"ratio": 1.0}}}  # fmt: skip

    payload = {"command": "cmd", "settings": {"model": "x", "families": ["a"], "train_per_task": 4,
               "test_per_task": 2}, "runs": [run(0, 0.30, 0.20), run(1, 0.40, 0.22)]}  # fmt: skip
    table = instruct_table(payload)
    assert "| method | orders | final average | learned | forgetting |" in table
    assert "| m | 2 | 21.0 ± 1.4 | 35.0 ± 7.1 | 0.0 ± 0.0 |" in table


def test_instruction_claims_follow_their_intervals(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_payload([0.5, 0.6, 0.55], [0.4, 0.45, 0.42], [0.1, 0.12, 0.11])))
    claim = published_claim(path, "final:pclr:seq_lora")
    assert claim.startswith("beats seq_lora on final average (+12.7 points [")
    assert claim.endswith("smollm2-135m, 3 instruction tasks, 3 task orders)")
    assert published_claim(path, "forgetting:pclr").startswith("forgets 11.0 points against sequential LoRA's 30.0")
    assert published_claim(path, "held_out:pclr").startswith("leaves held-out perplexity at 1.020x the base model's")
    assert published_claim(path, "command") == "`python -m benchmarks.continual_instruct`"
    path.write_text(json.dumps(_payload([0.5, 0.3, 0.55], [0.4, 0.45, 0.42], [0.1, 0.12, 0.11])))
    assert published_claim(path, "final:pclr:seq_lora").startswith("ties seq_lora")
    with pytest.raises(ValueError, match="no runs of 'olora'"):
        published_claim(path, "final:olora:seq_lora")
    with pytest.raises(ValueError, match="unknown instruction claim"):
        published_claim(path, "winners")
    path.write_text(json.dumps({"kind": "something"}))
    with pytest.raises(ValueError, match="makes no claims"):
        published_claim(path, "command")


def test_one_order_gives_a_difference_and_no_verb(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_payload([0.5], [0.4], [0.1])))
    assert published_claim(path, "final:pclr:seq_lora") == (
        "is +10.0 points from seq_lora on final average (smollm2-135m, 3 instruction tasks, one task order: no "
        "interval)"
    )
    assert "beats" not in published_claim(path, "forgetting:pclr")
