import math

import pytest

from peft_ext.continual.metrics import (
    average_incremental_accuracy,
    backward_transfer,
    final_average_accuracy,
    forgetting,
    summarize,
)

NAN = float("nan")
# Hand-worked 3-task matrix. Rows: after task i; columns: task j.
R = [
    [0.9, NAN, NAN],
    [0.6, 0.8, NAN],
    [0.5, 0.7, 0.9],
]


def test_final_average_accuracy():
    assert final_average_accuracy(R) == pytest.approx((0.5 + 0.7 + 0.9) / 3)


def test_average_incremental_accuracy():
    # A_0 = 0.9, A_1 = (0.6 + 0.8) / 2 = 0.7, A_2 = 0.7  ->  (0.9 + 0.7 + 0.7) / 3
    assert average_incremental_accuracy(R) == pytest.approx(2.3 / 3)


def test_backward_transfer():
    # ((0.5 - 0.9) + (0.7 - 0.8)) / 2 = -0.25
    assert backward_transfer(R) == pytest.approx(-0.25)


def test_forgetting_uses_the_best_earlier_accuracy_not_the_diagonal():
    # Task 0 improves after task 1 (0.5 -> 0.8), then drops to 0.6: forgetting counts 0.8 - 0.6, BWT counts +0.1.
    M = [
        [0.5, NAN, NAN],
        [0.8, 0.9, NAN],
        [0.6, 0.9, 1.0],
    ]
    assert forgetting(M) == pytest.approx(((0.8 - 0.6) + (0.9 - 0.9)) / 2)
    assert backward_transfer(M) == pytest.approx(((0.6 - 0.5) + (0.9 - 0.9)) / 2)


def test_single_task_has_no_forgetting():
    assert summarize([[0.7]]) == {
        "final_acc": 0.7,
        "learning_acc": 0.7,
        "avg_incremental_acc": 0.7,
        "bwt": 0.0,
        "forgetting": 0.0,
    }


def test_positive_transfer_gives_negative_forgetting_only_when_it_never_peaked_earlier():
    M = [[0.5, NAN], [0.7, 0.9]]
    assert backward_transfer(M) == pytest.approx(0.2)
    assert forgetting(M) == pytest.approx(-0.2)


def test_bad_matrices_are_rejected_with_the_offending_entry():
    with pytest.raises(ValueError, match="square"):
        final_average_accuracy([[0.1, 0.2]])
    with pytest.raises(ValueError, match=r"R\[1\]\[0\]"):
        forgetting([[0.5, NAN], [NAN, 0.4]])
    with pytest.raises(ValueError, match="empty"):
        backward_transfer([])
    assert math.isnan(R[0][1])  # entries above the diagonal are allowed to be undefined


def test_learning_accuracy_is_the_mean_of_the_diagonal():
    from peft_ext.continual.metrics import learning_accuracy

    R = [[0.9, float("nan")], [0.3, 0.6]]
    assert learning_accuracy(R) == pytest.approx(0.75) and summarize(R)["learning_acc"] == pytest.approx(0.75)


def test_the_table_shows_learning_accuracy_and_the_gap_to_joint():
    from peft_ext.continual.engine import MethodResult
    from peft_ext.continual.report import metrics_table

    def result(method: str, R: list, **metrics: float) -> MethodResult:
        return MethodResult(method, method, R, metrics, 10, 100, 1.0, 0.5, [1.0])

    seq = result("seq_lora", [[0.9, None], [0.2, 0.8]], final_acc=0.5, learning_acc=0.85)
    joint = result("joint", [[None, None], [0.7, 0.9]], final_acc=0.8, learning_acc=None)
    table = metrics_table([seq, joint], timings=False)
    head = "| method | final acc | acc after learning | avg incr acc | BWT | forgetting | gap to joint |"
    assert table.splitlines()[0] == head + " trainable params |"
    assert "| seq_lora | 50.0 | 85.0 | — | — | — | 30.0 | 10 |" in table
    assert "| joint | 80.0 | — | — | — | — | — | 10 |" in table
    assert "gap to joint" not in metrics_table([seq], timings=False)  # no joint run: no column


def test_the_timing_columns_split_the_heads_from_training_and_the_time_line_adds_up():
    from peft_ext.continual.engine import MethodResult
    from peft_ext.continual.report import metrics_table, time_line

    a = MethodResult("seq_lora", "seq_lora", [[0.9]], {"final_acc": 0.9}, 10, 100, 10.0, 3.0, [1.0], head_seconds=2.5)
    b = MethodResult("ncm", "ncm", [[0.5]], {"final_acc": 0.5}, 0, 100, 1.0, 1.0, [None], head_seconds=1.0)
    table = metrics_table([a, b])
    assert table.splitlines()[0].endswith("| trainable params | train s | heads s | eval s |")
    assert "| 10 | 7.5 | 2.5 | 3.0 |" in table  # training without the heads' 2.5 s
    assert "| 0 | 0.0 | 1.0 | 1.0 |" in table
    line = time_line([a, b], {"model and data": 4.0, "saving adapters": 2.0}, wall=30.0)
    assert "where the 30 s went: training 8 s, heads 4 s, evaluation 4 s" in line
    assert "model and data 4 s, saving adapters 2 s; the rest 9 s" in line  # 30 - 7.5 - 3.5 - 4 - 6
