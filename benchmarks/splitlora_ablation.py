"""Does SplitLoRA learn new tasks less well than InfLoRA-style, and why: SplitLoRA's knobs one change at a time.

Runs the ``splitlora`` entry of a shipped job config (``--dataset fortunes``: configs/fortunes.yaml, 4 tasks x 3
topics; ``--dataset wordnet``: configs/quickstart.yaml, 5 tasks x 4 supersenses, with 20 validation glosses per
class) on the **validation** split (the test split is never scored), over two class orders (``--seeds``: the
config's ``data.seed``; the training seed stays the config's), with one change per variant against the base
(rank 10, trade-off 20, ``init_scaling: inverse_task``, the learning rate ``--lr``): ``init_scaling: constant``,
trade-off x0.25 and x4, rank 5 and 20, learning rate x0.5 and x2, and two adaptive rules (:class:`AdaptiveSplitLoRA`:
the trade-off or the next tasks' ``A`` norm raised after a task whose held-out accuracy trails the first task's; the
held-out examples are as many further train-split examples per class as the validation split has, disjoint from it).
InfLoRA-style at its own learning rate is the reference row.

Per variant: final accuracy, forgetting, *learning acc* (mean over tasks of the accuracy on task t right after
learning it: the accuracy matrix's diagonal, ``learning_acc`` of the job's results.json), the same over tasks 2..T
(the tasks SplitLoRA restricts), the same within each task's own classes (how well the task itself was learned), for
SplitLoRA the primary-subspace size the split kept after each task (median over the adapted modules; ``k* = primary -
1`` whenever ``primary > 2``), the accuracy right after learning task by task, and each variant's change against the
base on the same class order.

Every finished run is saved in ``--runs`` (default ``runs/splitlora_ablation/DATASET.json``) and reused by a re-run.

Usage::

    python -m benchmarks.splitlora_ablation                          # fortunes, every variant, seeds 0 1
    python -m benchmarks.splitlora_ablation --dataset wordnet --variants base inflora
    python -m benchmarks.splitlora_ablation --quick                  # toy sizes, one seed (smoke run, seconds)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.cache import RunCache
from benchmarks._lib.cli import benchmark_parser, parse
from benchmarks._lib.continual import accuracy_figures
from benchmarks._lib.splitlora_variants import AdaptiveSplitLoRA, RecordedSplitLoRA, WithinTaskMixin
from benchmarks._lib.tables import markdown_table
from benchmarks._lib.timing import cpu_seconds
from peft_ext.continual.config import RunConfig, config_from_dict, read_config
from peft_ext.continual.methods import ContinualMethod, get_continual_method
from peft_ext.continual.runner import run_sequence

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"fortunes": ROOT / "configs" / "fortunes.yaml", "wordnet": ROOT / "configs" / "quickstart.yaml"}
#: quickstart.yaml has no validation split: the ablation carves 20 glosses per class, as fortunes.yaml does
DATA_OVERRIDES = {"fortunes": [], "wordnet": ["data.val_per_class=20"]}
#: the learning rates chosen on the validation split of data seed 0: on fortunes by `peft-ext run fortunes --tune`
#: (runs/fortunes/tuning.json: SplitLoRA 5e-3, tied with 1.58e-2; InfLoRA-style 5e-3), on WordNet by the continual
#: benchmark's protocol (docs/splitlora.md, "Benchmark under the protocol")
CHOSEN_LR = {
    "fortunes": {"splitlora": 5e-3, "inflora": 5e-3},
    "wordnet": {"splitlora": 5e-3, "inflora": 1.58e-3},
}
#: ``--quick``: every code path at toy size
QUICK = [
    "data.n_tasks=2",
    "data.classes_per_task=2",
    "data.train_per_class=4",
    "data.val_per_class=3",
    "data.test_per_class=2",
    "train.epochs=1",
    "train.batch_size=8",
    "model.max_length=16",
]


def _adapter(**changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda entry: entry.setdefault("adapter", {}).update(changes)


def _lr(factor: float) -> Callable[[dict[str, Any]], None]:
    def change(entry: dict[str, Any]) -> None:
        entry["lr"] = float(f"{entry['lr'] * factor:.4g}")

    return change


#: name -> (what changes against the base, the config entry it starts from, the change to the entry, the adaptive
#: rule's settings: AdaptiveSplitLoRA's keywords, or None)
VARIANTS: dict[str, tuple[str, str, Callable[[dict[str, Any]], None] | None, dict[str, Any] | None]] = {
    "base": ("the config's entry: r 10, trade-off 20, init_scaling inverse_task", "splitlora", None, None),
    "inflora": ("InfLoRA-style at its own lr (reference)", "inflora", None, None),
    "init_constant": (
        "init_scaling constant (every task's A at the kaiming norm)",
        "splitlora",
        _adapter(init_scaling="constant"),
        None,
    ),
    "trade_off_x0.25": ("trade-off 5 (more primary directions kept)", "splitlora", _adapter(trade_off=5.0), None),
    "trade_off_x4": ("trade-off 80 (fewer primary directions kept)", "splitlora", _adapter(trade_off=80.0), None),
    "r5": ("rank 5", "splitlora", _adapter(r=5), None),
    "r20": ("rank 20", "splitlora", _adapter(r=20), None),
    "lr_x0.5": ("learning rate x0.5", "splitlora", _lr(0.5), None),
    "lr_x2": ("learning rate x2", "splitlora", _lr(2.0), None),
    "adaptive_trade_off": (
        "adaptive: trade-off x4 for the later splits after a task whose held-out acc < 0.9 x the first task's",
        "splitlora",
        None,
        {"knob": "trade_off", "factor": 4.0, "tolerance": 0.9},
    ),
    "adaptive_norm": (
        "adaptive: the later tasks' A norm x2 (up to kaiming) after a task whose held-out acc < 0.9 x the first's",
        "splitlora",
        None,
        {"knob": "norm", "factor": 2.0, "tolerance": 0.9},
    ),
}
QUICK_VARIANTS = ["base", "inflora", "init_constant", "adaptive_trade_off", "adaptive_norm"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__, quick=f"toy sizes ({' '.join(QUICK)}), variants {QUICK_VARIANTS}, seed 0", json=True, threads=1
    )
    parser.add_argument("--dataset", choices=list(CONFIGS), default="fortunes")
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS), help="default: all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="data seeds (class draw and order)")
    parser.add_argument("--lr", type=float, default=None, help="SplitLoRA's base learning rate (default: CHOSEN_LR)")
    parser.add_argument("--inflora-lr", type=float, default=None, help="InfLoRA-style's (default: CHOSEN_LR)")
    parser.add_argument(
        "--runs", type=Path, default=None, help="run cache (default runs/splitlora_ablation/DATASET.json)"
    )
    args = parse(parser, argv)
    if args.quick:
        args.variants = args.variants or QUICK_VARIANTS
        args.seeds = [0]
    args.variants = args.variants or list(VARIANTS)
    if args.runs is None and not args.quick:  # the smoke run keeps its runs in memory unless --runs is given
        args.runs = ROOT / "runs" / "splitlora_ablation" / f"{args.dataset}.json"
    args.lr = args.lr or CHOSEN_LR[args.dataset]["splitlora"]
    args.inflora_lr = args.inflora_lr or CHOSEN_LR[args.dataset]["inflora"]
    return args


def job_config(args: argparse.Namespace, seed: int) -> RunConfig:
    """The job config of one class order, its methods the selected variants (labelled by variant name)."""
    overrides = [*DATA_OVERRIDES[args.dataset], f"data.seed={seed}", "train.progress=false", "train.device=cpu"]
    data = read_config(CONFIGS[args.dataset], overrides + (QUICK if args.quick else []))
    entries = {m["name"]: m for m in data["methods"]}
    methods = []
    for name in args.variants:
        _, source, change, _ = VARIANTS[name]
        entry = copy.deepcopy(entries[source])
        entry["lr"] = args.lr if source == "splitlora" else args.inflora_lr
        if change is not None:
            change(entry)
        methods.append({**entry, "label": name})
    data["methods"] = methods
    return config_from_dict(data)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a run's numbers depend on besides its key (variant, seed): sizes, training, each variant's entry."""
    config = job_config(args, 0)
    raw = read_config(CONFIGS[args.dataset], [*DATA_OVERRIDES[args.dataset], *(QUICK if args.quick else [])])
    data = {k: v for k, v in raw["data"].items() if k != "seed"}
    entries = {
        m.options.label: {"method": m.name, **_plain(m.options), **_adaptive(m.options.label)} for m in config.methods
    }
    return {
        "dataset": args.dataset,
        "data": data,
        "train": raw.get("train"),
        "model": raw.get("model"),
        "variants": entries,
    }


def _adaptive(name: str) -> dict[str, Any]:
    rule = VARIANTS[name][3]
    return {} if rule is None else {"adaptive": rule}


def _plain(options: Any) -> dict[str, Any]:
    """A method's options as JSON values (sets sorted, so the cache's settings compare equal across processes)."""

    def default(value: Any) -> Any:
        return sorted(value) if isinstance(value, (set, frozenset)) else str(value)

    return json.loads(json.dumps(dataclasses.asdict(options), default=default))


def scored_sequence(config: RunConfig) -> Any:
    """The config's sequence scored on its validation split (``test`` := the validation examples, the ones the
    job's ``--tune`` scores), with ``validation`` := as many further held-out train-split examples per class, for the
    adaptive variants' measurements (the same classes and training examples: a larger validation carve keeps the
    smaller one; checked)."""
    from peft_ext.jobs.sequence import build_sequence

    data = config.data
    wider = dataclasses.replace(config, data=dataclasses.replace(data, val_per_class=2 * data.val_per_class))
    scored, held = build_sequence(config), build_sequence(wider)
    tasks = []
    for task, other in zip(scored.tasks, held.tasks):
        val = {ex.inputs for ex in task.validation}
        same = task.classes == other.classes and [e.inputs for e in task.train] == [e.inputs for e in other.train]
        if not same or not val <= {ex.inputs for ex in other.validation}:
            raise SystemExit(f"a validation carve of {2 * data.val_per_class} per class changes task {task.name!r}")
        extra = [ex for ex in other.validation if ex.inputs not in val]
        tasks.append(dataclasses.replace(task, test=list(task.validation), validation=extra))
    meta = {**scored.meta, "evaluated_on": "validation"}
    return dataclasses.replace(scored, name=f"{scored.name}-validation", tasks=tasks, meta=meta)


def run_variants(args: argparse.Namespace, cache: RunCache) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Train (or read back) every selected variant on every seed; ``{variant: [record per seed]}`` and the count
    trained."""
    from peft_ext.data.collate import TextCollator
    from peft_ext.models import load_text_classifier

    rows: dict[str, list[dict[str, Any]]] = {}
    trained = 0
    for seed in args.seeds:  # seed-major: a stopped job has every variant on the first seeds
        config = job_config(args, seed)
        base = None
        for entry in config.methods:
            name = entry.options.label
            key = (name, seed)
            record = cache.get(key)
            if record is None:
                if base is None:
                    sequence = scored_sequence(config)
                    base, tokenizer = load_text_classifier(
                        config.model.backbone, sequence.num_classes, config.model.dropout, seed=config.train.seed
                    )
                    collate = TextCollator(tokenizer, config.model.max_length)
                rule = VARIANTS[name][3]
                if rule is not None:
                    method: ContinualMethod = AdaptiveSplitLoRA(entry.options, **rule)
                elif entry.name == "splitlora":
                    method = RecordedSplitLoRA(entry.options)
                else:
                    cls = get_continual_method(entry.name)
                    method = type(f"Measured{cls.__name__}", (WithinTaskMixin, cls), {})(entry.options)
                start, cpu = time.perf_counter(), cpu_seconds()
                result = run_sequence(sequence, method, base, collate, config.train)
                record = {
                    "metrics": result.metrics,
                    "matrix": result.accuracy_matrix,
                    "extras": result.extras,
                    "seconds": time.perf_counter() - start,
                    "cpu_seconds": cpu_seconds() - cpu,
                    "lr": entry.options.lr,
                }
                record = cache.put(key, record)
                trained += 1
                shown = {k: round(100 * v, 1) for k, v in result.metrics.items() if v is not None}
                print(f"  {name} seed {seed}: {shown}  {record['seconds']:.0f} s", flush=True)
            else:
                print(f"  {name} seed {seed}: (from {cache.path})", flush=True)
            rows.setdefault(name, []).append(record)
    return rows, trained


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (percent)."""
    out = {**accuracy_figures(record), "seconds": record["seconds"]}
    within = record["extras"].get("within_task")
    if within:
        out["within_tasks"] = [100 * a for a in within]
        out["within"] = statistics.fmean(out["within_tasks"])
    splits = record["extras"].get("splits")
    if splits:  # the split after the last task draws an A no task uses
        out["primary"] = [statistics.median(p for _, p in task.values()) for task in splits[:-1]]
    adaptive = record["extras"].get("adaptive")
    if adaptive:  # what the rule measured and chose
        out["held_out"] = [100 * a for a in adaptive["accuracy"]]
        out["trade_offs"] = adaptive["trade_off"][:-1]
        out["gains"] = adaptive["gain_used"]
    return out


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


HEAD = [
    "variant",
    "change",
    "final acc",
    "forgetting",
    "learning acc",
    "learning acc, tasks 2..T",
    "within-task learning acc",
    "primary dims after t1, t2, ... (median over modules; per seed)",
    "s / run",
]


def _choices(run: dict[str, Any]) -> str:
    if "held_out" not in run:
        return ""
    trade_offs = ", ".join(f"{a:g}" for a in run["trade_offs"])
    gains = ", ".join(f"{g:g}" for g in run["gains"])
    return f" (a: {trade_offs}; A norm x {gains})"


def _paired(values: list[float]) -> str:
    each = ", ".join(f"{v:+.1f}" for v in values)
    return f"{statistics.fmean(values):+.1f} ({each})" if len(values) > 1 else f"{values[0]:+.1f}"


PAIRED_KEYS = ("final", "forgetting", "learning", "new_tasks", "within")


def tables(rows: dict[str, list[dict[str, Any]]]) -> tuple[str, str, str | None]:
    """The ablation table, the per-task learning-accuracy table (class-incremental diagonal, and within the task's
    own classes where recorded) and (with a base row) each variant's change against the base on the same class
    order."""
    main, per_task, paired = [], [], []
    runs_of = {name: [summarize(r) for r in records] for name, records in rows.items()}
    for name, runs in runs_of.items():
        primary = "; ".join(" / ".join(f"{p:g}" for p in r["primary"]) + _choices(r) for r in runs if "primary" in r)
        cells = [name, VARIANTS[name][0]]
        cells += [_cell([r[k] for r in runs if k in r]) for k in ("final", "forgetting", "learning", "new_tasks")]
        cells.append(_cell([r["within"] for r in runs if "within" in r]))
        main.append(cells + [primary or "—", f"{statistics.fmean(r['seconds'] for r in runs):.0f}"])
        tasks = len(runs[0]["diagonal"])
        per_task.append([name] + [_cell([r["diagonal"][t] for r in runs]) for t in range(tasks)])
        if all("within" in r for r in runs):
            per_task.append(
                [f"{name} (within task)"] + [_cell([r["within_tasks"][t] for r in runs]) for t in range(tasks)]
            )
        if "base" in runs_of and name != "base":
            base = runs_of["base"]
            paired.append(
                [name]
                + [
                    _paired([r[k] - b[k] for r, b in zip(runs, base)]) if all(k in x for x in runs + base) else "—"
                    for k in PAIRED_KEYS
                ]
            )
    tasks = max(len(r) - 1 for r in per_task)
    head = [
        "variant",
        "final acc",
        "forgetting",
        "learning acc",
        "learning acc, tasks 2..T",
        "within-task learning acc",
    ]
    return (
        markdown_table(HEAD, main, align="ll" + "r" * (len(HEAD) - 2)),
        markdown_table(["variant"] + [f"t{t + 1}" for t in range(tasks)], per_task),
        markdown_table(head, paired) if paired else None,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    cache = RunCache(args.runs, settings(args), merge="variants", hint="pass another --runs or delete it")
    rows, trained = run_variants(args, cache)
    config = job_config(args, args.seeds[0])
    data = config.data
    main_table, per_task, paired = tables(rows)
    print(
        f"\n### SplitLoRA ablations on {args.dataset}: {data.n_tasks} tasks x {data.classes_per_task} classes "
        f"({data.protocol}), validation split ({data.val_per_class} per class), data seeds {args.seeds} "
        f"(mean ± sd), {config.train.epochs} epochs, SplitLoRA lr {args.lr:g}, InfLoRA-style lr {args.inflora_lr:g}\n"
    )
    print(main_table)
    print(
        "\nAccuracy on task t right after learning it: the accuracy matrix's diagonal (among all classes so far) and, "
        "where recorded, within the task's own classes\n"
    )
    print(per_task)
    if paired is not None:
        print(f"\nChange against base on the same class order (points; mean, then seeds {args.seeds})\n")
        print(paired)
    print(
        "\nlearning acc: the job's `learning_acc`, mean of the diagonal; tasks 2..T: the same without the first task, "
        "which every variant with the base's rank and lr learns identically (SplitLoRA restricts A from task 2 on). "
        "primary dims: directions the split after each task protects (k* = primary - 1 when primary > 2); for the "
        "adaptive variants, a: the trade-off of each split, A norm x: the factor on each task's A (1: inverse_task). "
        "within-task learning acc: the same diagonal when only the task's own classes may be predicted (how well the "
        "task itself was learned, without the confusion with earlier classes)."
    )
    print(f"\n[splitlora_ablation] {trained} run(s) trained, wall {time.perf_counter() - start:.0f} s")
    if args.json is not None:
        summary = {name: [summarize(r) for r in records] for name, records in rows.items()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"dataset": args.dataset, "seeds": args.seeds, "rows": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
