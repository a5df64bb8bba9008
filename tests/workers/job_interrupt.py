"""Worker of tests/test_job_distributed.py: ``peft-ext run`` whose rank 0 is interrupted (``KeyboardInterrupt``) right
after it wrote the snapshot of method LABEL's task COMPLETED - 1, as a crash mid-method would leave the output dir.

Run as ``torchrun --standalone --nproc_per_node=2 tests/workers/job_interrupt.py LABEL COMPLETED run CONFIG ...``;
torchrun then ends the other process.
"""

from __future__ import annotations

import sys

from peft_ext.continual.progress import TaskProgress
from peft_ext_cli import main

label, completed = sys.argv[1], int(sys.argv[2])
original = TaskProgress.save


def save(self, model, method_state, record):
    original(self, model, method_state, record)
    if self.identity["label"] == label and record.completed == completed:
        raise KeyboardInterrupt


TaskProgress.save = save
sys.exit(main(sys.argv[3:]))
