"""Results of a continual run as JSON, a markdown table, console text and a heatmap PNG."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from ..fileperm import atomic_write
from .engine import MethodResult
from .methods import ContinualMethod, method_capability

METRIC_COLUMNS = (
    ("final_acc", "final acc"),
    ("learning_acc", "acc after learning"),
    ("avg_incremental_acc", "avg incr acc"),
    ("bwt", "BWT"),
    ("forgetting", "forgetting"),
)


def _pct(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def _upper_bound(r: MethodResult) -> bool:
    """Whether ``r`` is the run of an upper bound (joint training), by its method's capability."""
    return method_capability(r.method, "is_upper_bound")


def result_metric(r: MethodResult, key: str) -> Optional[float]:
    """``r.metrics[key]``; ``learning_acc`` of results saved before it existed comes from the matrix's diagonal."""
    if key == "learning_acc" and key not in r.metrics and not _upper_bound(r):
        diagonal = [r.accuracy_matrix[i][i] for i in range(len(r.accuracy_matrix))]
        return None if any(x is None for x in diagonal) else sum(diagonal) / len(diagonal)
    return r.metrics.get(key)


def metrics_table(results: Sequence[MethodResult], timings: bool = True) -> str:
    """A markdown table, one row per method: metrics in percent, trainable parameters and (``timings``) wall time
    by phase: training (without the heads), the heads' pass and solves, evaluation.

    Beside final accuracy and forgetting, the mean accuracy on each task right after learning it (the diagonal of the
    accuracy matrix: how well a method learns) and, when an upper bound (``joint``: a method whose
    ``is_upper_bound`` is set) is among ``results``, each method's gap to its final accuracy in points (what continual
    training costs): a method with a high "acc after learning" and a large gap forgets; one with a low "acc after
    learning" does not learn new tasks well. When an
    ``ncm`` run (SimpleCIL: the frozen backbone's class means) is among ``results``, each method's final accuracy
    minus SimpleCIL's, in points: what the method adds over what a user would do without it. A ``head`` column
    appears when some method scores with a head other than its linear classifier.
    """
    joint = next((r.metrics.get("final_acc") for r in results if _upper_bound(r)), None)
    # the reference every method is compared with (ncm: SimpleCIL), by its method's capability
    reference = next((r for r in results if method_capability(r.method, "reference_name", None)), None)
    simplecil = None if reference is None else reference.metrics.get("final_acc")
    reference_name = None if reference is None else method_capability(reference.method, "reference_name", None)
    heads = [head_name(r) for r in results]
    with_heads = any(h != _default_head(r) for h, r in zip(heads, results))
    # a generation sequence scores each task by its metric (exact match, ROUGE-L), not a classifier's accuracy
    generation = bool(results) and all("answer_loss_matrix" in r.extras for r in results)
    titles = [t.replace("acc", "score") if generation else t for _, t in METRIC_COLUMNS]
    # what the sequence cost the model's general ability: held-out perplexity after it / before it
    ppl = [r.extras.get("held_out_perplexity") for r in results]
    titles += ["held-out ppl / base"] if any(p is not None for p in ppl) else []
    columns = [*titles, *(["gap to joint"] if joint is not None else [])]
    if simplecil is not None:
        columns.append(f"vs {reference_name}")
    head = ["method", *(["head"] if with_heads else []), *columns, "trainable params"]
    head += ["train s", "heads s", "eval s"] if timings else []
    align = ["---"] * (2 if with_heads else 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align + ["---:"] * (len(head) - len(align))) + "|"]
    for r, head_used, held_out in zip(results, heads, ppl):
        cells = [
            r.label,
            *([head_used] if with_heads else []),
            *(_pct(result_metric(r, key)) for key, _ in METRIC_COLUMNS),
        ]
        if len(titles) > len(METRIC_COLUMNS):
            cells.append("—" if held_out is None else f"{held_out['ratio']:.3f}")
        final = r.metrics.get("final_acc")
        if joint is not None:
            cells.append("—" if _upper_bound(r) or final is None else _pct(joint - final))
        if simplecil is not None:
            cells.append("—" if r is reference or final is None else f"{100 * (final - simplecil):+.1f}")
        cells.append(f"{r.trainable_params:,}")
        if timings:
            cells += [f"{r.train_seconds - r.head_seconds:.1f}", f"{r.head_seconds:.1f}", f"{r.eval_seconds:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _default_head(result: MethodResult) -> str:
    return method_capability(result.method, "default_head", ContinualMethod.default_head)


def head_name(result: MethodResult) -> str:
    """The head that scored ``result``'s accuracy matrix (its method's default head for results from before heads
    were recorded)."""
    head = result.extras.get("head")
    return head.get("name", _default_head(result)) if isinstance(head, dict) else _default_head(result)


def heads_table(results: Sequence[MethodResult]) -> str:
    """A markdown table of the heads each method also scored on its run (``compare_heads``): final accuracy and
    forgetting (percent) per head, the method's own head first; ``""`` when no method compared heads."""
    compared = [r for r in results if isinstance(r.extras.get("heads"), dict)]
    if not compared:
        return ""
    names: list[str] = []
    for r in compared:
        names += [n for n in [head_name(r), *r.extras["heads"]] if n not in names]
    lines = [
        "| method | " + " | ".join(f"{n} final / forgetting" for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for r in compared:
        rows = {head_name(r): r.metrics, **{n: d["metrics"] for n, d in r.extras["heads"].items()}}
        cells = [
            "—" if n not in rows else f"{_pct(rows[n].get('final_acc'))} / {_pct(rows[n].get('forgetting'))}"
            for n in names
        ]
        lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tuning_table(results: Sequence[MethodResult]) -> str:
    """A markdown table of the learning rates ``--tune`` chose, one row per tuned method: the protocol, the chosen lr
    and the validation accuracy (percent) of every grid point, in lr order; ``""`` when no method was tuned."""
    tuned = [(r, r.extras["tuning"]) for r in results if isinstance(r.extras.get("tuning"), dict)]
    if not tuned:
        return ""
    settings = any("setting" in tuning for _, tuning in tuned)
    head = ["method", "protocol", "chosen lr", "validation acc per lr"]
    head += ["setting tuned at the chosen lr: chosen (validation acc per value)"] if settings else []
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---|" + ("---|" if settings else "")]
    for r, tuning in tuned:
        grid = sorted(tuning["validation"].items(), key=lambda kv: float(kv[0]))
        scores = ", ".join(f"{float(lr):.3g}: {_pct(acc)}" for lr, acc in grid)
        chosen = f"{float(tuning['lr']):.3g}" + (f" ({tuning['edge']} edge of the grid)" if tuning.get("edge") else "")
        cells = [r.label, tuning["protocol"], chosen, scores]
        if settings:
            setting = tuning.get("setting")
            if setting is None:
                cells.append("—")
            else:
                values = ", ".join(f"{v}: {_pct(acc)}" for v, acc in setting["validation"].items())
                cells.append(f"`{setting['key']}` {json.dumps(setting['value'])} ({values})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def matrix_table(result: MethodResult, task_names: Sequence[str] | None = None) -> str:
    """The accuracy matrix R[i][j] (percent) as a markdown table: rows = after training task i."""
    T = len(result.accuracy_matrix)
    names = list(task_names) if task_names else [f"t{j}" for j in range(T)]
    lines = ["| after \\ on | " + " | ".join(f"t{j}" for j in range(T)) + " |", "|---|" + "---:|" * T]
    for i, row in enumerate(result.accuracy_matrix):
        lines.append(f"| {names[i]} | " + " | ".join(_pct(x) for x in row) + " |")
    return "\n".join(lines)


def plot_accuracy_matrices(results: Sequence[MethodResult], path: str | Path, title: str = "") -> Path:
    """One heatmap per method of R[i][j] (percent), side by side, saved as a PNG.

    Uses matplotlib's object API (no pyplot), so it never changes the backend of the caller (e.g. a notebook's inline
    plotting) and needs no display.
    """
    import numpy as np
    from matplotlib.figure import Figure

    n = len(results)
    if n == 0:
        raise ValueError("no results to plot")
    T = len(results[0].accuracy_matrix)
    size = max(3.2, 0.55 * T + 1.8)
    cols = min(n, 4)  # at most four heatmaps per row
    rows = -(-n // cols)
    fig = Figure(figsize=(size * cols + 1.0, (size + 0.4) * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_axis_off()
    for ax, r in zip(flat, results):
        M = np.array([[np.nan if x is None else 100 * x for x in row] for row in r.accuracy_matrix], dtype=float)
        im = ax.imshow(M, vmin=0, vmax=100, cmap="viridis")
        for i in range(T):
            for j in range(T):
                if not np.isnan(M[i, j]):
                    ax.text(
                        j,
                        i,
                        f"{M[i, j]:.0f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if M[i, j] < 60 else "black",
                    )
        ax.set_title(f"{r.label}\nfinal {_pct(r.metrics.get('final_acc'))}%", fontsize=9)
        ax.set_xlabel("evaluated on task j")
        ax.set_ylabel("after training task i")
        ax.set_xticks(range(T))
        ax.set_yticks(range(T))
    fig.colorbar(im, ax=flat, shrink=0.8, label="accuracy %")
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png", bbox_inches="tight"))
    return path


def noise_line(results: Sequence[MethodResult], test_examples: Sequence[int]) -> str:
    """What one run's accuracies can and cannot tell apart: the test examples per task, what one example is worth,
    and the binomial 95 % half-width of a difference between two methods' final accuracies (taken as independent, at
    the methods' mean accuracy); a paired protocol over several draws (the benchmarks) tells more."""
    total = sum(test_examples)
    finals = [r.metrics["final_acc"] for r in results if r.metrics.get("final_acc") is not None]
    if not total or not finals:
        return ""
    p = sum(finals) / len(finals)
    half = 100 * 1.96 * math.sqrt(2 * p * (1 - p) / total)
    sizes = sorted(set(test_examples))
    per_task = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    return (
        f"Test examples: {per_task} per task, {total} in all (one example is {100 / min(test_examples):.1f} points of "
        f"its task). Two methods' final accuracies on this one run differ by chance by up to about ±{half:.1f} points "
        "(binomial 95 %): smaller differences are ties; the benchmarks compare methods over several class draws."
    )


def phase_totals(results: Sequence[MethodResult]) -> tuple[float, float, float]:
    """The methods' seconds summed by phase: training (without the heads), the heads, evaluation."""
    heads = sum(r.head_seconds for r in results)
    return sum(r.train_seconds for r in results) - heads, heads, sum(r.eval_seconds for r in results)


def time_line(results: Sequence[MethodResult], phases: dict[str, float], wall: float) -> str:
    """Where a job's ``wall`` seconds went: the methods' training, heads and evaluation (the sums of the table's
    columns), the job's own ``phases`` (loading the model and data, saving adapters, writing results) and the rest,
    which is each method's model being built (a copy of the backbone wrapped in its adapter) and the callbacks."""
    train, heads, evaluation = phase_totals(results)
    rest = wall - train - heads - evaluation - sum(phases.values())
    parts = [f"training {train:.0f} s", f"heads {heads:.0f} s", f"evaluation {evaluation:.0f} s"]
    own = [f"{name} {seconds:.0f} s" for name, seconds in phases.items()]
    return (
        f"[peft-ext] where the {wall:.0f} s went: {', '.join(parts)} (the methods' sums); {', '.join(own)}; "
        f"the rest {rest:.0f} s (building each method's model, progress output)"
    )


def paired_final(a: MethodResult, b: MethodResult) -> Optional[tuple[float, float, float]]:
    """``a``'s final accuracy minus ``b``'s in points with its 95 % interval, paired over the same test examples
    (each task's mean difference weighted as the final accuracy weights it, the variance summed over tasks), or
    ``None`` when either run did not record which examples it got right (``extras.final_correct``)."""
    ha, hb = a.extras.get("final_correct"), b.extras.get("final_correct")
    if not ha or not hb or [len(x) for x in ha] != [len(x) for x in hb]:
        return None
    tasks = len(ha)
    diff = var = 0.0
    for ta, tb in zip(ha, hb):
        d = [int(x) - int(y) for x, y in zip(ta, tb)]
        n = len(d)
        mean = sum(d) / n
        s2 = sum((v - mean) ** 2 for v in d) / (n - 1) if n > 1 else 0.0
        diff += mean / tasks
        var += s2 / n / tasks**2
    half = 1.96 * math.sqrt(var)
    return 100 * diff, 100 * (diff - half), 100 * (diff + half)


def leader_line(results: Sequence[MethodResult]) -> str:
    """Who won on final accuracy, said only as far as the run shows it: the leader is named as ahead of a method only
    when the paired 95 % interval over the same test examples clears 0; the others are ties. Joint training
    (``is_upper_bound``: ``joint``, trained on every task at once, a reference rather than a contender) is left
    out; ``""`` when fewer than two methods recorded their per-example outcomes."""
    ranked = sorted(
        (r for r in results if not _upper_bound(r) and r.extras.get("final_correct")),
        key=lambda r: -r.metrics["final_acc"],
    )
    if len(ranked) < 2:
        return ""
    leader, others = ranked[0], ranked[1:]
    n = sum(len(t) for t in leader.extras["final_correct"])
    head = (
        f"Who won (final accuracy, paired over the same {n} test examples, 95 % intervals; joint, trained on all "
        f"tasks at once, left out): {leader.label} {100 * leader.metrics['final_acc']:.1f} %"
    )
    versus = {r.label: paired_final(leader, r) for r in others}
    shown = {label: p for label, p in versus.items() if p is not None}
    ties = [label for label, p in shown.items() if p[1] <= 0]
    behind = [label for label, p in shown.items() if p[1] > 0]

    def interval(label: str) -> str:
        d, lo, hi = shown[label]
        return f"{d:+.1f} points [{lo:+.1f}, {hi:+.1f}]"

    if not ties:
        closest = behind[0]
        return f"{head}, ahead of every other method (the closest, {closest}: {interval(closest)})."
    tied = ", ".join(f"{label} ({interval(label)})" for label in ties)
    rest = f"; it is ahead of the other {len(behind)}" if behind else ""
    return f"{head} leads, but this run cannot tell it from {tied}: ties{rest}."


def save_results(
    results: Sequence[MethodResult],
    out_dir: str | Path,
    meta: dict[str, Any],
    task_names: Sequence[str],
    failures: Sequence[dict[str, str]] = (),
    plot: bool = True,
) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and (``plot``) ``accuracy_matrix.png`` into ``out_dir``; return their
    paths.

    Args:
        results: The finished methods (the heatmap is written only when there is at least one).
        out_dir: The output folder (created if missing).
        meta: Run metadata stored under ``meta`` in the JSON.
        task_names: The tasks, in order (row labels).
        failures: Methods that failed, each ``{"method", "label", "error"}``: stored under ``failed`` in the JSON
            and listed in the markdown, so a failed method is recorded next to the finished ones.
        plot: Draw the heatmap too (a second or two with a dozen methods; a job draws it once, at its end).
    """
    out = Path(out_dir)
    payload = {"meta": meta, "tasks": list(task_names), "results": [r.to_dict() for r in results]}
    if failures:
        payload["failed"] = [dict(f) for f in failures]
    paths = {"json": out / "results.json", "markdown": out / "results.md", "png": out / "accuracy_matrix.png"}

    def write_json(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(payload, fh, indent=2, allow_nan=False)

    md = [f"# {meta.get('name', 'continual run')}", "", metrics_table(results), ""]
    noise = noise_line(results, meta.get("test_examples") or [])
    if noise:
        md += [noise, ""]
    leader = leader_line(results)
    if leader:
        md += [leader, ""]
    if heads_table(results):
        md += ["## heads compared on the same runs (compare_heads)", "", heads_table(results), ""]
    if tuning_table(results):
        md += ["## learning rates chosen on validation (--tune)", "", tuning_table(results), ""]
    for r in results:
        md += [f"## {r.label}", "", matrix_table(r, task_names), ""]
    if failures:
        md += ["## failed", ""] + [f"- {f['label']}: {f['error']}" for f in failures] + [""]

    def write_md(tmp: str) -> None:
        Path(tmp).write_text("\n".join(md))

    atomic_write(paths["json"], write_json)
    atomic_write(paths["markdown"], write_md)
    if results and plot:
        plot_accuracy_matrices(results, paths["png"], title=str(meta.get("name", "")))
    return paths


# --- tables published in the docs, generated from results files -----------------------------------------------------

#: Opens a generated table in a markdown file; the path is the results file, relative to the markdown file's folder.
