"""The ``continual`` job (the default of ``peft-ext run``), as named steps: :class:`ContinualJob`.

``ContinualJob(config).run()`` takes these steps, each a method whose inputs and outputs are the job's attributes:

1. :meth:`~ContinualJob.prepare`: the launcher's settings, the config's fingerprint, the methods an earlier run
   finished (``--resume``);
2. :meth:`~ContinualJob.build`: the backbone, the task sequence and its collate (``sequence``, ``base``,
   ``collate``);
3. :meth:`~ContinualJob.preflight`: what must hold before any training (a validation split for ``--tune``), and the
   run's ``meta``;
4. per method, :meth:`~ContinualJob.run_method`: :meth:`~ContinualJob.tune` (``--tune``), the run itself, and
   :meth:`~ContinualJob.save_trained` (the trained model under ``output.dir/adapters/``);
5. :meth:`~ContinualJob.finish`: the closing report, and :class:`~.errors.JobFailed` when a method failed.

What the job tells the world goes through its callbacks, one list (:class:`JobCallback`): :class:`ConsoleLog` prints
progress lines and tables, :class:`ResultsWriter` writes ``results.json`` / ``results.md`` / the heatmap before the
first method and after every one (so they always hold every method finished so far) and drops a finished method's
snapshots. Under ``torchrun`` every process runs the job (:mod:`.launch`); rank 0 alone has these callbacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import platform
import re
import shutil
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..continual.config import MethodEntry, RunConfig
from ..continual.engine import MethodResult
from ..continual.heads.frozen import FrozenFeatures
from ..continual.methods import ContinualMethod, get_continual_method, method_capability
from ..continual.progress import TaskProgress
from ..continual.report import leader_line, matrix_table, metrics_table, noise_line, save_results, time_line
from ..continual.runner import run_sequence
from ..continual.task_kinds import task_kind
from ..continual.trained import save_trained, saved_methods
from ..data.tasks import TaskSequence
from ..distributed import on_rank_zero, rank, rank_zero_first, world_size
from ..fingerprint import json_default
from ..models.kinds import model_kind
from .errors import JobFailed, one_line
from .launch import check_world_size, launcher_sharding
from .resume import config_hash, finished_results
from .saved import default_method
from .sequence import build_sequence, sequence_summary

__all__ = ["ConsoleLog", "ContinualJob", "JobCallback", "ResultsWriter", "effective_settings", "run_job"]


def _silent(*args: Any) -> None:
    """The echo of ranks other than 0."""


def effective_settings(options: Any, train: Any) -> dict[str, Any]:
    """What a method ran with, as plain JSON: its options with every default filled in (after ``--tune``: the chosen
    learning rate) and the training settings (the progress bars aside)."""

    def plain(value: Any) -> Any:
        return json.loads(json.dumps(dataclasses.asdict(value), default=json_default))

    settings = {"options": plain(options), "train": plain(train)}
    settings["train"].pop("progress", None)
    return settings


def method_progress(config: RunConfig, index: int, name: str, label: str, fingerprint: str) -> TaskProgress:
    """Where method ``index`` of the job keeps its end-of-task snapshots: ``output.dir/progress/{index}-{label}``."""
    folder = f"{index:02d}-{re.sub(r'[^A-Za-z0-9_.+-]', '_', label)}"
    identity: dict[str, Any] = {"method": name, "label": label, "config_hash": fingerprint}
    if world_size() > 1:  # only then: the snapshots of one-process runs (older ones too) carry no world size
        identity["world_size"] = world_size()
    return TaskProgress(Path(config.output.dir) / "progress" / folder, identity)


class JobCallback:
    """A listener at the job's named points; every method is a no-op, so a callback overrides what it needs."""

    def on_start(self, job: ContinualJob) -> None:
        """The sequence and backbone are built and ``job.meta`` is set; no method has run."""

    def on_method_start(self, job: ContinualJob, label: str, note: str) -> None:
        """Method ``label`` starts (``note``: what the job knows of it, e.g. resumed after 2 tasks)."""

    def on_message(self, job: ContinualJob, line: str) -> None:
        """A line the job has to say (a setting it chose, a method it skips, a method that failed)."""

    def on_method_end(
        self, job: ContinualJob, result: Optional[MethodResult], progress: Optional[TaskProgress]
    ) -> None:
        """A method ended: ``result`` (``None``: it failed, see ``job.failures``), and its snapshots' folder when it
        finished in this run."""

    def on_end(self, job: ContinualJob) -> None:
        """Every method ran; ``job.results`` and ``job.failures`` are final."""


class ConsoleLog(JobCallback):
    """Progress lines and tables, through ``echo`` (``print`` by default)."""

    def __init__(self, echo: Callable[[str], Any] = print) -> None:
        self.echo = echo

    def on_start(self, job: ContinualJob) -> None:
        first, *tasks = sequence_summary(job.config.name, job.sequence)
        self.echo(f"[peft-ext] {first}")
        for line in tasks:
            self.echo(line)

    def on_method_start(self, job: ContinualJob, label: str, note: str) -> None:
        self.echo(f"\n[peft-ext] method {label}{note}")

    def on_message(self, job: ContinualJob, line: str) -> None:
        self.echo(line)

    def on_method_end(
        self, job: ContinualJob, result: Optional[MethodResult], progress: Optional[TaskProgress]
    ) -> None:
        if result is not None:
            self.echo(matrix_table(result))

    def on_end(self, job: ContinualJob) -> None:
        self.echo(f"\n[peft-ext] metrics (percent), {len(job.sequence)} tasks, wall time {job.wall_seconds():.0f} s\n")
        self.echo(metrics_table(job.results))
        self.echo("\n" + time_line(job.results, job.phase_seconds, job.wall_seconds()))
        for line in (noise_line(job.results, job.meta["test_examples"]), leader_line(job.results)):
            if line:
                self.echo("\n" + line)


class ResultsWriter(JobCallback):
    """``results.json`` and ``results.md`` in ``output.dir``: written before the first method (with the config's
    fingerprint, so an interruption during the first method is resumable) and after every one; then a finished
    method's snapshots are dropped (its result is on disk). ``accuracy_matrix.png`` is drawn once, when every method
    ran (``peft-ext table`` and the results file have everything it shows before that). Under several processes every
    process calls it and rank 0 writes while the others wait (:func:`~peft_ext.distributed.on_rank_zero`)."""

    def __init__(self, echo: Callable[[str], Any] = print) -> None:
        self.echo = echo
        self.paths: Optional[dict[str, Path]] = None

    def _write(
        self, job: ContinualJob, results: Sequence[MethodResult], finished: Optional[TaskProgress], plot: bool = False
    ) -> None:
        job.meta["wall_seconds"] = round(job.wall_seconds(), 1)
        job.meta["phase_seconds"] = {name: round(seconds, 1) for name, seconds in job.phase_seconds.items()}

        def write() -> dict[str, Path]:
            paths = save_results(results, job.config.output.dir, job.meta, job.task_names, job.failures, plot=plot)
            if finished is not None:
                shutil.rmtree(finished.directory, ignore_errors=True)
            return paths

        with job.timed("writing results"):
            self.paths = on_rank_zero(write)

    def on_start(self, job: ContinualJob) -> None:
        self._write(job, list(job.done.values()), None)

    def on_method_end(
        self, job: ContinualJob, result: Optional[MethodResult], progress: Optional[TaskProgress]
    ) -> None:
        self._write(job, job.results, progress)

    def on_end(self, job: ContinualJob) -> None:
        self._write(job, job.results, None, plot=True)  # the heatmap, and the final wall time
        folder = Path(job.config.output.dir) / "progress"
        on_rank_zero(lambda: folder.rmdir() if folder.is_dir() and not any(folder.iterdir()) else None)
        if self.paths is None:  # not rank 0
            return
        written = [self.paths["json"], self.paths["markdown"]] + ([self.paths["png"]] if job.results else [])
        self.echo(f"\n[peft-ext] wrote {', '.join(str(p) for p in written)}")
        saved = saved_methods(job.config.output.dir)
        if saved and job.saves_trained:
            output = Path(job.config.output.dir)
            best, _, split = default_method(output, saved)
            split = split or "test"  # no method was scored: the first saved (as before)
            self.echo(
                f"[peft-ext] trained models of {', '.join(saved)} in {output / 'adapters'}/: classify new texts with "
                f"`peft-ext predict {output} TEXTS.txt` (it uses {best}, the best continual method of this run on "
                f"the {split} split; --method picks another; docs/own_data.md)"
            )


class ContinualJob:
    """Every method of ``config`` on the same sequence and backbone, as named steps (see the module docstring).

    Args:
        config: The validated run config.
        echo: Where progress lines go (rank 0).
        debug: Print the traceback of a failed method (stderr).
        resume: Keep the methods an earlier run of the same config finished (its ``results.json`` in
            ``output.dir``), continue an unfinished one after its last finished task, and run the others
            (:mod:`peft_ext.jobs.resume`).
        callbacks: The listeners (default: :class:`ConsoleLog` and :class:`ResultsWriter` on ``echo``). Every
            process calls them; ``echo`` is silent off rank 0, and files are written by rank 0 alone.
    """

    def __init__(
        self,
        config: RunConfig,
        echo: Callable[[str], Any] = print,
        debug: bool = False,
        resume: bool = False,
        callbacks: Optional[list[JobCallback]] = None,
    ) -> None:
        self.config = config
        self.debug = debug
        self.resume = resume
        if rank() != 0:
            echo = _silent
        self.callbacks = callbacks if callbacks is not None else [ConsoleLog(echo), ResultsWriter(echo)]
        self.start = time.perf_counter()
        self.fingerprint = ""
        self.done: dict[tuple[str, str], MethodResult] = {}
        self.sequence: Optional[TaskSequence] = None
        self.base: Optional[torch.nn.Module] = None
        self.collate: Any = None
        self.frozen_features: Optional[FrozenFeatures] = None
        self.meta: dict[str, Any] = {}
        self.results: list[MethodResult] = []
        self.failures: list[dict[str, str]] = []
        #: Seconds of the job's own phases, outside the methods' training and evaluation (the closing report).
        self.phase_seconds = {"model and data": 0.0, "saving adapters": 0.0, "writing results": 0.0}

    # --- what the steps share ---------------------------------------------------------------------------------------

    def emit(self, event: str, *args: Any) -> None:
        """Call ``event`` on every callback."""
        for callback in self.callbacks:
            getattr(callback, event)(self, *args)

    def say(self, line: str) -> None:
        self.emit("on_message", line)

    def wall_seconds(self) -> float:
        return time.perf_counter() - self.start

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the block's wall time to ``phase_seconds[phase]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + time.perf_counter() - start

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.sequence.tasks]

    @property
    def sharded(self) -> bool:
        """Whether methods train on FSDP2 shards (``train.sharding: fsdp2`` on several processes)."""
        return self.config.train.sharding == "fsdp2" and world_size() > 1

    @property
    def saves_trained(self) -> bool:
        """Whether each method's trained model is saved (``output.save_adapters``; not under FSDP2 sharding)."""
        return self.config.output.save_adapters and not self.sharded

    # --- the steps -------------------------------------------------------------------------------------------------

    def run(self) -> list[MethodResult]:
        """Every step in order; returns the finished methods' results (every process returns the same).

        Raises:
            JobFailed: After every method ran, when at least one failed.
            ConfigError: ``resume`` with no results, or results of a different config or number of processes, in
                ``output.dir``.
        """
        self.prepare()
        with self.timed("model and data"):
            self.build()
        self.preflight()
        self.emit("on_start")
        self.announce()
        for index, entry in enumerate(self.config.methods):
            result, progress = self.run_method(index, entry)
            if result is not None:
                self.results.append(result)
            self.emit("on_method_end", result, progress)
        self.finish()
        return self.results

    def prepare(self) -> None:
        """The launcher's settings (FSDP2 from ``accelerate launch``), no progress bars off rank 0, the config's
        fingerprint and, with ``resume``, the methods the earlier run finished."""
        config = self.config
        if world_size() > 1:
            config = launcher_sharding(config)
        if rank() != 0:
            config = dataclasses.replace(config, train=dataclasses.replace(config.train, progress=False))
        self.config = config
        if world_size() > 1:
            dist.barrier()  # every process has checked `output.dir` (claim_output_dir) before rank 0 writes into it
        self.fingerprint = config_hash(config)
        if self.resume:
            self.done = {(r.method, r.label): r for r in finished_results(config, self.fingerprint)}
            check_world_size(config.output.dir)

    def build(self) -> None:
        """``sequence`` (tokenized once for your files), ``base`` (the backbone) and ``collate``."""
        config = self.config
        kind = model_kind(config.model.kind)
        # the kind loads the backbone before or after the sequence (a causal LM's tokenizer renders conversational
        # rows); reading user files fills the `datasets` cache, which the other processes then only read
        self.base, tokenizer, sequence = kind.load_for_job(
            config.model,
            lambda tokenizer: rank_zero_first(lambda: build_sequence(config, tokenizer)),
            seed=config.train.seed,
        )
        if config.data.dataset == "files":  # tokenized once (cached by `datasets`), not by every method's collate
            from ..data.user_data import tokenize_sequence

            tokenize = functools.partial(
                tokenize_sequence, sequence, tokenizer, config.model.max_length, config.train.progress
            )
            sequence = rank_zero_first(tokenize)
        if task_kind(sequence).measures_held_out_text and not sequence.held_out_text:
            from ..data.held_out import held_out_text

            # what the sequence costs the model's general ability: perplexity of text no task trains on
            sequence.held_out_text = list(held_out_text())
        self.sequence = sequence
        self.collate = kind.collate(config.model, tokenizer)
        # the methods that train nothing read the same backbone's features: computed once for the job
        self.frozen_features = FrozenFeatures()

    def preflight(self) -> None:
        """What must hold before any training (``--tune``: every task has validation examples), and ``meta``."""
        config, sequence = self.config, self.sequence
        if config.tune.enabled:
            from .tuning import validation_sequence

            validation_sequence(sequence, config.tune.protocol)
        self.meta = {
            "name": config.name,
            "sequence": sequence.name,
            "protocol": sequence.protocol,
            "sequence_meta": sequence.meta,
            "backbone": config.model.backbone,
            "wall_seconds": 0.0,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "config_hash": self.fingerprint,
            "world_size": world_size(),
            "test_examples": [len(t.test) for t in sequence.tasks],
        }
        if config.train.sharding != "none":
            self.meta["sharding"] = config.train.sharding

    def announce(self) -> None:
        """The lines that say what the job chose for the whole run (truncated texts, FSDP2)."""
        truncated = self.sequence.meta.get("truncated")
        if truncated:
            total = sum(len(t.train) + len(t.test) + len(t.validation) for t in self.sequence.tasks)
            self.say(
                f"  {truncated} of {total} distinct texts are longer than model.max_length="
                f"{self.config.model.max_length} tokens and are truncated to it (raise model.max_length to keep more)"
            )
        if self.sharded:
            self.say(f"  FSDP2: each method's parameters sharded over {world_size()} processes while it trains")
            if self.config.output.save_adapters:
                self.say(
                    "  trained models are not saved under FSDP2 sharding (output.save_adapters): run on one process"
                )

    def tune(self, entry: MethodEntry, method: ContinualMethod) -> tuple[ContinualMethod, Optional[dict[str, Any]]]:
        """``--tune``: the method with the learning rate (and setting) chosen on validation, and what was chosen; a
        method that trains nothing has no learning rate to tune and comes back as it is."""
        if not (self.config.tune.enabled and method.trains):
            return method, None
        from .tuning import tune_methods, tuned_options

        tuned = tune_methods(self.config, [entry], self.sequence, self.base, self.collate, self.fingerprint, self.say)
        chosen = tuned[method.label]
        return get_continual_method(entry.name)(tuned_options(entry, chosen)), chosen

    def run_method(self, index: int, entry: MethodEntry) -> tuple[Optional[MethodResult], Optional[TaskProgress]]:
        """One method: its result (read back when the run being resumed finished it), and its snapshots' folder
        when it finished here; a method that raises is recorded in ``failures`` (its snapshots kept) and ``(None,
        None)`` returned, so the next method runs."""
        label = entry.name
        try:
            method = get_continual_method(entry.name)(entry.options)
            label = method.label
            if (method.name, label) in self.done:
                self.emit("on_method_start", label, ": finished in the run being resumed")
                return self.done[(method.name, label)], None
            progress = method_progress(self.config, index, method.name, label, self.fingerprint)
            record = progress.record(len(self.sequence))
            note = f": resuming after {record.completed} finished task(s)" if record.completed else ""
            self.emit("on_method_start", label, note)
            if self.sharded and method.needs_whole_parameters:
                self.say(
                    f"  {label} trains with whole parameters on every process (data-parallel), not FSDP2 shards: "
                    f"{method.needs_whole_parameters}"
                )
            method, tuned = self.tune(entry, method)
            keep = functools.partial(self.save_trained, label, method.name) if self.saves_trained else None
            result = run_sequence(
                self.sequence,
                method,
                self.base,
                self.collate,
                self.config.train,
                progress=progress,
                keep=keep,
                frozen_features=self.frozen_features,
            )
        except Exception as err:  # a failed method is recorded and the others still run
            if self.debug:
                traceback.print_exc()
            self.failures.append({"method": entry.name, "label": label, "error": one_line(err)})
            self.say(f"[peft-ext] method {label} failed: {one_line(err)}")
            return None, None
        if tuned is not None:
            result.extras["tuning"] = tuned
        result.extras["settings"] = effective_settings(method.options, self.config.train)
        return result, progress

    def save_trained(self, label: str, method: str, model: torch.nn.Module, head: Any, result: MethodResult) -> None:
        """Save one method's trained model under ``output.dir/adapters/<label>`` (rank 0;
        :mod:`..continual.trained`)."""
        if rank() != 0:
            return
        config, sequence = self.config, self.sequence
        kind = model_kind(config.model.kind)
        description = {
            "kind": kind.name,
            "method": method,
            "label": label,
            "backbone": config.model.backbone,
            "num_classes": sequence.num_classes,
            "class_names": list(sequence.class_names),
            "dropout": config.model.dropout,
            "seed": config.train.seed,
            "max_length": config.model.max_length,
            "final_acc": result.metrics.get("final_acc"),
            # what `peft-ext predict` chooses a method by, when the sequence has a validation split
            "final_val_acc": result.extras.get("final_validation", {}).get("acc"),
            "config": config.name,
            **kind.saved_settings(config.model),  # a causal LM's prompt settings
        }
        folder = re.sub(r"[^\w.+-]", "_", label)
        merge = method_capability(method, "rewraps_model")  # earlier tasks live in the backbone, not the adapter
        with self.timed("saving adapters"):
            save_trained(
                Path(config.output.dir) / "adapters" / folder, model, head, self.base, description, merge=merge
            )

    def finish(self) -> None:
        """The closing report (callbacks), then :class:`JobFailed` when a method failed."""
        self.emit("on_end")
        if self.failures:
            raise JobFailed(self.failures, self.config.output.dir)


def run_job(
    config: RunConfig, echo: Callable[[str], Any] = print, debug: bool = False, resume: bool = False
) -> list[MethodResult]:
    """``ContinualJob(config, echo, debug, resume).run()``: every method of ``config``, its results written."""
    return ContinualJob(config, echo, debug, resume).run()
