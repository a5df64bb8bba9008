"""Riemannion against its peers on MiniLM-L6 + WordNet supersenses (all classes, one task), measured in one run.

Every method adapts the same modules (attention query and value of all 6 layers) at rank 16, trains the classification
head with the same AdamW (same head lr), sees the same batches in the same order for a given seed, and gets the same
step budget. Methods (continual-runner plugins, ``peft_ext/continual/methods_riemannion.py``):

- ``riemannion_loi``: Riemannion (Muon on the fixed-rank manifold) from the LOI point;
- ``riemannion_random``: Riemannion from a random point;
- ``lora_adamw``: PEFT LoRA + AdamW;
- ``lora_rprec``: PEFT LoRA + PEFT's ``create_riemannian_optimizer`` (scaled GD / RPrecAdamW);
- ``lora_ga``: PEFT LoRA with PEFT's LoRA-GA initialization + AdamW;
- ``lora_muon``: PEFT LoRA + ``torch.optim.Muon`` on the factors.

Prints one table: test accuracy (mean +- std over seeds), its gap to LoRA + AdamW, the median time of a training step
(forward, backward and optimizer step; all steps of all seeds) and its ratio to LoRA + AdamW, and the cost of the
gradient-informed initializations (LOI, LoRA-GA) as a percentage of the training time of the same run. Seeds change the
head initialization, the batch order and the random parts of the initializations; the data are fixed.

Usage (about 15 minutes on 2 CPU cores at the defaults; ``--quick`` is a 2-minute smoke run)::

    .venv/bin/python benchmarks/riemannion.py --json runs/bench/riemannion.json

``--sweep`` picks each method's learning rate: one seed, training on 80% of the training synsets and scoring on the
other 20% (never on the test split), over a 3-point grid per method. The constants in ``METHODS`` are its result.

Timings default to one thread (``--threads``): on a shared 2-core machine OpenMP threads that wait for a busy core
make two-thread timings vary several-fold between runs, while one-thread ratios are stable.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from peft_ext.continual import TrainConfig, get_continual_method, run_sequence
from peft_ext.data.collate import TextCollator
from peft_ext.data.tasks import Task, TaskSequence
from peft_ext.data.wordnet import class_counts, wordnet_task_sequence
from peft_ext.models import load_text_classifier

RANK = 16
TARGETS = ["query", "value"]
HEAD_LR = 3e-3
# (label, plugin, options); lr: the best of `--sweep` (first maximum of validation accuracy; docs/riemannion.md)
METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("riemannion_loi", "riemannion", {"init": "loi", "lr": 3e-2}),
    ("riemannion_random", "riemannion", {"init": "random", "lr": 3e-2}),
    ("lora_adamw", "lora_opt", {"optimizer": "adamw", "lr": 1e-2}),
    ("lora_rprec", "lora_opt", {"optimizer": "riemannian_precond", "lr": 1e-2}),
    ("lora_ga", "lora_opt", {"init": "lora_ga", "lr": 1e-3}),
    ("lora_muon", "lora_opt", {"optimizer": "muon", "lr": 3e-2}),
]
SWEEP = {"riemannion": [3e-3, 1e-2, 3e-2], "lora_opt": [1e-3, 3e-3, 1e-2]}
REFERENCE = "lora_adamw"


def _options(plugin: str, options: dict[str, Any], label: str) -> dict[str, Any]:
    common = {"head_lr": HEAD_LR, "label": label}
    if plugin == "riemannion":
        return {**common, "loi_batches": 2, "adapter": {"r": RANK, "target_modules": TARGETS}, **options}
    adapter = {"r": RANK, "lora_alpha": 16.0, "target_modules": TARGETS}  # the lora_alpha lora_opt always used
    return {**common, "init_batches": 2, "adapter": adapter, **options}


class Instrumented:
    """Wraps a method plugin to time its training steps and its initialization (``before_task``)."""

    def __init__(self, method: Any) -> None:
        self.method = method
        self.step_times: list[float] = []
        self.init_seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.method, name)

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: Any) -> nn.Module:
        start = time.perf_counter()
        model = self.method.before_task(model, task_id, task, ctx)
        self.init_seconds += time.perf_counter() - start
        return model

    def make_optimizer(self, model: nn.Module, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = self.method.make_optimizer(model, params)
        last = [None]

        def hook(*_: Any) -> None:
            now = time.perf_counter()
            if last[0] is not None:  # the time between two steps: forward + backward + step (+ the batch's collate)
                self.step_times.append(now - last[0])
            last[0] = now

        optimizer.register_step_post_hook(hook)
        return optimizer


def _validation_sequence(sequence: TaskSequence) -> TaskSequence:
    """The same classes; the last 20% of each class's training synsets become the evaluation set."""
    (task,) = sequence.tasks
    by_class: dict[int, list] = {}
    for example in task.train:
        by_class.setdefault(example.label, []).append(example)
    train, held_out = [], []
    for examples in by_class.values():
        cut = int(0.8 * len(examples))
        train += examples[:cut]
        held_out += examples[cut:]
    order = {id(e): i for i, e in enumerate(task.train)}
    train.sort(key=lambda e: order[id(e)])
    return TaskSequence(sequence.name + "-val", sequence.class_names, [Task("val", task.classes, train, held_out)])


def _run(
    sequence: TaskSequence,
    label: str,
    plugin: str,
    options: dict[str, Any],
    base: nn.Module,
    collate: TextCollator,
    train: TrainConfig,
) -> dict[str, Any]:
    method = Instrumented(get_continual_method(plugin)(**_options(plugin, options, label)))
    result = run_sequence(sequence, method, base, collate, train)
    training = result.train_seconds - method.init_seconds
    return {
        "acc": 100.0 * result.metrics["final_acc"],
        "step_times": method.step_times,
        "init_seconds": method.init_seconds,
        "train_seconds": training,
    }


def _targets(records: list[dict[str, Any]], ref_acc: float | None, ref_step: float | None) -> list[str]:
    """Issue 3's targets for Riemannion+LOI against LoRA+AdamW, as printable verdict lines."""
    loi = next((r for r in records if r["method"] == "riemannion_loi"), None)
    if loi is None or ref_acc is None or ref_step is None:
        return []
    gap = statistics.mean(loi["acc"]) - ref_acc
    ratio = loi["step_ms"] / (1e3 * ref_step)
    cost = loi["init_pct"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return [
        f"target: Riemannion+LOI acc - LoRA+AdamW acc = {gap:+.1f} points (>= +1.0): {verdict(gap >= 1)}",
        f"target: Riemannion+LOI step time / LoRA+AdamW = {ratio:.2f}x (<= 1.15x): {verdict(ratio <= 1.15)}",
        f"target: LOI cost = {cost:.1f}% of training time (< 2%): {verdict(cost < 2)}",
    ]


def _table(header: list[str], rows: list[list[str]]) -> str:
    align = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"
    return "\n".join(["| " + " | ".join(header) + " |", align] + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-per-class", type=int, default=20)
    parser.add_argument("--test-per-class", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; see the module docstring)")
    parser.add_argument("--methods", nargs="+", default=[m[0] for m in METHODS], help="labels to run")
    parser.add_argument("--sweep", action="store_true", help="pick learning rates on a validation split")
    parser.add_argument("--lrs", type=float, nargs="+", default=None, help="--sweep: this grid instead of SWEEP")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 4 examples per class")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.train_per_class, args.test_per_class = [0], 4, 2
    torch.set_num_threads(args.threads)

    counts = class_counts()
    caps = (args.train_per_class, args.test_per_class)
    eligible = [n for n, c in counts.items() if c["train"] >= caps[0] and c["test"] >= caps[1]]
    sequence = wordnet_task_sequence(
        n_tasks=1,
        classes_per_task=len(eligible),
        seed=0,
        train_per_class=args.train_per_class,
        test_per_class=args.test_per_class,
    )
    if args.sweep:
        sequence = _validation_sequence(sequence)
    (task,) = sequence.tasks
    steps = -(-len(task.train) // args.batch_size) * args.epochs
    print(
        f"[riemannion] MiniLM-L6, WordNet supersenses: {sequence.num_classes} classes, {len(task.train)} train / "
        f"{len(task.test)} {'validation' if args.sweep else 'test'} examples, {steps} steps of {args.batch_size}, "
        f"r={RANK} on {TARGETS}, seeds {args.seeds}, torch {torch.__version__}, {args.threads} thread(s)",
        flush=True,
    )
    wall = time.perf_counter()
    runs = []
    if args.sweep:
        for label, plugin, options in METHODS:
            if label in args.methods:
                runs += [(label, plugin, {**options, "lr": lr}, args.seeds[0]) for lr in args.lrs or SWEEP[plugin]]
    else:
        # seeds outer, methods inner: drifts in machine load spread over every method
        runs = [(m[0], m[1], m[2], seed) for seed in args.seeds for m in METHODS if m[0] in args.methods]
    results: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for label, plugin, options, seed in runs:
        base, tokenizer = load_text_classifier("minilm", sequence.num_classes, dropout=0.1, seed=seed)
        collate = TextCollator(tokenizer, 32)
        train = TrainConfig(
            epochs=args.epochs,
            batch_size=args.batch_size,
            eval_batch_size=128,
            train_logit_mask="all",
            lr_schedule="linear",
            warmup_ratio=0.1,
            seed=seed,
            device="cpu",
            progress=False,
        )
        out = _run(sequence, label, plugin, options, base, collate, train)
        results.setdefault((label, options["lr"]), []).append(out)
        print(
            f"  {label:<18} lr {options['lr']:<7g} seed {seed}: acc {out['acc']:5.1f}  "
            f"step {1e3 * statistics.median(out['step_times']):6.0f} ms  init {out['init_seconds']:5.1f} s  "
            f"train {out['train_seconds']:5.1f} s",
            flush=True,
        )

    rows, records = [], []
    ref = next((v for (label, _), v in results.items() if label == REFERENCE), None)
    ref_acc = statistics.mean(r["acc"] for r in ref) if ref else None
    ref_step = statistics.median(t for r in ref for t in r["step_times"]) if ref else None
    for (label, lr), outs in results.items():
        accs = [r["acc"] for r in outs]
        mean, std = statistics.mean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0
        step = statistics.median(t for r in outs for t in r["step_times"])
        init_pct = 100.0 * sum(r["init_seconds"] for r in outs) / sum(r["train_seconds"] for r in outs)
        rows.append(
            [
                label,
                f"{lr:g}",
                f"{mean:.1f} ± {std:.1f}",
                "" if ref_acc is None or args.sweep else f"{mean - ref_acc:+.1f}",
                f"{1e3 * step:.0f}",
                "" if ref_step is None or args.sweep else f"{step / ref_step:.2f}x",
                f"{init_pct:.1f}%" if init_pct > 0.05 else "-",
            ]
        )
        records.append({"method": label, "lr": lr, "acc": accs, "step_ms": 1e3 * step, "init_pct": init_pct})
    wall = time.perf_counter() - wall
    score = "validation" if args.sweep else "test"
    header = ["method", "lr", f"{score} acc %", "vs LoRA+AdamW", "step ms", "vs LoRA+AdamW", "init cost"]
    print(f"\n{_table(header, rows)}\n\nwall time {wall / 60:.1f} min, {args.threads} thread(s)")
    if not args.sweep:
        for line in _targets(records, ref_acc, ref_step):
            print(line)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "classes": sequence.num_classes,
            "train_examples": len(task.train),
            "eval_examples": len(task.test),
            "steps": steps,
            "seeds": args.seeds,
            "threads": args.threads,
            "torch": torch.__version__,
            "machine": platform.machine(),
            "wall_seconds": wall,
            "sweep": args.sweep,
        }
        args.json.write_text(json.dumps({"meta": meta, "results": records}, indent=2))


if __name__ == "__main__":
    main()
