"""What a continual head costs: time per task against the task's training at MiniLM scale, memory per class at
width 4096.

Time: the first WordNet task of ``configs/quickstart.yaml`` (4 supersenses x 40 glosses, real MiniLM-L6), trained as
the config trains ``seq_lora`` (3 epochs, batch 32, LoRA r 8 on query / value); then the heads' one pass over the
task's training data (shared by all heads) and each head's solve, timed separately. Training and the heads' work
take turns ``--repeats`` times in one run; the table gives medians. Target: a head at most 5 % of the task's training.

Memory: each head fed random features of width 4096 for ``C`` = 4 and 8 classes; the bytes of its saved state
(``state_dict``) per class are the difference over the 4 extra classes, and what does not grow with the classes
(the Gram matrices, the projection) is the rest.

Usage::

    python -m benchmarks.head_cost                  # about 2 minutes on 2 cores
    python -m benchmarks.head_cost --repeats 1      # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib import machine
from benchmarks._lib.tables import markdown_table

HEADS = ["prototype", "lda", "analytic", "aligned"]
MEMORY_HEADS: dict[str, Any] = {
    "prototype": "prototype",
    "lda": "lda",
    "analytic (dim 2048)": "analytic",
    "aligned (auto: rank 64 at 4096)": "aligned",
    "aligned (diagonal)": {"name": "aligned", "covariance": "diagonal"},
    "aligned (full)": {"name": "aligned", "covariance": "full"},
}


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def memory(width: int = 4096) -> list[list[Any]]:
    """Bytes per class and fixed bytes of each head's state at feature width ``width``."""
    from torch import nn

    from peft_ext.continual.heads import HEADS as REGISTRY
    from peft_ext.continual.heads import build_head
    from peft_ext.continual.heads.base import head_options
    from peft_ext.data.tasks import Task

    class Ctx:  # a run without a validation split
        sequence = type("S", (), {"tasks": []})()

    rows = []
    for label, spec in MEMORY_HEADS.items():
        sizes = {}
        for classes in (4, 8):
            head = build_head(spec, classes, seed=0)
            gen = torch.Generator().manual_seed(0)
            for t in range(2):
                ids = list(range(t * classes // 2, (t + 1) * classes // 2))
                head.begin_task(t, Task(f"t{t}", ids, [], []), width)
                y = torch.tensor(ids).repeat_interleave(8)
                head.accumulate(torch.randn(len(y), width, generator=gen, dtype=torch.float64), y)
                head.end_task(nn.Identity(), t, Ctx())
            sizes[classes] = state_bytes(head.state_dict())
        per_class = (sizes[8] - sizes[4]) / 4
        name, options = head_options(spec)
        stated = REGISTRY[name].bytes_per_class(options, width)
        rows.append(
            [
                label,
                f"{per_class / 2**10:,.1f}",
                f"{stated / 2**10:,.1f}",
                f"{(sizes[4] - 4 * per_class) / 2**20:,.1f}",
            ]
        )
    return rows


def timing(repeats: int, epochs: int = 3) -> list[dict[str, float]]:
    """Per repeat: the task's training seconds (``epochs`` of them), the heads' pass, and each head's solve."""
    from peft_ext.continual import ContinualEngine, TrainConfig, get_continual_method
    from peft_ext.continual.heads.base import feature_batches
    from peft_ext.continual.runner import train_examples
    from peft_ext.data import SHIPPED
    from peft_ext.data.collate import TextCollator
    from peft_ext.models import load_text_classifier

    seq = SHIPPED["wordnet"].task_sequence(
        n_tasks=5,
        classes_per_task=4,
        classes=None,
        seed=0,
        train_per_class=40,
        test_per_class=40,
        protocol="class-incremental",
        val_per_class=0,
    )
    base, tokenizer = load_text_classifier("minilm", seq.num_classes, 0.1, seed=0)
    collate = TextCollator(tokenizer, 32)
    train = TrainConfig(epochs=epochs, batch_size=32, progress=False, device="cpu")
    method = get_continual_method("seq_lora")(
        lr=1e-3, adapter={"r": 8, "lora_alpha": 16.0, "target_modules": ["query", "value"]}, compare_heads=HEADS
    )
    engine = ContinualEngine(seq, method, collate, train)
    task = seq.tasks[0]
    out = []
    for _ in range(repeats):
        model = engine.build(base)
        start = time.perf_counter()
        train_examples(model, method, task.train, task.classes, 0, engine.ctx)
        row = {"train": time.perf_counter() - start}
        heads = list(engine.compared.values())
        start = time.perf_counter()
        for head in heads:
            head.begin_task(0, task, 384)
        for features, labels in feature_batches(model, task.train, engine.ctx):
            for head in heads:
                head.accumulate(features.double(), labels)
        row["pass"] = time.perf_counter() - start
        for head in heads:
            start = time.perf_counter()
            head.end_task(model, 0, engine.ctx)
            row[head.name] = time.perf_counter() - start
        out.append(row)
        engine = ContinualEngine(seq, method, collate, train)  # fresh heads
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench_head_cost.json")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: one repeat of one epoch, memory at width 1024",
    )
    args = parser.parse_args(argv)
    epochs, width = (1, 1024) if args.quick else (3, 4096)
    rows = timing(1 if args.quick else args.repeats, epochs)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    table = [
        [
            head,
            f"{med['pass']:.2f}",
            f"{med[head]:.2f}",
            f"{100 * (med['pass'] + med[head]) / med['train']:.1f} %",
            "met" if med["pass"] + med[head] <= 0.05 * med["train"] else "NOT met",
        ]
        for head in HEADS
    ]
    print(
        f"Task 0 of quickstart (160 glosses), seq_lora {epochs} epochs: {med['train']:.1f} s training (median of "
        f"{len(rows)}; {machine.torch_platform()})\n"
    )
    print(markdown_table(["head", "pass s (shared)", "solve s", "head / training", "<= 5 %"], table))
    shares = ", ".join(f"{row[0]} {row[3]}" for row in table)
    verdict = "met" if all(row[4] == "met" for row in table) else "NOT met"
    print(f"\n- target: every head <= 5 % of the task's training (pass + solve): {shares}: {verdict}")
    mem = memory(width)
    print(f"\nMemory at width {width} (saved state):\n")
    print(markdown_table(["head", "KiB per class (measured)", "KiB per class (bytes_per_class)", "fixed MiB"], mem))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"timing": rows, "median": med, "memory": mem}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
