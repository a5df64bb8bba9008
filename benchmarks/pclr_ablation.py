"""Why PCLR learns new tasks poorly: ablations of its capacity, routing, keys, distillation and compression.

Runs the continual benchmark's PCLR entry (``benchmarks/continual_wordnet.py``: MiniLM-L6, WordNet, 5 tasks x 4
supersenses, class-incremental, the ``pclr_contribution`` settings at its chosen learning rate 2e-3) with one change
per variant, on the **validation** split (ablations choose; the test split stays for the benchmark), over
``--seeds`` (each seed its own class draw and order). Per variant: final and average incremental accuracy,
forgetting, *new-task accuracy* (mean over tasks 2..T of the accuracy on task t right after learning it, the diagonal
of the accuracy matrix: what the issue calls learning new tasks), the first task's accuracy, ranks in the pool, the
adapter values stored after the last task, and CPU seconds per run. Sequential LoRA and SplitLoRA at their chosen
rates are the reference rows.

Every finished run is saved in ``--out``/checkpoint.json (the continual benchmark's format) and reused by a re-run.

Usage::

    python -m benchmarks.pclr_ablation                         # every variant, seeds 0 1
    python -m benchmarks.pclr_ablation --variants base no_proto --seeds 0
    python -m benchmarks.pclr_ablation --quick                 # toy sizes, two variants (smoke run)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks._lib import continual as cw
from benchmarks._lib.cli import benchmark_parser
from benchmarks._lib.tables import markdown_table, mean_sd

#: The chosen learning rates of benchmarks/continual_wordnet.py (validation, seed 0; docs/benchmarks.md).
CHOSEN_LR = {"pclr": 2e-3, "seq_lora": 1e-3, "splitlora": 5e-3}


def _variant(about: str, adapter: dict[str, Any] | None = None, **rest: Any) -> dict[str, Any]:
    options = copy.deepcopy(cw.PCLR_VARIANTS["pclr_contribution"])
    options["lr"] = CHOSEN_LR["pclr"]
    options["adapter"].update(adapter or {})
    for key, value in rest.items():
        if key in ("cycle",):
            options["cycle"].update(value)
        else:
            options[key] = value
    return {"about": about, "options": options}


#: name -> what changes against the benchmark's PCLR entry, and the options.
VARIANTS: dict[str, dict[str, Any]] = {
    "base": _variant("the benchmark's entry: pool 32, 16 new ranks, top-16, halve after every task but the first"),
    "contribution_max": _variant(
        "compression scores a rank by its largest share of one task (not the sum over tasks)",
        {"compress_rule": "contribution_max"},
    ),
    "paper_shape_max": _variant(
        "paper_shape with contribution_max",
        {"pool_size": 64, "compress_schedule": [0.0, 0.0, 0.0, 0.25, 0.125], "compress_rule": "contribution_max"},
    ),
    "query_loss_0": _variant("query loss weight 0 (keys stay at their init)", {"query_loss_weight": 0.0}),
    "noise_per_coordinate": _variant(
        "new keys' noise as before the fix: 0.05 per coordinate (norm 0.98 at width 384)",
        cycle={"key_noise": round(0.05 * 384**0.5, 4)},
    ),
    "no_proto": _variant("no prototype gate at inference (keys alone route)", {"prototype_routing": False}),
    "no_integrate": _variant("no distillation after compression", cycle={"integrate_epochs": 0}),
    "no_compress": _variant(
        "no compression: pool 96 holds every task's 16 ranks", {"pool_size": 96, "compress_schedule": [0.0]}
    ),
    "paper_shape": _variant(
        "the paper's schedule shape: pool 64, no compression while there is room, then 25 % / 12.5 %",
        {"pool_size": 64, "compress_schedule": [0.0, 0.0, 0.0, 0.25, 0.125]},
    ),
    "top_all": _variant(
        "top-32 of the 32-rank pool: every sample uses every rank (no selection)", {"top_k": 32, "alpha": 32.0}
    ),
    "capacity_x2": _variant(
        "32 new ranks per task, pool 64, top-32", {"pool_size": 64, "ranks_schedule": [32], "top_k": 32, "alpha": 32.0}
    ),
    "no_init_static": _variant("new a_i random (not from the matching static ranks)", {"init_from_static": False}),
    "query_loss_1": _variant("query loss weight 1.0 (5x)", {"query_loss_weight": 1.0}),
    "paper_shape_no_proto": _variant(
        "paper_shape without the prototype gate",
        {"pool_size": 64, "compress_schedule": [0.0, 0.0, 0.0, 0.25, 0.125], "prototype_routing": False},
    ),
}
REFERENCES = {
    "seq_lora": {"about": "sequential LoRA (reference)", "options": {**cw.METHODS["seq_lora"], "lr": 1e-3}},
    "splitlora": {"about": "SplitLoRA (reference)", "options": {**cw.METHODS["splitlora"], "lr": 5e-3}},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__, quick="toy sizes, variants base and no_proto, seed 0", threads=1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--references", nargs="*", default=list(REFERENCES), choices=list(REFERENCES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="class draws (validation split)")
    parser.add_argument("--out", default="runs/pclr_ablation", help="folder of checkpoint.json")
    args = parser.parse_args(argv)
    bench = ["--methods", "seq_lora", "--convergence", "--out", args.out, "--resume"]
    if args.quick:
        bench.append("--quick")
        args.variants, args.references, args.seeds = ["base", "no_proto"], ["seq_lora"], [0]
    args.bench = cw.parse_args(bench, __doc__)
    entries = {**{n: VARIANTS[n] for n in args.variants}, **{n: REFERENCES[n] for n in args.references}}
    for name, entry in entries.items():
        cw.METHOD_OF.setdefault(name, "pclr" if name in VARIANTS else name)
        args.bench.options[name] = copy.deepcopy(entry["options"])
    args.entries = entries
    return args


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (percent): final, average incremental, forgetting, new-task and first-task accuracy."""
    out = {**cw.accuracy_figures(run), "cpu": run["cpu_seconds"]}
    extras = run.get("extras", {})
    if extras.get("pool_ranks"):
        out["pool"] = max(extras["pool_ranks"])
        out["stored"] = extras["adapter_params"][-1]
    return out


def table(rows: dict[str, list[dict[str, float]]], entries: dict[str, dict[str, Any]]) -> str:
    head = ["variant", "change", "final acc", "avg incr acc", "forgetting", "new-task acc", "first task"]
    head += ["pool ranks after a task (max)", "values stored", "CPU s / run"]
    table_rows = []
    for name, runs in rows.items():

        def cell(key: str, runs: list[dict[str, float]] = runs) -> str:
            return mean_sd([r[key] for r in runs if key in r], scale=1.0, mean=statistics.fmean)

        pool = max((r["pool"] for r in runs if "pool" in r), default=None)
        stored = max((r["stored"] for r in runs if "stored" in r), default=None)
        cells = [name, entries[name]["about"], cell("final"), cell("incremental"), cell("forgetting")]
        cells += [cell("new_tasks"), cell("first_task"), "—" if pool is None else str(pool)]
        cells += ["—" if stored is None else f"{stored:,}", f"{statistics.fmean(r['cpu'] for r in runs):.0f}"]
        table_rows.append(cells)
    return markdown_table(head, table_rows, align="ll" + "r" * (len(head) - 2))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = cw.Runs(args.bench)
    start = time.perf_counter()
    rows: dict[str, list[dict[str, float]]] = {}
    for seed in args.seeds:  # seed-major: a stopped job has every variant on the first seeds
        for name, entry in args.entries.items():
            record = runs.run(name, entry["options"]["lr"], seed, "validation", args.bench.epochs)
            rows.setdefault(name, []).append(summarize(record))
    b = args.bench
    print(
        f"\n### PCLR ablations: {b.tasks} tasks x {b.classes_per_task} WordNet supersenses, validation split, "
        f"seeds {args.seeds} (mean ± sd), {b.epochs} epochs, batch {b.batch_size}\n"
    )
    print(table(rows, args.entries))
    print(
        "\nnew-task acc: mean over tasks 2..T of the accuracy on task t right after learning it (class-incremental: "
        "among every class seen so far); first task: the same for task 1. Values stored: the adapter values PCLR "
        f"holds after the last task; one r=10 LoRA per task on the same modules would hold "
        f"{cw.LORA_VALUES_PER_TASK * b.tasks:,} after {b.tasks} tasks ({cw.LORA_VALUES_PER_TASK:,} per task)."
    )
    print(f"\n[pclr_ablation] {runs.trained} run(s) trained, wall {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
