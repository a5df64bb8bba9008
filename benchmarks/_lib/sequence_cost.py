"""Whole continual runs of two methods timed side by side, task by task: the CPU seconds of each run and their ratio.

The runs are the continual benchmark's (:class:`~.continual.Runs`: MiniLM-L6, one seed's WordNet class draw, the
same data, backbone and head initialization for both methods). They take turns task by task (:class:`TakeTurns`):
one thread per run, only one running at a time, so a change in the load of a shared machine weighs on both runs
alike (whole runs one after the other, three minutes each at 10 tasks, moved the ratio by 0.2 between two runs of the
same code). Each thread's own CPU clock times its run; each run keeps its own random generators across the turns, so
it computes what it computes alone. Which run starts alternates from round to round. Used by ``benchmarks/pclr.py
--sequence-cost``::

    cost = sequence_cost(runs, "pclr", "seq_lora", rounds=2)
    print("\\n".join(cost_report(cost, target=1.5)))
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from .continual import Runs
from .tables import markdown_table
from .timing import Ratio

__all__ = ["SequenceCost", "TakeTurns", "cost_report", "sequence_cost"]


#: The phases of a task that :class:`TakeTurns` times apart (the rest of a turn is training and evaluation).
PHASES = ("start of task", "end of task")


class _TurnAtEachTask:
    """A method plugin that hands the turn on before every task but the first (the previous task is then trained,
    integrated and evaluated), and adds its ``before_task`` / ``after_task`` CPU seconds to ``phases``."""

    def __init__(self, method: Any, hand_on: Callable[[], None], phases: dict[str, float]) -> None:
        self.method = method
        self.hand_on = hand_on
        self.phases = phases

    def __getattr__(self, name: str) -> Any:
        return getattr(self.method, name)

    def _timed(self, phase: str, call: Callable[..., Any], *args: Any) -> Any:
        start = time.thread_time()
        try:
            return call(*args)
        finally:
            self.phases[phase] += time.thread_time() - start

    def before_task(self, model: Any, task_id: int, task: Any, ctx: Any) -> Any:
        if task_id > 0:
            self.hand_on()
        return self._timed("start of task", self.method.before_task, model, task_id, task, ctx)

    def after_task(self, model: Any, task_id: int, task: Any, ctx: Any) -> Any:
        return self._timed("end of task", self.method.after_task, model, task_id, task, ctx)


class TakeTurns:
    """Runs in threads that take turns task by task, in ``names`` order; ``cpu[name]`` collects each run's CPU
    seconds per task (its thread's clock, from one turn to the next: the task's training, end of task and
    evaluation; the first also the model's construction).

    Args:
        names: The runs, in the order they take turns.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.cpu: dict[str, list[float]] = {name: [] for name in self.names}
        #: Per run, the CPU seconds of its methods' ``before_task`` and ``after_task`` (:data:`PHASES`) over the run.
        self.phases: dict[str, dict[str, float]] = {name: dict.fromkeys(PHASES, 0.0) for name in self.names}
        self._turn = self.names[0]
        self._done: set[str] = set()
        self._cond = threading.Condition()
        start = (torch.get_rng_state(), random.getstate())
        self._generators = {name: start for name in self.names}  # each run's own, kept across the turns
        self._clock: dict[str, float] = {}

    def wrap(self, name: str) -> Callable[[Any], Any]:
        """``wrap(plugin)`` for :meth:`~.continual.Runs.train`: the run ``name`` hands the turn on at each task."""
        return partial(_TurnAtEachTask, hand_on=partial(self._hand_on, name), phases=self.phases[name])

    def _wait(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == name)
        torch_state, py_state = self._generators[name]
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        self._clock[name] = time.thread_time()

    def _hand_on(self, name: str, finished: bool = False) -> None:
        self.cpu[name].append(time.thread_time() - self._clock[name])
        self._generators[name] = (torch.get_rng_state(), random.getstate())
        with self._cond:
            if finished:
                self._done.add(name)
            i = self.names.index(name)
            waiting = [n for n in self.names[i + 1 :] + self.names[: i + 1] if n not in self._done]
            self._turn = waiting[0] if waiting else ""
            self._cond.notify_all()
        if not finished:
            self._wait(name)

    def run(self, calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        """Run ``calls[name]()`` for every name, taking turns; returns what each returned (re-raises an error)."""
        results: dict[str, Any] = {}
        errors: list[BaseException] = []

        def body(name: str) -> None:
            self._wait(name)
            try:
                results[name] = calls[name]()
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the other run finished
                errors.append(err)
            finally:
                self._hand_on(name, finished=True)

        threads = [threading.Thread(target=body, args=(name,)) for name in self.names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


@dataclass
class SequenceCost:
    """The timed runs of :func:`sequence_cost`.

    Args:
        method: The method whose cost is judged.
        baseline: The method it is compared with.
        rounds: Per round, the order the runs took turns in and :attr:`TakeTurns.cpu`.
        phases: Per round, :attr:`TakeTurns.phases`.
        records: Per method, each round's run record (:meth:`~.continual.Runs.train`).
        describe: The runs' setting in words.
    """

    method: str
    baseline: str
    rounds: list[tuple[list[str], dict[str, list[float]]]]
    records: dict[str, list[dict[str, Any]]]
    describe: str
    phases: list[dict[str, dict[str, float]]] = field(default_factory=list)

    def totals(self, name: str) -> list[float]:
        """CPU seconds of each round's run of ``name``."""
        return [sum(cpu[name]) for _, cpu in self.rounds]

    def ratio(self) -> Ratio:
        """``method`` / ``baseline`` CPU seconds per run, round by round."""
        ours, theirs = self.totals(self.method), self.totals(self.baseline)
        return Ratio([a / b for a, b in zip(ours, theirs)], statistics.median(ours) / statistics.median(theirs))


def sequence_cost(
    runs: Runs, method: str, baseline: str, rounds: int, seed: int = 0, split: str = "test"
) -> SequenceCost:
    """Train ``method`` and ``baseline`` ``rounds`` times each on seed ``seed``'s sequence, taking turns task by task.

    Each method runs at its entry's learning rate (``runs.args.options[name]["lr"]``); the data and the backbone
    are loaded before the first run, so no run's CPU time includes them.

    Args:
        runs: The benchmark's runs (its arguments say the sizes, epochs and methods' options).
        method: The method whose cost is judged (e.g. ``"pclr"``).
        baseline: The method it is compared with (e.g. ``"seq_lora"``).
        rounds: Runs of each method.
        seed: The data draw and head initialization.
        split: The split each run is evaluated on.
    """
    if rounds < 1:
        raise ValueError(f"`rounds` must be >= 1, got {rounds}")
    runs.base(seed)  # loads the sequence and the backbone
    epochs, options = runs.args.epochs, runs.args.options
    records: dict[str, list[dict[str, Any]]] = {baseline: [], method: []}
    timed, phases = [], []
    for i in range(rounds):
        order = [baseline, method] if i % 2 == 0 else [method, baseline]
        turns = TakeTurns(order)
        calls = {
            name: partial(runs.train, name, options[name]["lr"], seed, split, epochs, wrap=turns.wrap(name))
            for name in order
        }
        for name, record in turns.run(calls).items():
            records[name].append(record)
        timed.append((order, turns.cpu))
        phases.append(turns.phases)
    a = runs.args
    describe = (
        f"WordNet supersenses, {a.tasks} tasks x {a.classes_per_task} classes, {a.train_per_class} train / "
        f"{a.test_per_class} {split} glosses per class, {epochs} epochs, batch {a.batch_size}, MiniLM-L6, seed {seed}"
    )
    return SequenceCost(method, baseline, timed, records, describe, phases)


def cost_report(cost: SequenceCost, target: float) -> list[str]:
    """The table of CPU seconds per run (one row per round), CPU seconds per task (mean over the rounds), the
    ratio's summary and the verdict against ``target`` (``method`` CPU s / ``baseline`` CPU s, the median of the
    per-round ratios, at most ``target``)."""
    method, baseline = cost.method, cost.baseline
    head = ["round", "order", f"{baseline} CPU s", f"{method} CPU s", f"{method} / {baseline}"]
    head += [f"{baseline} final acc %", f"{method} final acc %"]
    cells = []
    for i, ((order, _), a, b) in enumerate(zip(cost.rounds, cost.totals(baseline), cost.totals(method))):
        finals = [f"{100 * cost.records[name][i]['metrics']['final_acc']:.1f}" for name in (baseline, method)]
        cells.append([i + 1, " then ".join(order), f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x", *finals])
    lines = [f"\nCPU seconds per whole run, {cost.describe}; the runs take turns task by task, one thread\n"]
    lines.append(markdown_table(head, cells))
    rounds = [cpu for _, cpu in cost.rounds]
    task_cells = []
    for t in range(len(rounds[0][method])):
        a, b = (statistics.fmean(cpu[name][t] for cpu in rounds) for name in (baseline, method))
        task_cells.append([t + 1, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x"])
    lines.append(
        f"\nCPU seconds per task (its training, end of task and evaluation of the tasks seen; mean over {len(rounds)} "
        "round(s)):\n"
    )
    lines.append(
        markdown_table(["task", f"{baseline} CPU s", f"{method} CPU s", f"{method} / {baseline}"], task_cells)
    )
    if cost.phases:
        lines += phase_report(cost)
    ratio = cost.ratio()
    summary = f"\n{method} / {baseline} CPU s per run: median of {len(ratio.per_round)} round(s) {ratio.median:.2f}x"
    if len(ratio.per_round) > 1:
        mean, low, high = ratio.interval
        summary += f", geometric mean {mean:.2f}x [95 % CI {low:.2f}, {high:.2f}]"
    lines.append(summary)
    lines.append(
        f"target: {method} CPU s per run <= {target:.2f}x {baseline}'s (median of the per-round ratios): "
        f"{'met' if ratio.median <= target else 'NOT met'}"
    )
    return lines


def phase_report(cost: SequenceCost) -> list[str]:
    """Where each run's CPU seconds go (mean over the rounds): its method's start of task, end of task, and the rest
    of each turn (the training steps and the evaluation of the tasks seen), with the method's excess over the
    baseline in each."""
    rows, excess = [], {}
    per = {}
    for name in (cost.baseline, cost.method):
        spent = {phase: statistics.fmean(p[name][phase] for p in cost.phases) for phase in PHASES}
        spent["training and evaluation"] = statistics.fmean(cost.totals(name)) - sum(spent.values())
        per[name] = spent
    for phase in per[cost.method]:
        excess[phase] = per[cost.method][phase] - per[cost.baseline][phase]
        rows.append(
            [phase, f"{per[cost.baseline][phase]:.1f}", f"{per[cost.method][phase]:.1f}", f"{excess[phase]:+.1f}"]
        )
    total = sum(excess.values())
    rows.append(
        [
            "whole run",
            *(f"{statistics.fmean(cost.totals(n)):.1f}" for n in (cost.baseline, cost.method)),
            f"{total:+.1f}",
        ]
    )
    head = ["phase", f"{cost.baseline} CPU s", f"{cost.method} CPU s", f"{cost.method} - {cost.baseline}"]
    return [
        f"\nWhere the CPU seconds go (mean over {len(cost.phases)} round(s); start / end of task: the methods' "
        "before_task / after_task, the rest of each turn its training steps and evaluation):\n",
        markdown_table(head, rows),
    ]
