"""The ``continual`` job (the default of ``peft-ext run``): build the task sequence and the backbone from a
:class:`~peft_ext.continual.config.RunConfig`, run every method, report."""

from __future__ import annotations

import platform
import re
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..continual.config import RunConfig
from ..continual.engine import MethodResult
from ..continual.methods import get_continual_method
from ..continual.progress import TaskProgress
from ..continual.report import matrix_table, metrics_table, save_results
from ..continual.runner import run_sequence
from ..data.tasks import TaskSequence
from .errors import JobFailed, one_line
from .resume import config_hash, finished_results


def build_sequence(config: RunConfig) -> TaskSequence:
    """The task sequence the config's ``data`` section describes."""
    data = config.data
    if data.dataset == "wordnet":
        from ..data.wordnet import wordnet_task_sequence

        return wordnet_task_sequence(
            n_tasks=data.n_tasks,
            classes_per_task=data.classes_per_task,
            seed=data.seed,
            train_per_class=data.train_per_class,
            test_per_class=data.test_per_class,
            protocol=data.protocol,
            supersenses=data.classes,
        )
    if data.dataset == "files":
        from ..data.user_data import file_task_sequence

        return file_task_sequence(
            data.train,
            data.test,
            data.validation,
            text_column=data.text_column,
            label_column=data.label_column,
            task_column=data.task_column,
            n_tasks=data.n_tasks,
            classes_per_task=data.classes_per_task,
            classes=data.classes,
            seed=data.seed,
            train_per_class=data.train_per_class,
            test_per_class=data.test_per_class,
            test_share=data.test_share,
            validation_share=data.validation_share,
            protocol=data.protocol,
            name=config.name,
        )
    raise ValueError(f"unknown dataset {data.dataset!r}")  # unreachable: the config's Literal type checks it


def method_progress(config: RunConfig, index: int, name: str, label: str, fingerprint: str) -> TaskProgress:
    """Where method ``index`` of the job keeps its end-of-task snapshots: ``output.dir/progress/{index}-{label}``."""
    folder = f"{index:02d}-{re.sub(r'[^A-Za-z0-9_.+-]', '_', label)}"
    identity = {"method": name, "label": label, "config_hash": fingerprint}
    return TaskProgress(Path(config.output.dir) / "progress" / folder, identity)


def run_job(
    config: RunConfig, echo: Callable[[str], Any] = print, debug: bool = False, resume: bool = False
) -> list[MethodResult]:
    """Run every method of ``config`` on the same sequence and backbone; write results; return them.

    The results files are written before the first method and rewritten after each one, so they always hold every
    method finished so far; while a method runs, a snapshot after each of its tasks is kept in
    ``output.dir/progress/`` (deleted once the method's result is written). A method that raises is recorded (under
    ``failed`` in the results, its snapshots kept) and the next one runs.

    Args:
        config: The validated run config.
        echo: Where progress lines go.
        debug: Print the traceback of a failed method (stderr).
        resume: Keep the methods an earlier run of the same config finished (its ``results.json`` in
            ``output.dir``), continue an unfinished one after its last finished task, and run the others
            (:mod:`peft_ext.jobs.resume`).

    Raises:
        JobFailed: After every method ran, when at least one failed.
        ConfigError: ``resume`` with no results, or results of a different config, in ``output.dir``.
    """
    from ..data.collate import TextCollator
    from ..models import load_text_classifier

    start = time.perf_counter()
    fingerprint = config_hash(config)
    done = {(r.method, r.label): r for r in finished_results(config, fingerprint)} if resume else {}
    sequence = build_sequence(config)
    echo(
        f"[peft-ext] {config.name}: {sequence.name} ({sequence.protocol}), {len(sequence)} tasks, "
        f"{sequence.num_classes} classes, {sum(len(t.train) for t in sequence.tasks)} train / "
        f"{sum(len(t.test) for t in sequence.tasks)} test examples"
    )
    for i, task in enumerate(sequence.tasks):
        echo(f"  t{i}: {task.name}")
    base, tokenizer = load_text_classifier(
        config.model.backbone, sequence.num_classes, config.model.dropout, seed=config.train.seed
    )
    if config.data.dataset == "files":
        # tokenized once (cached by `datasets`), not by every method's collate
        from ..data.user_data import tokenize_sequence

        sequence = tokenize_sequence(sequence, tokenizer, config.model.max_length, config.train.progress)
        if sequence.meta["truncated"]:
            total = sum(len(t.train) + len(t.test) + len(t.validation) for t in sequence.tasks)
            echo(
                f"  {sequence.meta['truncated']} of {total} distinct texts are longer than model.max_length="
                f"{config.model.max_length} tokens and are truncated to it (raise model.max_length to keep more)"
            )
    collate = TextCollator(tokenizer, config.model.max_length)
    task_names = [t.name for t in sequence.tasks]
    meta = {
        "name": config.name,
        "sequence": sequence.name,
        "protocol": sequence.protocol,
        "sequence_meta": sequence.meta,
        "backbone": config.model.backbone,
        "wall_seconds": 0.0,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "config_hash": fingerprint,
    }
    results: list[MethodResult] = []
    failures: list[dict[str, str]] = []
    # The report exists (with the config's fingerprint) before any training, so an interruption during the first
    # method is resumable too.
    paths = save_results(list(done.values()), config.output.dir, meta, task_names)
    for index, entry in enumerate(config.methods):
        label = entry.name
        progress = finished = None
        try:
            method = get_continual_method(entry.name)(entry.options)
            label = method.label
            if (method.name, label) in done:
                echo(f"\n[peft-ext] method {label}: finished in the run being resumed")
                result = done[(method.name, label)]
            else:
                progress = method_progress(config, index, method.name, label, fingerprint)
                record = progress.record(len(sequence))
                resumed = f": resuming after {record.completed} finished task(s)" if record.completed else ""
                echo(f"\n[peft-ext] method {label}{resumed}")
                result = run_sequence(sequence, method, base, collate, config.train, progress=progress)
        except Exception as err:  # a failed method is recorded and the others still run
            if debug:
                traceback.print_exc()
            failures.append({"method": entry.name, "label": label, "error": one_line(err)})
            echo(f"[peft-ext] method {label} failed: {one_line(err)}")
        else:
            echo(matrix_table(result))
            results.append(result)
            finished = progress
        # Written after every method, so the report on disk always holds every method finished so far.
        meta["wall_seconds"] = round(time.perf_counter() - start, 1)
        paths = save_results(results, config.output.dir, meta, task_names, failures)
        if finished is not None:
            shutil.rmtree(finished.directory, ignore_errors=True)  # the result is written; its snapshots are done
    progress_root = Path(config.output.dir) / "progress"
    if progress_root.is_dir() and not any(progress_root.iterdir()):
        progress_root.rmdir()
    wall = time.perf_counter() - start
    echo(f"\n[peft-ext] metrics (percent), {len(sequence)} tasks, wall time {wall:.0f} s\n")
    echo(metrics_table(results))
    written = [paths["json"], paths["markdown"]] + ([paths["png"]] if results else [])
    echo(f"\n[peft-ext] wrote {', '.join(str(p) for p in written)}")
    if failures:
        raise JobFailed(failures, config.output.dir)
    return results
