"""The ``continual`` job (the default of ``peft-ext run``): build the task sequence and the backbone from a
:class:`~peft_ext.continual.config.RunConfig`, run every method, report.

Launched by ``torchrun`` or ``accelerate launch`` (``WORLD_SIZE`` > 1 in the environment), every process runs the job
and :func:`job_processes` joins them into a process group: each method trains data-parallel
(:func:`~peft_ext.continual.runner.train_examples`), rank 0 alone prints and writes, and the others wait for it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import re
import shutil
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..continual.config import ConfigError, RunConfig
from ..continual.engine import MethodResult
from ..continual.methods import get_continual_method
from ..continual.progress import TaskProgress
from ..continual.report import leader_line, matrix_table, metrics_table, noise_line, save_results
from ..continual.runner import run_sequence
from ..continual.sharding import sharding_from_launcher
from ..continual.trained import save_trained, saved_methods
from ..data import SHIPPED
from ..data.tasks import TaskSequence
from ..distributed import on_rank_zero, rank, rank_zero_first, world_size
from .errors import JobFailed, one_line
from .resume import _plain, config_hash, finished_results

#: The ``data`` keys every class-incremental sequence (a shipped data set or your files) is built from.
CLASS_SEQUENCE_KEYS = (
    "n_tasks",
    "classes_per_task",
    "classes",
    "seed",
    "train_per_class",
    "test_per_class",
    "protocol",
)


def _keys(section: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """``{name: section.name}`` for ``names``."""
    return {name: getattr(section, name) for name in names}


def build_sequence(config: RunConfig, tokenizer: Any = None) -> TaskSequence:
    """The task sequence the config's ``data`` section describes (``tokenizer``: renders conversational instruction
    rows with its chat template)."""
    data = config.data
    if data.dataset == "instructions":
        from ..data.user_instructions import instruction_sequence_from_files

        return instruction_sequence_from_files(
            data.tasks,
            None if data.tasks is not None else data.train,
            task_column=data.task_column,
            tokenizer=tokenizer,
            test_share=data.test_share,
            validation_share=data.validation_share,
            seed=data.seed,
            name=config.name,
        )
    if data.dataset in SHIPPED:  # wordnet, fortunes: files that ship with the package
        return SHIPPED[data.dataset].task_sequence(
            **_keys(data, CLASS_SEQUENCE_KEYS), val_per_class=data.val_per_class or 0
        )
    if data.dataset == "files":
        from ..data.user_data import file_task_sequence

        return file_task_sequence(
            data.train,
            data.test,
            data.validation,
            **_keys(data, (*CLASS_SEQUENCE_KEYS, "text_column", "label_column", "task_column", "test_share")),
            validation_share=data.validation_share,
            name=config.name,
        )
    raise ValueError(f"unknown dataset {data.dataset!r}")  # unreachable: the config's Literal type checks it


def effective_settings(options: Any, train: Any) -> dict[str, Any]:
    """What a method ran with, as plain JSON: its options with every default filled in (after ``--tune``: the chosen
    learning rate) and the training settings (the progress bars aside)."""

    def plain(value: Any) -> Any:
        return json.loads(json.dumps(dataclasses.asdict(value), default=_plain))

    settings = {"options": plain(options), "train": plain(train)}
    settings["train"].pop("progress", None)
    return settings


def sequence_summary(name: str, sequence: TaskSequence) -> list[str]:
    """The lines that say what a job's task sequence is: tasks, classes, examples per split, then each task's name
    (``peft-ext run`` prints them when it starts, ``peft-ext check`` when the config is valid)."""
    count = {split: sum(len(getattr(t, split)) for t in sequence.tasks) for split in ("train", "validation", "test")}
    how = (
        "instruction tasks, scored by exact match of the generated answers"
        if sequence.kind == "generation"
        else sequence.protocol
    )
    head = (
        f"{name}: {sequence.name} ({how}), {len(sequence)} tasks, {sequence.num_classes} classes, "
        f"{count['train']} train / "
        + (f"{count['validation']} validation / " if count["validation"] else "")
        + f"{count['test']} test examples"
    )
    return [head, *(f"  t{i}: {task.name}" for i, task in enumerate(sequence.tasks))]


def separator_id(tokenizer: Any, token: str | None) -> int:
    """The id of the token that ends every prompt of an instruction sequence: ``token`` (``model.separator``), else
    the tokenizer's separator token.

    Raises:
        ValueError: ``token`` is not one token of the vocabulary, or neither is set.
    """
    if token is None:
        if getattr(tokenizer, "sep_token_id", None) is None:
            raise ValueError(
                f"the tokenizer ({type(tokenizer).__name__}) has no separator token to end prompts with: set "
                "`model.separator` to a special token of its vocabulary that no prompt contains (e.g. an unused "
                "reserved token)"
            )
        return int(tokenizer.sep_token_id)
    ids = tokenizer.convert_tokens_to_ids([token])
    unk = getattr(tokenizer, "unk_token_id", None)
    if not ids or ids[0] is None or (unk is not None and ids[0] == unk and token != tokenizer.unk_token):
        raise ValueError(f"`model.separator` {token!r} is not a token of the tokenizer's vocabulary")
    return int(ids[0])


def method_progress(config: RunConfig, index: int, name: str, label: str, fingerprint: str) -> TaskProgress:
    """Where method ``index`` of the job keeps its end-of-task snapshots: ``output.dir/progress/{index}-{label}``."""
    folder = f"{index:02d}-{re.sub(r'[^A-Za-z0-9_.+-]', '_', label)}"
    identity: dict[str, Any] = {"method": name, "label": label, "config_hash": fingerprint}
    if world_size() > 1:  # only then: the snapshots of one-process runs (older ones too) carry no world size
        identity["world_size"] = world_size()
    return TaskProgress(Path(config.output.dir) / "progress" / folder, identity)


@contextmanager
def job_processes(config: Any) -> Iterator[None]:
    """Join the process group that ``torchrun`` / ``accelerate launch`` describe in the environment (``WORLD_SIZE``,
    ``RANK``, ``MASTER_ADDR``, ...) for the block, and leave it after; nothing happens for one process or when a
    group is already initialized (a script that calls the job itself).

    The backend is gloo on CPUs; with CUDA, each process takes the GPU of its ``LOCAL_RANK`` and CUDA tensors go
    through NCCL while CPU tensors (flags, random states) still go through gloo.

    Args:
        config: The job's config (a continual one: the other jobs run on one process).

    Raises:
        ConfigError: Several processes for a job other than ``continual``, or a ``train.device`` that names one GPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or (dist.is_available() and dist.is_initialized()):
        yield
        return
    if not isinstance(config, RunConfig):
        raise ConfigError(
            f"this job runs on one process, but WORLD_SIZE={world}: only `job: continual` runs data-parallel under "
            "torchrun / accelerate launch; start it with plain `peft-ext run`"
        )
    if config.train.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(
            f"`train.device` {config.train.device!r} would put all {world} processes on one GPU; use 'auto' or 'cuda' "
            "(each process takes the GPU of its LOCAL_RANK) or 'cpu'"
        )
    backend = "gloo"
    if config.train.device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend)
    try:
        yield
    finally:
        dist.destroy_process_group()


def launcher_sharding(config: RunConfig) -> RunConfig:
    """``config`` with ``train.sharding: fsdp2`` when ``accelerate launch`` runs the job with an FSDP2 config.

    Raises:
        ConfigError: The accelerate config asks for FSDP1.
    """
    try:
        by_launcher = sharding_from_launcher()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if by_launcher is None or config.train.sharding == by_launcher:
        return config
    return dataclasses.replace(config, train=dataclasses.replace(config.train, sharding=by_launcher))


def check_world_size(out_dir: str) -> None:
    """Refuse to resume, on a different number of processes, a run whose ``results.json`` names another.

    Each process trains on its share of every batch, so the rounding (and, with dropout, the random draws) depend on
    the number of processes: a resumed run equals the uninterrupted one only on the same number.

    Raises:
        ConfigError: The stored ``world_size`` (1 when absent: runs from before it was stored) differs.
    """
    try:
        stored = json.loads((Path(out_dir) / "results.json").read_text())["meta"].get("world_size", 1)
    except (OSError, ValueError, KeyError, AttributeError):
        return  # finished_results already said what is wrong with the file
    if stored != world_size():
        launch = "plain `peft-ext run`" if stored == 1 else f"`torchrun --nproc_per_node {stored} -m peft_ext run`"
        raise ConfigError(
            f"--resume: the run in {out_dir!r} was made on {stored} process(es), this one has {world_size()}; a "
            f"resumed run must use the same number to equal an uninterrupted one: resume it with {launch} (or start "
            "over with --overwrite)"
        )


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

    Under ``torch.distributed`` with several processes (:func:`job_processes`) every process calls this; only rank 0
    echoes, shows progress bars and writes, and every process returns the same results.

    Raises:
        JobFailed: After every method ran, when at least one failed.
        ConfigError: ``resume`` with no results, or results of a different config or number of processes, in
            ``output.dir``.
    """
    from ..data.collate import CausalLMCollator, TextCollator
    from ..models import load_causal_lm, load_text_classifier

    start = time.perf_counter()
    if world_size() > 1:
        config = launcher_sharding(config)
    if rank() != 0:
        echo = _silent
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, progress=False))
    if world_size() > 1:
        dist.barrier()  # every process has checked `output.dir` (claim_output_dir) before rank 0 writes into it
    fingerprint = config_hash(config)
    done = {(r.method, r.label): r for r in finished_results(config, fingerprint)} if resume else {}
    if resume:
        check_world_size(config.output.dir)
    causal = config.model.kind == "causal_lm"
    if causal:  # the tokenizer renders conversational rows, so it comes first
        base, tokenizer = load_causal_lm(config.model.backbone, config.model.dtype, config.model.load_in_4bit)
    else:
        tokenizer = None
    # reading user files fills the `datasets` cache, which the other processes then only read
    sequence = rank_zero_first(lambda: build_sequence(config, tokenizer))
    first, *tasks = sequence_summary(config.name, sequence)
    echo(f"[peft-ext] {first}")
    for line in tasks:
        echo(line)
    if not causal:
        base, tokenizer = load_text_classifier(
            config.model.backbone, sequence.num_classes, config.model.dropout, seed=config.train.seed
        )
    if config.data.dataset == "files":
        # tokenized once (cached by `datasets`), not by every method's collate
        from ..data.user_data import tokenize_sequence

        sequence = rank_zero_first(
            functools.partial(tokenize_sequence, sequence, tokenizer, config.model.max_length, config.train.progress)
        )
        if sequence.meta["truncated"]:
            total = sum(len(t.train) + len(t.test) + len(t.validation) for t in sequence.tasks)
            echo(
                f"  {sequence.meta['truncated']} of {total} distinct texts are longer than model.max_length="
                f"{config.model.max_length} tokens and are truncated to it (raise model.max_length to keep more)"
            )
    if config.tune.enabled:  # refused here, before any training, when a task has no validation examples
        from .tuning import validation_sequence

        validation_sequence(sequence, config.tune.protocol)
    if causal:
        separator = separator_id(tokenizer, config.model.separator)
        collate = CausalLMCollator(tokenizer, config.model.max_length, separator, config.model.max_new_tokens)
    else:
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
        "world_size": world_size(),
        "test_examples": [len(t.test) for t in sequence.tasks],
    }
    if config.train.sharding != "none":
        meta["sharding"] = config.train.sharding
    sharded = config.train.sharding == "fsdp2" and world_size() > 1
    if sharded:
        echo(f"  FSDP2: each method's parameters sharded over {world_size()} processes while it trains")
        if config.output.save_adapters:
            echo("  trained models are not saved under FSDP2 sharding (output.save_adapters): run on one process")
    results: list[MethodResult] = []
    failures: list[dict[str, str]] = []
    # The report exists (with the config's fingerprint) before any training, so an interruption during the first
    # method is resumable too.
    paths = on_rank_zero(lambda: save_results(list(done.values()), config.output.dir, meta, task_names))
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
                if sharded and method.needs_whole_parameters:
                    echo(
                        f"  {label} trains with whole parameters on every process (data-parallel), not FSDP2 shards: "
                        f"{method.needs_whole_parameters}"
                    )
                tuned = None
                if config.tune.enabled and method.trains:  # a training-free method has no learning rate to tune
                    from .tuning import tune_methods, tuned_options

                    tuned = tune_methods(config, [entry], sequence, base, collate, fingerprint, echo)[label]
                    method = get_continual_method(entry.name)(tuned_options(entry, tuned))
                keep = None
                if config.output.save_adapters and not sharded:
                    keep = functools.partial(_keep_trained, config, sequence, base, label, method.name)
                result = run_sequence(sequence, method, base, collate, config.train, progress=progress, keep=keep)
                if tuned is not None:
                    result.extras["tuning"] = tuned
                result.extras["settings"] = effective_settings(method.options, config.train)
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
        paths = on_rank_zero(functools.partial(_save, results, config, meta, task_names, failures, finished))
    on_rank_zero(lambda: _remove_empty(Path(config.output.dir) / "progress"))
    wall = time.perf_counter() - start
    echo(f"\n[peft-ext] metrics (percent), {len(sequence)} tasks, wall time {wall:.0f} s\n")
    echo(metrics_table(results))
    noise = noise_line(results, meta["test_examples"])
    if noise:
        echo("\n" + noise)
    leader = leader_line(results)
    if leader:
        echo("\n" + leader)
    if paths is not None:  # rank 0
        written = [paths["json"], paths["markdown"]] + ([paths["png"]] if results else [])
        echo(f"\n[peft-ext] wrote {', '.join(str(p) for p in written)}")
        saved = saved_methods(config.output.dir)
        if saved and config.output.save_adapters and not sharded:
            folder = Path(config.output.dir) / "adapters"
            echo(
                f"[peft-ext] trained models of {', '.join(saved)} in {folder}/: classify new texts with "
                f"`peft-ext predict {folder / saved[0]} TEXTS.txt` (docs/own_data.md)"
            )
    if failures:
        raise JobFailed(failures, config.output.dir)
    return results


def _silent(*args: Any) -> None:
    """The echo of ranks other than 0."""


def _keep_trained(
    config: RunConfig,
    sequence: TaskSequence,
    base: torch.nn.Module,
    label: str,
    method: str,
    model: torch.nn.Module,
    head: Any,
    result: MethodResult,
) -> None:
    """Save one method's trained model under ``output.dir/adapters/<label>`` (rank 0; :mod:`..continual.trained`)."""
    if rank() != 0:
        return
    description = {
        "kind": "causal_lm" if config.model.kind == "causal_lm" else "classifier",
        "method": method,
        "label": label,
        "backbone": config.model.backbone,
        "num_classes": sequence.num_classes,
        "class_names": list(sequence.class_names),
        "dropout": config.model.dropout,
        "seed": config.train.seed,
        "max_length": config.model.max_length,
        "final_acc": result.metrics.get("final_acc"),
        "config": config.name,
    }
    folder = re.sub(r"[^\w.+-]", "_", label)
    save_trained(Path(config.output.dir) / "adapters" / folder, model, head, base, description)


def _save(
    results: list[MethodResult],
    config: RunConfig,
    meta: dict[str, Any],
    task_names: list[str],
    failures: list[dict[str, str]],
    finished: TaskProgress | None,
) -> dict[str, Path]:
    """Write the report; then drop the snapshots of the method just finished (``finished``), now in the report."""
    paths = save_results(results, config.output.dir, meta, task_names, failures)
    if finished is not None:
        shutil.rmtree(finished.directory, ignore_errors=True)
    return paths


def _remove_empty(folder: Path) -> None:
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
