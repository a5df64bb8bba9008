"""Runs the continual driver and SIGKILLs its own process at a given step of a given task (test_continual_trainer).

Usage: python -m tests.workers.continual_kill OUTPUT_DIR METHOD TASK STEP
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback


class SigKill(TrainerCallback):
    def __init__(self, task: int, step: int) -> None:
        self.task, self.step = task, step

    def on_step_end(self, args, state, control, **kwargs):
        if Path(args.output_dir).name == f"task-{self.task}" and state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    torch.set_num_threads(1)
    from ..test_continual_trainer import run, token_sequence

    out, name, task, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    run(token_sequence(n_tasks=3), name, Path(out), callbacks=[SigKill(task, step)])
