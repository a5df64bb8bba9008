"""Golden runs (:mod:`tests.golden`): a miniature of every shipped job must reproduce the committed results.

Tolerances: the mean training loss of every task to a relative 2e-5, and each accuracy to one test example. On one
thread against two, the losses of these runs differ by at most 3e-8 relative (reductions split differently), so
another CPU's or thread count's rounding stays far inside; a changed mechanism does not (without its penalty,
O-LoRA's task-1 loss drops from 1.04 to 0.72). When a change of results is intended: ``make golden``, and a line in
CHANGELOG.md saying why.
"""

from __future__ import annotations

import json

import pytest

from .golden import GOLDEN, SHRINK, run_all

LOSS_RTOL = 2e-5


def _differences(golden: dict, runs: dict) -> list[str]:
    problems = []
    for case, methods in golden.items():
        data = SHRINK[case]["data"]
        one_example = 1 / (data["classes_per_task"] * data["test_per_class"])
        got = runs.get(case, {})
        if sorted(got) != sorted(methods):
            problems.append(f"{case}: methods {sorted(got)} != golden {sorted(methods)}")
            continue
        for label, want in methods.items():
            have = got[label]
            losses = zip(have["task_losses"], want["task_losses"])
            if len(have["task_losses"]) != len(want["task_losses"]) or any(
                (h is None) != (w is None) or (w is not None and abs(h - w) > LOSS_RTOL * abs(w)) for h, w in losses
            ):
                problems.append(f"{case}/{label}: task losses {have['task_losses']} != golden {want['task_losses']}")
            matrices = {"": (have["accuracy_matrix"], want["accuracy_matrix"])}
            if sorted(have.get("heads", {})) != sorted(want.get("heads", {})):
                problems.append(f"{case}/{label}: compared heads {sorted(have.get('heads', {}))} != golden")
            else:
                matrices.update({f" ({name})": (have["heads"][name], m) for name, m in want.get("heads", {}).items()})
            for head, (matrix_h, matrix_w) in matrices.items():
                for i, (row_h, row_w) in enumerate(zip(matrix_h, matrix_w)):
                    for j, (h, w) in enumerate(zip(row_h, row_w)):
                        if (h is None) != (w is None) or (h is not None and abs(h - w) > one_example + 1e-9):
                            problems.append(f"{case}/{label}{head}: R[{i}][{j}] = {h} != golden {w}")
    return problems


@pytest.mark.slow
def test_every_shipped_job_in_miniature_reproduces_the_golden_runs(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == sorted(SHRINK), "a case was added or removed: run `make golden`"
    problems = _differences(golden, run_all(tmp_path))
    assert not problems, "results changed (if intended: `make golden` and a CHANGELOG line):\n" + "\n".join(problems)


#: The fast form (``make test-fast``): the quickstart miniature's methods that cover each mechanism the others share
#: (PEFT's LoRA, a tuner of this package with a statistics pass and the analytic head, PCLR's pool and its cycle, a
#: training-free baseline with the compared heads); the slow test above runs every case and method.
FAST = ["seq_lora", "splitlora", "pclr", "ncm"]


def test_four_methods_of_the_quickstart_miniature_reproduce_their_golden_runs(tmp_path, request):
    from .golden import run_case, save_tiny_bert

    full = test_every_shipped_job_in_miniature_reproduces_the_golden_runs.__name__
    if any(item.name == full for item in request.session.items):
        pytest.skip(f"{full} runs in this session and checks these four methods with every other one")

    golden = json.loads(GOLDEN.read_text())
    backbone = save_tiny_bert(tmp_path / "tiny-bert", num_layers=2, seed=0)
    runs = {"quickstart": run_case("quickstart", tmp_path, backbone, only=FAST)}
    want = {"quickstart": {label: golden["quickstart"][label] for label in FAST}}
    problems = _differences(want, runs)
    assert not problems, "results changed (if intended: `make golden` and a CHANGELOG line):\n" + "\n".join(problems)


def test_the_comparison_catches_a_moved_loss_and_a_moved_accuracy():
    golden = {"quickstart": {"m": {"task_losses": [1.0, 2.0], "accuracy_matrix": [[0.5, None], [0.25, 0.75]]}}}
    same = json.loads(json.dumps(golden))
    same["quickstart"]["m"]["task_losses"][1] *= 1 + 0.5 * LOSS_RTOL
    assert _differences(golden, same) == []
    moved = json.loads(json.dumps(golden))
    moved["quickstart"]["m"]["task_losses"][1] *= 1 + 2 * LOSS_RTOL
    moved["quickstart"]["m"]["accuracy_matrix"][1][0] = 0.5
    problems = _differences(golden, moved)
    assert len(problems) == 2 and "task losses" in problems[0] and "R[1][0]" in problems[1]


@pytest.mark.parametrize("case", sorted(SHRINK))
def test_every_method_of_the_shipped_config_is_in_the_golden_file(case):
    import yaml

    from .golden import ROOT

    shipped = yaml.safe_load((ROOT / "configs" / f"{case}.yaml").read_text())["methods"]
    labels = sorted(m.get("label") or m["name"] for m in shipped)
    assert sorted(json.loads(GOLDEN.read_text())[case]) == labels


def test_the_comparison_covers_untrained_tasks_and_compared_heads():
    golden = {
        "quickstart": {
            "m": {
                "task_losses": [1.0, None],
                "accuracy_matrix": [[0.5, None], [0.25, 0.75]],
                "heads": {"prototype": [[0.5, None], [0.5, 0.5]]},
            }
        }
    }
    assert _differences(golden, json.loads(json.dumps(golden))) == []
    moved = json.loads(json.dumps(golden))
    moved["quickstart"]["m"]["task_losses"][1] = 0.5  # a task that was not trained now is
    moved["quickstart"]["m"]["heads"]["prototype"][1][1] = 1.0
    problems = _differences(golden, moved)
    assert len(problems) == 2 and "task losses" in problems[0] and "(prototype): R[1][1]" in problems[1]
    dropped = json.loads(json.dumps(golden))
    del dropped["quickstart"]["m"]["heads"]
    assert "compared heads" in _differences(golden, dropped)[0]
