"""Worker of ``tests/test_heads.py``: the training-free baseline with every feature head under 2 processes (gloo).

Run as ``torchrun --standalone --nproc_per_node=2 tests/workers/heads.py OUT_DIR``. Each process reads its share of
every task's training data; the heads' sums are all-reduced, so the heads' states and scores equal one process's.
Each rank saves its result and its heads' states as ``rank{R}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers import stack_collate, tiny_classifier, token_sequence


def run_heads() -> dict:
    """ncm's run (the prototype head) with lda, analytic and aligned compared, on 3 tasks of 2 classes; an odd
    number of training examples per task, so the two processes' shares differ by one."""
    from peft_ext.continual import ContinualEngine, RunRecord, TrainConfig, get_continual_method
    from peft_ext.continual.runner import LoopTrainer

    seq = token_sequence(n_tasks=3, classes_per_task=2, per_class=15)
    for task in seq.tasks:
        task.train.pop()  # 29 examples per task
    method = get_continual_method("ncm")(compare_heads=["lda", "analytic", "aligned"])
    engine = ContinualEngine(seq, method, stack_collate, TrainConfig(progress=False, device="cpu", eval_batch_size=8))
    model = engine.build(tiny_classifier(seq.num_classes))
    record = RunRecord.empty(len(seq))
    model = engine.run(model, LoopTrainer(engine), record)
    return {"result": engine.result(model, record).to_dict(), "heads": engine.state_dict()["heads"]}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    try:
        torch.save(run_heads(), out / f"rank{dist.get_rank()}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
