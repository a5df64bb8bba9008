"""Results of a continual run as JSON, a markdown table, console text and a heatmap PNG."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from ..fileperm import atomic_write
from .engine import MethodResult
from .methods import method_capability
from .metrics import paired_interval, verdict

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


def _metric(r: MethodResult, key: str) -> Optional[float]:
    """``r.metrics[key]``; ``learning_acc`` of results saved before it existed comes from the matrix's diagonal."""
    if key == "learning_acc" and key not in r.metrics and not _upper_bound(r):
        diagonal = [r.accuracy_matrix[i][i] for i in range(len(r.accuracy_matrix))]
        return None if any(x is None for x in diagonal) else sum(diagonal) / len(diagonal)
    return r.metrics.get(key)


def metrics_table(results: Sequence[MethodResult], timings: bool = True) -> str:
    """A markdown table, one row per method: metrics in percent, trainable parameters and (``timings``) wall time.

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
    simplecil = next((r.metrics.get("final_acc") for r in results if r.method == "ncm"), None)
    heads = [head_name(r) for r in results]
    with_heads = any(h != "linear" for h in heads)
    # a generation sequence scores exact match of the generated answers, not a classifier's accuracy
    generation = bool(results) and all("answer_loss_matrix" in r.extras for r in results)
    titles = [t.replace("acc", "exact match") if generation else t for _, t in METRIC_COLUMNS]
    columns = [*titles, *(["gap to joint"] if joint is not None else [])]
    columns += ["vs SimpleCIL"] if simplecil is not None else []
    head = ["method", *(["head"] if with_heads else []), *columns, "trainable params"]
    head += ["train s", "eval s"] if timings else []
    align = ["---"] * (2 if with_heads else 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align + ["---:"] * (len(head) - len(align))) + "|"]
    for r, head_used in zip(results, heads):
        cells = [r.label, *([head_used] if with_heads else []), *(_pct(_metric(r, key)) for key, _ in METRIC_COLUMNS)]
        final = r.metrics.get("final_acc")
        if joint is not None:
            cells.append("—" if _upper_bound(r) or final is None else _pct(joint - final))
        if simplecil is not None:
            cells.append("—" if r.method == "ncm" or final is None else f"{100 * (final - simplecil):+.1f}")
        cells.append(f"{r.trainable_params:,}")
        cells += [f"{r.train_seconds:.1f}", f"{r.eval_seconds:.1f}"] if timings else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def head_name(result: MethodResult) -> str:
    """The head that scored ``result``'s accuracy matrix (``linear`` for results from before heads existed)."""
    head = result.extras.get("head")
    return head.get("name", "linear") if isinstance(head, dict) else "linear"


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
    when the paired 95 % interval over the same test examples clears 0; the others are ties. An upper bound
    (``is_upper_bound``: ``joint``, trained on every task at once) is left out; ``""`` when fewer than two methods
    recorded their per-example outcomes."""
    ranked = sorted(
        (r for r in results if not _upper_bound(r) and r.extras.get("final_correct")),
        key=lambda r: -r.metrics["final_acc"],
    )
    if len(ranked) < 2:
        return ""
    leader, others = ranked[0], ranked[1:]
    n = sum(len(t) for t in leader.extras["final_correct"])
    head = (
        f"Who won (final accuracy, paired over the same {n} test examples, 95 % intervals; joint, the upper bound, "
        f"left out): {leader.label} {100 * leader.metrics['final_acc']:.1f} %"
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
) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and ``accuracy_matrix.png`` into ``out_dir``; return their paths.

    Args:
        results: The finished methods (the heatmap is written only when there is at least one).
        out_dir: The output folder (created if missing).
        meta: Run metadata stored under ``meta`` in the JSON.
        task_names: The tasks, in order (row labels).
        failures: Methods that failed, each ``{"method", "label", "error"}``: stored under ``failed`` in the JSON
            and listed in the markdown, so a failed method is recorded next to the finished ones.
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
    if results:
        plot_accuracy_matrices(results, paths["png"], title=str(meta.get("name", "")))
    return paths


# --- tables published in the docs, generated from results files -----------------------------------------------------

#: Opens a generated table in a markdown file; the path is the results file, relative to the markdown file's folder.
GENERATED_OPEN = "<!-- generated by `peft-ext table {source}`: edit the results file, not this table -->"
GENERATED_CLOSE = "<!-- end of generated table -->"
_GENERATED_BLOCK = re.compile(
    r"<!-- generated by `peft-ext table (?P<source>[^`]+)`: edit the results file, not this table -->\n"
    r"(?P<body>.*?)"
    r"<!-- end of generated table -->",
    re.S,
)


#: A generated claim inside a sentence (a table cell too): ``<!-- claim SOURCE KEY -->text<!-- /claim -->``, the text
#: written by :func:`published_claim` from the results file SOURCE (relative to the markdown file's folder).
CLAIM_OPEN = "<!-- claim {source} {key} -->"
CLAIM_CLOSE = "<!-- /claim -->"
_CLAIM = re.compile(r"<!-- claim (?P<source>\S+) (?P<key>\S+) -->(?P<body>.*?)<!-- /claim -->", re.S)
#: The data set a shipped config draws its sequence from, as a claim names it.
DATASET_OF = {"quickstart": "WordNet", "fortunes": "fortunes"}
#: What the claims of a heads protocol summary can say (``KEY:METHOD`` for the first two).
CLAIM_KINDS = ("vs_simplecil", "vs_simplecil_every_task", "vs_simplecil_head", "winners", "command")


def _head_words(head: str) -> str:
    """A protocol row's head in words: ``first_task+lda`` -> trained on the first task only, lda head."""
    if head.startswith("first_task+"):
        return f"trained on the first task only, {head.split('+', 1)[1]} head"
    if head.startswith("cosine+"):
        return f"trained with the cosine head, {head.split('+', 1)[1]} head"
    return f"{head} head"


def _short_head(head: str) -> str:
    """A protocol row's head in a table cell: ``first_task+lda`` -> first task, lda; ``cosine+lda`` -> cosine, lda."""
    return head.replace("first_task+", "first task, ").replace("cosine+", "cosine, ")


def _versus_simplecil(dataset: str, d: float, lo: float, hi: float, head: str, n: int) -> str:
    """One comparison with SimpleCIL in words; the verb follows the paired interval ``[lo, hi]`` (points)."""
    interval = f"{d:+.1f} points [{lo:+.1f}, {hi:+.1f}]"
    return f"{verdict(lo, hi)} SimpleCIL on {dataset} ({interval}, {_head_words(head)}, {n} class draws)"


def heads_claim(summary: dict[str, Any], key: str) -> str:
    """One generated claim of a heads protocol summary (``benchmarks/continual_heads.py``), with its data set, its
    paired interval and the number of draws: the verb follows the interval (``beats`` only when its lower end is
    above 0, ``trails`` only when its upper end is below 0, else ``ties``).

    Keys: ``vs_simplecil:METHOD`` (the method with its best head against SimpleCIL), ``vs_simplecil_every_task:METHOD``
    (its best head when it trains on every task), ``vs_simplecil_head:METHOD:ROW`` (one row of the method's, such as
    ``analytic`` or ``first_task+lda``), ``winners`` (which adapter methods beat SimpleCIL), ``command`` (the command
    that wrote the summary).

    Raises:
        ValueError: An unknown key or a method the summary does not compare with SimpleCIL.
    """
    kind, _, method = key.partition(":")
    dataset = DATASET_OF.get(summary["config"], f"`{summary['config']}`")
    n = len(summary["draws"])
    if kind == "vs_simplecil_head":
        method, _, row = method.partition(":")
        rows = summary["methods"].get(method, {}).get("heads", {})
        ncm = summary["methods"].get("ncm", {}).get("heads", {}).get("prototype")
        if row not in rows or ncm is None:
            raise ValueError(
                f"claim {key!r}: no row {row!r} of {method!r} beside SimpleCIL here; rows: {sorted(rows)}"
            )
        d, lo, hi = (100 * x for x in paired_interval(rows[row]["values"], ncm["values"]))
        return _versus_simplecil(dataset, d, lo, hi, row, n)
    if kind in ("vs_simplecil", "vs_simplecil_every_task"):
        every = kind.endswith("every_task")
        m = summary["methods"].get(method, {})
        vs = m.get("vs_ncm_every_task" if every else "vs_ncm")
        if vs is None:
            valid = [k for k, v in summary["methods"].items() if v.get("vs_ncm")]
            raise ValueError(f"claim {key!r}: {method!r} is not compared with SimpleCIL here; one of {valid}")
        return _versus_simplecil(dataset, *vs, m["best_every_task_head" if every else "best_head"], n)
    if kind == "winners" and not method:
        beat = [
            f"{label} ({_head_words(m['best_head'])}, {m['vs_ncm'][0]:+.1f} points [{m['vs_ncm'][1]:+.1f}, "
            f"{m['vs_ncm'][2]:+.1f}])"
            for label, m in summary["methods"].items()
            if method_capability(label, "is_continual_adapter", True) and m.get("vs_ncm") and m["vs_ncm"][1] > 0
        ]
        if not beat:
            return f"on {dataset} no adapter method here beats SimpleCIL, whatever the head ({n} class draws)"
        return f"on {dataset} these beat SimpleCIL: {', '.join(beat)} ({n} class draws)"
    if kind == "command" and not method:
        return f"`{summary['command']}`"
    valid = [k + ":METHOD" for k in CLAIM_KINDS[:2]] + ["vs_simplecil_head:METHOD:ROW", "winners", "command"]
    raise ValueError(f"unknown claim {key!r}: one of {valid}")


def published_claim(path: str | Path, key: str) -> str:
    """The text of the claim ``key`` that the results file ``path`` makes (:func:`heads_claim`).

    Raises:
        ValueError: The file is not a heads protocol summary, or the key is unknown to it.
    """
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"claim {key!r}: cannot read {str(path)!r} ({type(err).__name__}: {err})") from None
    if not isinstance(payload, dict) or payload.get("kind") != "continual_heads":
        raise ValueError(f"claim {key!r}: {str(path)!r} is not a heads protocol summary (kind continual_heads)")
    return heads_claim(payload, key)


def generated_claims(text: str) -> list[tuple[str, str, str]]:
    """``(source, key, body)`` of every generated claim in a markdown text."""
    return [(m["source"], m["key"], m["body"]) for m in _CLAIM.finditer(text)]


def load_results(path: str | Path) -> tuple[dict[str, Any], list[MethodResult]]:
    """The ``meta`` and the method results of a continual job's ``results.json``.

    Raises:
        ValueError: The file is not a continual job's results file (named, with what is wrong).
    """
    try:
        payload = json.loads(Path(path).read_text())
        return payload["meta"], [MethodResult(**row) for row in payload["results"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        what = f"{type(err).__name__}: {err}"
        raise ValueError(f"{str(path)!r} is not a results.json of a continual job ({what})") from None


#: The heads of the protocol table's columns, in order (a method's own training with each of them).
PROTOCOL_HEADS = ("linear", "prototype", "lda", "analytic", "aligned")


def _interval(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "—"
    half = cell["half_width"]
    return f"{cell['mean']:.1f}" + ("" if not math.isfinite(half) else f" ± {half:.1f}")


def heads_protocol_table(summary: dict[str, Any]) -> str:
    """The table of a heads protocol summary (``benchmarks/continual_heads.py``): per method, final accuracy with
    each head on its own training, with the best head after first-task adaptation, the best of all and its paired
    difference to SimpleCIL (``ncm``), each a mean ± the half-width of its 95 % interval over the class draws."""
    methods = summary["methods"]
    # the cosine head (SEQ*) is its own training run: a column only when the summary has it
    columns = [*PROTOCOL_HEADS[:1], "cosine", *PROTOCOL_HEADS[1:]]
    columns = [h for h in columns if h != "cosine" or any("cosine" in m["heads"] for m in methods.values())]
    head = ["method", *columns, "first task only, best head", "best (head)", "best − SimpleCIL [95 % CI]"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for label, m in methods.items():
        heads = m["heads"]
        first = {k.split("+", 1)[1]: v for k, v in heads.items() if k.startswith("first_task+")}
        best_first = max(first, key=lambda k: first[k]["mean"]) if first else None
        cells = [label, *(_interval(heads.get(h)) for h in columns)]
        cells.append("—" if best_first is None else f"{_interval(first[best_first])} ({best_first})")
        cells.append(f"{m['best_mean']:.1f} ({_short_head(m['best_head'])})")
        vs = m.get("vs_ncm")
        cells.append("—" if vs is None else f"{vs[0]:+.1f} [{vs[1]:+.1f}, {vs[2]:+.1f}]")
        lines.append("| " + " | ".join(cells) + " |")
    targets = [f"- {line}" for line in heads_targets(summary.get("targets", {}))]
    return (
        "\n".join(lines)
        + "\n\n"
        + heads_verdict(summary)
        + ("\n\nTargets:\n\n" + "\n".join(targets) if targets else "")
    )


def heads_targets(targets: dict[str, Any]) -> list[str]:
    """The heads protocol's targets (``benchmarks/continual_heads.py``), one sentence each, with their verdicts."""
    lines = []
    for key, how in (("floor", ""), ("floor_every_task", ", training every task (no first-task adaptation)")):
        if key in targets:
            f = targets[key]
            misses = [f"{k} {v['best']:.1f} ({v['best_head']})" for k, v in f["methods"].items() if not v["met"]]
            verdict = "met" if f["met"] else "NOT met: " + ", ".join(misses)
            lines.append(
                f"floor{how}: every continual adapter method with its best head at least SimpleCIL "
                f"({f['simplecil']:.1f}) minus 1: {verdict}"
            )
    if "moonshot" in targets:
        ms = targets["moonshot"]
        head = _short_head(ms["head"])
        lines.append(
            f"moonshot: the best continual method ({ms['method']}, {head}) closes "
            f"{100 * ms['share_of_gap_closed']:.0f} % of the gap from the best training-free baseline to joint LoRA "
            f"({100 * ms['share_of_gap_to_joint_best_head']:.0f} % to joint with its best head), lower end of its "
            f"paired interval against that baseline {ms['lower_end_vs_best_free']:+.1f}; target half, above 0: "
            + ("met" if ms["met"] else "NOT met")
        )
    return lines


def heads_verdict(summary: dict[str, Any]) -> str:
    """One sentence per outcome, from the paired intervals: which methods, with their best head, beat SimpleCIL
    (the interval's lower end above 0), tie with it (the interval holds 0) or trail it (its upper end below 0)."""
    outcome: dict[str, list[str]] = {"beat it": [], "tie": [], "trail it": []}
    for label, m in summary["methods"].items():
        vs = m.get("vs_ncm")
        if vs is None or label == "joint":
            continue
        key = "beat it" if vs[1] > 0 else "trail it" if vs[2] < 0 else "tie"
        outcome[key].append(f"{label} ({_short_head(m['best_head'])}, {vs[0]:+.1f})")
    said = [f"{verb}: {', '.join(names)}" for verb, names in outcome.items() if names]
    if not said:
        return "No method was compared with SimpleCIL (ncm)."
    return (
        "Against SimpleCIL on the same draws, each method with its best head (paired 95 % interval): "
        + "; ".join(said)
        + "."
    )


def heads_sizes_table(payload: dict[str, Any]) -> str:
    """The table of a heads protocol at several training-set sizes (``benchmarks/continual_heads.py --sizes``): per
    size, the best training-free baseline, joint LoRA (linear head) and each continual method's best final accuracy
    with its place in the gap between the two (0 % at the baseline, 100 % at joint), then one sentence per method
    saying how that place moved."""
    entries = payload["sizes"]
    head = ["method"]
    for e in entries:
        head += [f"{e['train_per_class']} per class: best (head)", "place in the gap"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

    def place(e: dict[str, Any], mean: float) -> float:
        gap = e["joint"] - e["best_free"]["mean"]
        return 100 * (mean - e["best_free"]["mean"]) / gap if gap > 0 else math.nan

    lines.append(
        "| best training-free | "
        + " | ".join(f"{e['best_free']['mean']:.1f} ({e['best_free']['method']}) | 0 %" for e in entries)
        + " |"
    )
    lines.append("| joint LoRA (linear) | " + " | ".join(f"{e['joint']:.1f} | 100 %" for e in entries) + " |")
    labels = [label for label in entries[0]["methods"] if all(label in e["methods"] for e in entries)]
    for label in labels:
        cells = [label]
        for e in entries:
            m = e["methods"][label]
            cells += [f"{m['best_mean']:.1f} ({_short_head(m['best_head'])})"]
            cells += [f"{place(e, m['best_mean']):.0f} %"]
        lines.append("| " + " | ".join(cells) + " |")
    first, last = entries[0], entries[-1]
    gaps = f"{first['joint'] - first['best_free']['mean']:.1f} to {last['joint'] - last['best_free']['mean']:.1f}"
    said = [
        f"From {first['train_per_class']} to {last['train_per_class']} training examples per class the gap from the "
        f"best training-free baseline to joint LoRA moves from {gaps} points."
    ]
    moves = [
        f"{label} {place(first, first['methods'][label]['best_mean']):.0f} % -> "
        f"{place(last, last['methods'][label]['best_mean']):.0f} %"
        for label in labels
    ]
    if moves:
        said.append("Each method's place in it: " + ", ".join(moves) + ".")
    draws = ", ".join(f"{len(e['draws'])} at {e['train_per_class']}" for e in entries)
    commands = "; ".join(f"`{e['command']}`" for e in entries)
    return (
        "\n".join(lines)
        + "\n\n"
        + " ".join(said)
        + f"\n\n(percent, final average accuracy, class-incremental; `{payload['config']}`, class draws: {draws}; "
        f"{commands}; {payload['machine']})\n"
    )


def published_table(path: str | Path) -> str:
    """The table a results file publishes: one row per method (metrics in percent, trainable parameters), then a line
    with where and how long it ran. Timings are the job's own, summed over its methods. A heads protocol summary
    (``"kind": "continual_heads"``) publishes :func:`heads_protocol_table` and the line saying how it was made.

    Args:
        path: A continual job's ``results.json``, or a heads protocol summary.
    """
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        payload = None
    if isinstance(payload, dict) and payload.get("kind") == "continual_heads_sizes":
        return heads_sizes_table(payload)
    if isinstance(payload, dict) and payload.get("kind") == "continual_heads":
        draws = len(payload["draws"])
        return (
            heads_protocol_table(payload)
            + f"\n\n(percent, final average accuracy, class-incremental; {draws} class draws of "
            f"`{payload['config']}`; `{payload['command']}`; {payload['machine']})\n"
        )
    meta, results = load_results(path)
    lines = [metrics_table(results, timings=False)]
    train = sum(r.train_seconds for r in results)
    evaluation = sum(r.eval_seconds for r in results)
    where = f"torch {meta.get('torch', '?')}, {meta.get('threads', '?')} threads, {meta.get('machine', '?')}"
    lines += [
        "",
        f"(percent; {len(results)} methods, {train:.0f} s training + {evaluation:.0f} s evaluation in all, "
        f"{meta.get('wall_seconds', 0):.0f} s for the job; {where})",
    ]
    if tuning_table(results):
        lines += ["", "Learning rates chosen on validation (`--tune`):", "", tuning_table(results)]
    return "\n".join(lines) + "\n"


def generated_blocks(text: str) -> list[tuple[str, str]]:
    """``(source, body)`` of every generated table in a markdown text."""
    return [(m["source"], m["body"]) for m in _GENERATED_BLOCK.finditer(text)]


def write_generated_tables(markdown: str | Path) -> list[str]:
    """Rewrite every generated table and every generated claim of a markdown file from its results file; returns
    the sources rewritten.

    The file is replaced atomically, only when something changed, and only when every table and claim could be
    written (a bad one leaves the page as it was).

    Raises:
        ValueError: A results file is missing or not a continual job's; a claim's key is unknown.
    """
    path = Path(markdown)
    text = path.read_text()

    def regenerate(match: re.Match) -> str:
        body = published_table(path.parent / match["source"])
        return GENERATED_OPEN.format(source=match["source"]) + "\n" + body + GENERATED_CLOSE

    def reclaim(match: re.Match) -> str:
        body = published_claim(path.parent / match["source"], match["key"])
        return CLAIM_OPEN.format(source=match["source"], key=match["key"]) + body + CLAIM_CLOSE

    new = _CLAIM.sub(reclaim, _GENERATED_BLOCK.sub(regenerate, text))
    if new != text:
        atomic_write(path, lambda tmp: Path(tmp).write_text(new))
    tables = [source for source, _ in generated_blocks(text)]
    return list(dict.fromkeys(tables + [source for source, _, _ in generated_claims(text)]))
