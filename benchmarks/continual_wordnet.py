"""SplitLoRA, PCLR and their baselines on WordNet class-incremental sequences with real pretrained MiniLM-L6.

The protocol of benchmarks/_lib/protocol.py: every method gets a 3-point learning-rate grid (half a decade apart,
centred on its rate in ``METHODS``), the best point on the *validation* split of seed 0 is chosen (final average
accuracy over all tasks, i.e. the last row of the accuracy matrix, is the selection score), and that rate is run on
the test split of 5 seeds. Each seed is its own class draw and order (``wordnet_task_sequence`` samples and orders
the 20 classes from the seed; the script prints and checks that the draws differ) and its own head initialization.
The report: ``Study.table(baseline="inflora")`` for final accuracy, a table of average incremental accuracy,
forgetting, BWT and the forgetting ratio to sequential LoRA with its 95 % interval, the targets' verdicts, and a
convergence check of the baselines' epochs (seq_lora and joint at E and 2E epochs, validation, seed 0, at their
chosen rate).

Usage (default: 5 tasks x 4 classes, 7 methods, 3 + 5 runs each, plus the convergence runs)::

    python -m benchmarks.continual_wordnet --resume          # --resume continues an interrupted run
    python -m benchmarks.continual_wordnet --tasks 10 --resume --out runs/benchmark_continual_wordnet_10
    python -m benchmarks.continual_wordnet --quick --out /tmp/cw_quick   # smoke run of every code path (~1 min)
    python -m benchmarks.continual_wordnet --dataset fortunes --tasks 4 --train-per-class 40 --val-per-class 20 \
        --test-per-class 30   # the same protocol on the second shipped data set (12 topics of Debian's fortunes)
    python -m benchmarks.continual_wordnet --set splitlora.lr=5e-3 --set splitlora.trade_off=10

Cost of the default (5 tasks x 4 classes, 40 train / 25 validation / 25 test glosses per class, 3 epochs = 15
steps per task, batch 32): 7 methods x (3 validation + 5 test runs) + 2 convergence runs at 6 epochs = 58 runs.
Measured for the record (2026-12-01, one thread, the machine shared with a second benchmark): the 58 runs took 5,435
CPU s in all (about 91 minutes on one idle core; 109 minutes wall here); per run seq_lora 78 s, splitlora 83 s,
inflora 99 s, pclr_contribution 148 s of CPU (the earlier ``pclr`` entry: 93 s). The sizes are the fixed-lr
benchmark's: runs long enough to converge come first (the convergence check says whether they are; seq_lora at lr
1e-3, seed 0: 23.6 -> 19.8 validation final accuracy from 3 to 6 epochs, more epochs only forget more).

Targets (judged by 95 % intervals): SplitLoRA's final average accuracy at least 1 point
above the InfLoRA-style baseline (lower end of the paired interval >= +1), and its forgetting at most half of
sequential LoRA's (upper end of the paired interval of ``forgetting_splitlora - 0.5 * forgetting_seq_lora`` <= 0; the
per-seed ratio's interval is printed beside it). PCLR's forgetting at most half of sequential LoRA's (same
rule) with a pool that stays within its cap. The other PCLR variants (compression rules, integration) stay
selectable with ``--methods``. The methods, their options and the runs live in benchmarks/_lib/continual.py
(pclr_ablation.py runs them too).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib import machine
from benchmarks._lib.continual import (
    LORA_VALUES_PER_TASK,
    METHODS,
    PCLR_VARIANTS,
    Runs,
    parse_args,
    settings,
)
from benchmarks._lib.protocol import Protocol, Study, log_grid, paired_interval, tune_and_test
from benchmarks._lib.tables import markdown_table, mean_sd
from peft_ext.data import SHIPPED


def draws(runs: Runs, seeds: list[int]) -> tuple[str, bool]:
    """A line saying which classes each seed draws, and whether every seed's draw (set and order) differs."""
    names = {seed: tuple(runs.sequence(seed).class_names) for seed in seeds}
    sets_differ = len({frozenset(n) for n in names.values()}) == len(names)
    orders_differ = len(set(names.values())) == len(names)
    per_seed = "; ".join(f"seed {s}: {', '.join(n[:3])}, ..." for s, n in names.items())
    verdict = "every seed draws a different class set in a different order" if sets_differ else (
        "every seed orders the classes differently, but some draw the same set"
        if orders_differ else "SOME SEEDS REPEAT A DRAW"
    )  # fmt: skip
    return f"data: the seed picks and orders the {len(next(iter(names.values())))} classes: {verdict} ({per_seed})", (
        orders_differ
    )


def _values(study: Study, method: str, key: str) -> list[float]:
    return [e[key] for e in study.extras[method] if e.get(key) is not None]


def _ratio_to_seq(study: Study, method: str) -> tuple[float, float, float] | None:
    """Mean per-seed ``forgetting_method / forgetting_seq_lora`` and its 95 % t-interval (None if undefined)."""
    if "seq_lora" not in study.extras or method == "seq_lora":
        return None
    ours, seq = _values(study, method, "forgetting"), _values(study, "seq_lora", "forgetting")
    if not ours or len(ours) != len(seq):
        return None
    ratios = [f / max(s, 1e-12) for f, s in zip(ours, seq)]
    return paired_interval(ratios, [0.0] * len(ratios))  # a one-sample interval: the pairs' second half is 0


def metrics_table(study: Study) -> str:
    """Markdown: the other continual metrics at each method's chosen lr (test, mean ± sd over seeds)."""
    head = ["method", "final acc", "avg incr acc", "forgetting", "BWT", "forgetting / seq_lora's (95 % CI)"]
    head += ["trainable params", "wall s / run", "CPU s / run"]
    rows = []
    for method in study.test:
        cells = [method + (" (upper bound)" if method == "joint" else "")]
        for key in ("final_acc", "avg_incremental_acc", "forgetting", "bwt"):
            cells.append(mean_sd(_values(study, method, key)))
        ratio = _ratio_to_seq(study, method)
        cells.append("—" if ratio is None else f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]")
        cells.append(f"{study.extras[method][0]['trainable']:,}")
        cells.append(f"{statistics.fmean(_values(study, method, 'seconds')):.0f}")
        cells.append(f"{statistics.fmean(_values(study, method, 'cpu_seconds')):.0f}")
        rows.append(cells)
    return markdown_table(head, rows)


def forgetting_verdict(study: Study, method: str, name: str, extra: tuple[str, bool] = ("", True)) -> str:
    """``target: ...`` for "forgetting <= 0.5x sequential LoRA's", judged by the upper end of the paired interval of
    ``forgetting_method - 0.5 * forgetting_seq_lora`` (linear in the data, so the t-interval applies; a ratio of two
    noisy figures is skewed). ``extra`` is a further condition: ``(text, holds)``."""
    ours, seq = _values(study, method, "forgetting"), _values(study, "seq_lora", "forgetting")
    mean, lo, hi = paired_interval(ours, [0.5 * s for s in seq])
    ratio = _ratio_to_seq(study, method)
    assert ratio is not None
    met = hi <= 0 and extra[1]
    return (
        f"target: {name} forgetting <= 0.5x sequential LoRA's: ratio {ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]; "
        f"forgetting - 0.5 x seq_lora's = {100 * mean:+.1f} points, 95 % CI [{100 * lo:+.1f}, {100 * hi:+.1f}] over "
        f"{len(ours)} seeds (judged by its upper end <= 0){extra[0]}: {'met' if met else 'NOT met'}"
    )


def targets(study: Study) -> list[str]:
    """The issue's targets as printable ``target: ...: met / NOT met`` lines (those whose methods ran)."""
    methods = set(study.test)
    lines = []
    if {"splitlora", "inflora"} <= methods:
        lines.append(study.verdict("splitlora", "inflora", 0.01, "SplitLoRA final acc >= +1 point over InfLoRA-style"))
    if {"splitlora", "seq_lora"} <= methods:
        lines.append(forgetting_verdict(study, "splitlora", "SplitLoRA"))
    for name in sorted(methods & set(PCLR_VARIANTS)):
        if "seq_lora" not in methods:
            break
        cap = METHODS[name]["adapter"]["pool_size"]
        pools = [r for e in study.extras[name] for r in e.get("pool_ranks", [])]
        within = bool(pools) and max(pools) <= cap
        lines.append(forgetting_verdict(study, name, name, (f", pool within its cap of {cap}: {within}", within)))
    return lines


def convergence(runs: Runs, study: Study, methods: list[str]) -> tuple[str, str, list[dict[str, Any]]]:
    """The baselines at E and 2E epochs (validation, first tune seed, chosen lr): a table, a verdict, the rows."""
    seed, epochs = study.protocol.tune_seeds[0], runs.args.epochs
    rows = []
    for method in methods:
        lr = study.chosen[method]
        short, long = (
            runs.run(method, lr, seed, "validation", e)["metrics"]["final_acc"] for e in (epochs, 2 * epochs)
        )
        rows.append({"method": method, "lr": lr, "epochs": epochs, "final_acc": short, "final_acc_2x": long})
    head = ["method", "lr", f"{epochs} epochs", f"{2 * epochs} epochs", "gain from doubling"]
    cells = [
        [r["method"], f"{r['lr']:g}", f"{100 * r['final_acc']:.1f}", f"{100 * r['final_acc_2x']:.1f}",
         f"{100 * (r['final_acc_2x'] - r['final_acc']):+.1f}"]
        for r in rows
    ]  # fmt: skip
    lines = [
        f"Convergence of the baselines' epochs (validation final acc, seed {seed}, chosen lr):\n",
        markdown_table(head, cells),
    ]
    worst = max((100 * (r["final_acc_2x"] - r["final_acc"]) for r in rows), default=0.0)
    verdict = (
        f"target: the baselines' epochs converge ({', '.join(methods)}: gain from doubling {epochs} -> {2 * epochs} "
        f"epochs < 1 point; one seed, largest gain {worst:+.1f}): {'met' if worst < 1.0 else 'NOT met'}"
    )
    return "\n".join(lines), verdict, rows


def growth(study: Study) -> str:
    """Adapter values PCLR holds after each task (first test seed) against per-task LoRA growth."""
    names = [n for n in study.extras if n in PCLR_VARIANTS and study.extras[n][0].get("adapter_params")]
    if not names:
        return ""
    seed = study.protocol.test_seeds[0]
    n_tasks = len(study.extras[names[0]][0]["adapter_params"])
    head = ["after task", *(str(t + 1) for t in range(n_tasks))]
    rows = []
    for name in names:
        extras = study.extras[name][0]
        rows.append([name, *(f"{v:,}" for v in extras["adapter_params"])])
        rows.append([f"{name} pool ranks", *(str(v) for v in extras["pool_ranks"])])
    rows.append(["one r=10 LoRA per task", *(f"{LORA_VALUES_PER_TASK * (t + 1):,}" for t in range(n_tasks))])
    caption = (
        f"\nAdapter values stored after each task (seed {seed}; PCLR counts the active ranks' a_i and b_i, the shared "
        "LoRA, keys and prototypes):\n"
    )
    return caption + "\n" + markdown_table(head, rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__)
    # --quick: batches of 8 short glosses gain nothing from a second thread, and the test suite runs it beside others
    torch.set_num_threads(args.threads)
    protocol = Protocol(tune_seeds=tuple(args.tune_seeds), test_seeds=tuple(args.seeds))
    print(
        f"[benchmark] MiniLM-L6 on {SHIPPED[args.dataset].describe}, {args.tasks} tasks x {args.classes_per_task} "
        f"classes, methods {args.methods}"
    )
    print(
        f"[benchmark] {args.train_per_class} train / {args.val_per_class} validation / {args.test_per_class} test per "
        f"class, {args.epochs} epochs, batch {args.batch_size}, {torch.get_num_threads()} threads; "
        f"{protocol.describe()}"
    )
    out = Path(args.out)
    runs = Runs(args)
    data_line, draws_differ = draws(runs, sorted({*args.tune_seeds, *args.seeds}))
    print(data_line)
    start = time.perf_counter()
    grids = {name: log_grid(args.options[name]["lr"], args.grid_points) for name in args.methods}
    study = tune_and_test(grids, runs.score, protocol, echo=lambda line: None)
    conv_table, conv_verdict, conv_rows = convergence(runs, study, args.convergence) if args.convergence else (
        "", "", []
    )  # fmt: skip
    this_wall = time.perf_counter() - start
    # Totals over every run in the record (some may come from a checkpoint of an earlier, interrupted invocation).
    every = runs.cache.values()
    wall, cpu = sum(r["seconds"] for r in every), sum(r["cpu_seconds"] for r in every)
    threads = torch.get_num_threads()
    report = [
        f"\n### {args.tasks} tasks x {args.classes_per_task} classes: final average accuracy (percent; "
        f"{protocol.describe()})\n",
        study.table(baseline="inflora" if "inflora" in study.test else None),
        f"\nThe other metrics at the chosen lr (test, mean ± sd over seeds {args.seeds}; the forgetting ratio is the "
        "mean of the per-seed ratios with its 95 % t-interval):\n",
        metrics_table(study),
        "",
        data_line,
        *targets(study),
    ]
    if conv_table:
        report += ["", conv_table, "", conv_verdict]
    extra = growth(study)
    if extra:
        report.append(extra)
    report.append(
        f"\nTotal over the {len(every)} runs in the record: wall time {wall:.0f} s ({wall / 60:.1f} min); CPU time "
        f"{cpu:.0f} s, i.e. about {cpu / threads / 60:.1f} min of wall time on {threads} otherwise idle cores (this "
        f"invocation: {this_wall:.0f} s, {runs.trained} runs trained); {machine.torch_platform()}, "
        f"load average at the end {machine.load_average():.1f}"
    )
    text = "\n".join(report)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "argv": sys.argv[1:] if argv is None else argv,
        "settings": settings(args),
        "options": args.options,
        "protocol": protocol.describe(),
        "study": study.to_dict(),
        "convergence": conv_rows,
        "data": {"line": data_line, "draws_differ": draws_differ},
        "runs": runs.cache.runs,
        "report": text,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    print(f"[benchmark] wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
