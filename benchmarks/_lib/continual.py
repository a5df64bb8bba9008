"""The continual WordNet benchmark's methods, options and runs, shared by continual_wordnet.py (the protocol) and
pclr_ablation.py (one change per PCLR variant); and :class:`Instrumented`, the method wrapper riemannion.py times
and evaluates its runs with.

A run trains one method on one seed's class-incremental sequence (MiniLM-L6, WordNet supersenses) and scores one
split; :class:`Runs` keeps every finished run in ``OUT/checkpoint.json`` (a :class:`~.cache.RunCache` whose
settings hold one entry per method), so an interrupted job resumes with ``--resume``.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from peft_ext.continual import TrainConfig, get_continual_method, run_sequence
from peft_ext.continual.config import ConfigError, build_section
from peft_ext.continual.evaluation import evaluate
from peft_ext.data import SHIPPED
from peft_ext.data.collate import TextCollator
from peft_ext.data.tasks import Task, TaskSequence
from peft_ext.models import load_text_classifier

from .cache import RunCache
from .cli import benchmark_parser, int_options, parse
from .timing import cpu_seconds

TOTAL_CLASSES = 20
TARGET_MODULES = ["query", "value"]
# Every adapter method gets rank 10 (the SplitLoRA paper's) on query/value. ``lr`` is the centre of each method's
# 3-point grid (``protocol.log_grid``: lr / sqrt(10), lr, lr * sqrt(10)); the centres are the fixed rates of the
# benchmark before the protocol: 1e-3, the quickstart's LoRA rate, for the methods that train A and B and for OSF,
# 5e-3 for both B-only methods (frozen A), 2e-3 for PCLR (benchmarks/pclr.py's rate). The rate also trains the head.
LORA = {"r": 10, "lora_alpha": 20.0, "target_modules": TARGET_MODULES}
METHODS: dict[str, dict[str, Any]] = {
    "seq_lora": {"lr": 1e-3, "adapter": LORA},
    "inflora": {"lr": 5e-3, "r": 10, "target_modules": TARGET_MODULES},
    "olora": {"lr": 1e-3, "adapter": LORA},
    "osf": {"lr": 1e-3, "target_modules": TARGET_MODULES},
    "splitlora": {"lr": 5e-3, "adapter": {"r": 10, "target_modules": TARGET_MODULES}},
    "joint": {"lr": 1e-3, "adapter": LORA},
}
# PCLR variants: pool capped at 32 ranks per linear, 16 new ranks per task, top-16, half the pool dropped
# after every task but the first (so the pool is at its cap while each task trains), a rank-4 shared LoRA, the
# learning rate of benchmarks/pclr.py. Variants differ in the compression rule and the integration only (the base
# entry uses the public code's task-routed integration; ``_input`` routes each sample by its own query, the ``pclr``
# method's default since this comparison).
PCLR_ADAPTER = {
    "pool_size": 32,
    "ranks_schedule": [16],
    "compress_schedule": [0.0, 0.5],
    "top_k": 16,
    "alpha": 16.0,
    "shared_r": 4,
    "shared_alpha": 8.0,
    "target_modules": TARGET_MODULES,
}


def _pclr(compress_rule: str, **cycle: Any) -> dict[str, Any]:
    adapter = {**PCLR_ADAPTER, "compress_rule": compress_rule}
    return {"lr": 2e-3, "cycle": {"integrate_routing": "tasks", **cycle}, "adapter": adapter}


# The PCLR entry of the default run (benchmarks/pclr_ablation.py, docs/pclr.md): the library's default
# schedule shape at a size that fits, i.e. a pool capped at 64, 16 new ranks per task, no compression while the pool
# has room (tasks 1-3), then 25 % and 12.5 % (and whatever the next task's ranks need), the measured-contribution rule.
PCLR_PAPER_SHAPE = {"pool_size": 64, "compress_schedule": [0.0, 0.0, 0.0, 0.25, 0.125]}
PCLR_VARIANTS: dict[str, dict[str, Any]] = {
    "pclr": {
        **_pclr("contribution"),
        # grid 2e-3 / 6.32e-3 / 2e-2: centred on the first grid's chosen top edge (2026-12-01), 2e-2 clearly worse
        "lr": 6.32e-3,
        "adapter": {**PCLR_ADAPTER, **PCLR_PAPER_SHAPE, "compress_rule": "contribution"},
    },
    "pclr_index": _pclr("index"),
    "pclr_importance": _pclr("importance"),
    "pclr_contribution": _pclr("contribution"),
    "pclr_contribution_input": _pclr("contribution", integrate_routing="input"),
    "pclr_contribution_no_integrate": _pclr("contribution", integrate_epochs=0),
}
METHODS.update(PCLR_VARIANTS)
#: the registered method each entry runs (the PCLR variants are option sets of ``pclr``)
METHOD_OF = {name: ("pclr" if name in PCLR_VARIANTS else name) for name in METHODS}
#: the default selection: the SplitLoRA comparison and the PCLR entry the README quotes
DEFAULT_METHODS = ["seq_lora", "inflora", "olora", "osf", "splitlora", "pclr", "joint"]
#: ``--quick``: every code path at toy size (2 tasks x 2 classes, 2 test seeds so intervals exist)
QUICK = {
    "tasks": 2,
    "classes_per_task": 2,
    "seeds": [0, 1],
    "train_per_class": 4,
    "val_per_class": 2,
    "test_per_class": 2,
    "epochs": 1,
    "batch_size": 8,
    "max_length": 16,
}
# One rank-10 LoRA on MiniLM-L6's query and value (384 -> 384, 6 layers): what a method that keeps one adapter per
# task (O-LoRA; per-task LoRA experts) adds to its storage with every task.
LORA_VALUES_PER_TASK = 10 * (384 + 384) * 2 * 6
SPLITS = ("validation", "test")
RECORD_FORMAT = "tuning-v1"  # run records of the fixed-lr benchmark (before the protocol) are refused, not mixed in


def parse_args(argv: list[str] | None = None, doc: str | None = __doc__) -> argparse.Namespace:
    """The continual benchmark's command line (sizes, seeds, methods, ``--set``), each method's options validated
    as the run configs validate them; ``args.options`` holds every selected method's options."""
    parser = benchmark_parser(doc, quick=f"smoke run at toy size: {QUICK}", threads=1)
    parser.add_argument(
        "--dataset",
        default="wordnet",
        choices=sorted(SHIPPED),
        help="the shipped data set (fortunes: 12 topics, e.g. --tasks 4 --train-per-class 40 --val-per-class 20)",
    )
    parser.add_argument("--tasks", type=int, default=5, choices=(2, 3, 4, 5, 6, 10, 12, 20), help="tasks per sequence")
    parser.add_argument(
        "--classes-per-task", type=int, default=None, help=f"default: the data set's classes ({TOTAL_CLASSES}) / tasks"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="test seeds (data draws)")
    parser.add_argument("--tune-seeds", type=int, nargs="+", default=[0], help="seeds whose validation picks the lr")
    parser.add_argument("--grid-points", type=int, default=3, help="learning rates per method (half a decade apart)")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    parser.add_argument(
        "--convergence",
        nargs="*",
        default=None,
        metavar="METHOD",
        help="methods run again at twice the epochs (validation, first tune seed) to check convergence (default: "
        "seq_lora and joint when they run; no names: skip)",
    )
    int_options(
        parser, train_per_class=40, val_per_class=25, test_per_class=25, epochs=3, batch_size=32, max_length=32
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="override a method option (METHOD.adapter.KEY for an adapter field; METHOD.lr moves the grid's centre)",
    )
    parser.add_argument(
        "--out", default=None, help="folder for results.json (default runs/benchmark_continual_wordnet, or _DATASET)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse the runs in OUT/checkpoint.json (written after every run) made with the same settings",
    )
    args = parse(parser, argv, quick=QUICK)
    if args.out is None:
        args.out = "runs/benchmark_continual_wordnet" + ("" if args.dataset == "wordnet" else f"_{args.dataset}")
    if args.classes_per_task is None:
        total = TOTAL_CLASSES if args.dataset == "wordnet" else len(SHIPPED[args.dataset].names())
        args.classes_per_task = total // args.tasks
    if args.convergence is None:
        args.convergence = [name for name in ("seq_lora", "joint") if name in args.methods]
    unknown = sorted(set(args.convergence) - set(args.methods))
    if unknown:
        parser.error(f"--convergence names methods that are not run: {unknown} (choose from {args.methods})")
    args.options = {name: copy.deepcopy(METHODS[name]) for name in args.methods}
    for item in args.set:
        key, sep, raw = item.partition("=")
        name, dot, option = key.partition(".")
        if not sep or not dot or name not in args.options:
            parser.error(f"--set expects METHOD.KEY=VALUE with METHOD in {args.methods}, got {item!r}")
        section, _, leaf = option.rpartition(".")  # METHOD.adapter.KEY sets a field of the adapter section
        target = args.options[name].setdefault(section, {}) if section else args.options[name]
        target[leaf] = yaml.safe_load(raw)
    for name, options in args.options.items():
        # the run configs' own validation: unknown keys, types (YAML reads `1e-3` as a string) and values
        try:
            build_section(get_continual_method(METHOD_OF[name]).options_cls, options, prefix=f"{name}.")
        except ConfigError as err:
            parser.error(str(err))
    return args


def accuracy_figures(run: dict[str, Any]) -> dict[str, Any]:
    """A finished run's accuracies in percent, from its accuracy matrix and metrics: final, average incremental,
    forgetting, learning (mean of the diagonal: each task right after learning it), new tasks (the diagonal past the
    first task), first task, and the diagonal itself."""
    matrix, metrics = run["matrix"], run["metrics"]
    diagonal = [matrix[t][t] for t in range(len(matrix))]
    return {
        "final": 100 * metrics["final_acc"],
        "incremental": 100 * metrics["avg_incremental_acc"],
        "forgetting": 100 * metrics["forgetting"],
        "learning": 100 * metrics.get("learning_acc", statistics.fmean(diagonal)),
        "new_tasks": 100 * statistics.fmean(diagonal[1:]),
        "first_task": 100 * diagonal[0],
        "diagonal": [100 * d for d in diagonal],
    }


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a run's numbers depend on besides its key (method, lr, seed, split, tasks, epochs)."""
    keys = ("classes_per_task", "train_per_class", "val_per_class", "test_per_class", "batch_size", "max_length")
    options = {name: {k: v for k, v in opts.items() if k != "lr"} for name, opts in args.options.items()}
    dataset = {} if args.dataset == "wordnet" else {"dataset": args.dataset}  # WordNet caches keep their settings
    return {"format": RECORD_FORMAT, **dataset, **{key: getattr(args, key) for key in keys}, "options": options}


def checkpoint(args: argparse.Namespace) -> RunCache:
    """``OUT/checkpoint.json``: the runs made with the same settings (with ``--resume``; else it starts empty). A
    record of the fixed-lr benchmark (before the protocol: no ``format``) or of other settings is refused; a
    method's options count only for that method's runs (a moved grid centre is not another setting)."""
    path = Path(args.out) / "checkpoint.json"
    hint = "drop --resume or use another --out"
    return RunCache(path, settings(args), resume=args.resume, merge="options", hint=hint)


class Runs:
    """Trains (or reads back from the checkpoint) one method on one seed's sequence and scores one split.

    Args:
        args: The parsed arguments (:func:`parse_args`, ``args.options`` extended with any further entries).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cache = checkpoint(args)
        self._sequences: dict[int, TaskSequence] = {}
        self._bases: dict[int, tuple[torch.nn.Module, Any]] = {}
        self.trained = 0

    def sequence(self, seed: int) -> TaskSequence:
        """Seed ``seed``'s class draw and order, with train, validation and test examples."""
        if seed not in self._sequences:
            a = self.args
            self._sequences[seed] = SHIPPED[a.dataset].task_sequence(
                n_tasks=a.tasks,
                classes_per_task=a.classes_per_task,
                seed=seed,
                train_per_class=a.train_per_class,
                test_per_class=a.test_per_class,
                val_per_class=a.val_per_class,
            )
        return self._sequences[seed]

    def base(self, seed: int) -> tuple[torch.nn.Module, Any]:
        """Seed ``seed``'s MiniLM classifier (its head drawn from the seed) and tokenizer, loaded once."""
        if seed not in self._bases:  # run_sequence deep-copies the base, so one load per seed serves every run
            self._bases[seed] = load_text_classifier("minilm", self.sequence(seed).num_classes, seed=seed)
        return self._bases[seed]

    def run(self, method: str, lr: float, seed: int, split: str, epochs: int) -> dict[str, Any]:
        """One run's record: ``{"metrics", "matrix", "trainable", "seconds", "cpu_seconds", "extras"}``."""
        key = f"{method}|lr={lr:g}|seed={seed}|{split}|tasks={self.args.tasks}|epochs={epochs}"
        stale = METHOD_OF[method] == "olora" and "old_A_rows" not in (self.cache.runs.get(key) or {}).get("extras", {})
        if key in self.cache and stale:
            # O-LoRA runs recorded before its penalty was restored (they report no `old_A_rows`) measured sequential
            # LoRA with merging: never reuse them
            print(f"  {key:<58} (recorded without O-LoRA's penalty: run again)", flush=True)
            self.cache.pop(key)
        if key in self.cache:
            print(f"  {key:<58} (from {self.cache.path})", flush=True)
            return self.cache.get(key)
        record = self.train(method, lr, seed, split, epochs)
        return self.cache.put(key, record)  # saved at once: a run killed later loses none before it

    def train(self, method: str, lr: float, seed: int, split: str, epochs: int, wrap: Any = None) -> dict[str, Any]:
        """Train one run, never read from or saved to the checkpoint: the record :meth:`run` keeps. ``wrap(plugin)``
        (e.g. :class:`Instrumented`) replaces the method plugin the run drives."""
        key = f"{method}|lr={lr:g}|seed={seed}|{split}|tasks={self.args.tasks}|epochs={epochs}"
        base, tokenizer = self.base(seed)
        cls = get_continual_method(METHOD_OF[method])
        options = {**self.args.options[method], "lr": lr}
        plugin = cls(build_section(cls.options_cls, options, prefix=f"{method}."))
        plugin = plugin if wrap is None else wrap(plugin)
        train = TrainConfig(epochs=epochs, batch_size=self.args.batch_size, seed=seed, progress=False, device="cpu")
        start, cpu_start = time.perf_counter(), cpu_seconds()
        sequence = self.sequence(seed).evaluated_on(split)
        result = run_sequence(sequence, plugin, base, TextCollator(tokenizer, self.args.max_length), train)
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
        record = {
            "metrics": result.metrics,
            "matrix": result.accuracy_matrix,
            "trainable": result.trainable_params,
            "seconds": seconds,
            "cpu_seconds": cpu,
            "extras": result.extras,
        }
        self.trained += 1
        shown = {k: None if v is None else round(100 * v, 1) for k, v in result.metrics.items()}
        print(f"  {key:<58} {shown}  {seconds:.0f} s ({cpu:.0f} s CPU)", flush=True)
        return record

    def score(self, method: str, lr: float, seed: int, split: str) -> tuple[float, dict[str, Any]]:
        """``tune_and_test``'s score: final average accuracy, plus the run's other figures as extras."""
        run = self.run(method, lr, seed, split, self.args.epochs)
        extras = {**run["metrics"], "matrix": run["matrix"], "trainable": run["trainable"]}
        extras.update(seconds=run["seconds"], cpu_seconds=run["cpu_seconds"])
        extras.update({k: run["extras"][k] for k in ("pool_ranks", "adapter_params") if k in run["extras"]})
        return run["metrics"]["final_acc"], extras


# -- riemannion.py: a method plugin timed and evaluated from inside its run -------------------------------------------


class Instrumented:
    """Wraps a method plugin: times its training steps and its initialization (``before_task``), and evaluates the
    model on held-out splits at given step counts from the optimizer's step hook.

    Args:
        method: The plugin.
        checkpoints: ``{step: [split names]}`` to evaluate after that many optimizer steps.
        splits: ``{split name: examples}``.
        num_classes: Classes the evaluation may predict (all of the one task's).
        collate: The batch collator.
    """

    def __init__(
        self, method: Any, checkpoints: dict[int, list[str]], splits: dict[str, list], num_classes: int, collate: Any
    ) -> None:
        self.method = method
        self.checkpoints = checkpoints
        self.splits = splits
        self.num_classes = num_classes
        self.collate = collate
        self.step_times: list[float] = []
        self.init_seconds = 0.0
        self.curves: dict[str, dict[int, float]] = {name: {} for name in splits}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.method, name)

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: Any) -> nn.Module:
        start = time.perf_counter()
        model = self.method.before_task(model, task_id, task, ctx)
        self.init_seconds += time.perf_counter() - start
        return model

    def _evaluate(self, model: nn.Module, names: list[str]) -> dict[str, float]:
        # eval mode + no_grad draw no random numbers, and the generators are restored anyway: the run goes on exactly
        # as it would have without this evaluation
        torch_state, py_state = torch.get_rng_state(), random.getstate()
        try:
            allowed = list(range(self.num_classes))
            return {
                name: evaluate(model, self.splits[name], allowed, self.num_classes, self.collate, torch.device("cpu"))
                for name in names
            }
        finally:
            torch.set_rng_state(torch_state)
            random.setstate(py_state)

    def make_optimizer(self, model: nn.Module, params: list[nn.Parameter], ctx: Any) -> torch.optim.Optimizer:
        optimizer = self.method.make_optimizer(model, params, ctx)
        last: list[float | None] = [None]
        steps = [0]

        def hook(*_: Any) -> None:
            now = time.perf_counter()
            if last[0] is not None:  # the time between two steps: forward + backward + step (+ the batch's collate)
                self.step_times.append(now - last[0])
            steps[0] += 1
            if steps[0] in self.checkpoints:
                for name, acc in self._evaluate(model, self.checkpoints[steps[0]]).items():
                    self.curves[name][steps[0]] = acc
            last[0] = time.perf_counter()  # the evaluation is not part of the next step's time

        optimizer.register_step_post_hook(hook)
        return optimizer
