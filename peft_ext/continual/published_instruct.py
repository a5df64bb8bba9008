"""The claims a continual instruction benchmark's results file makes (``benchmarks/continual_instruct.py``, kind
``continual_instruct``): sentences whose verb follows a paired interval over the task orders, so a page that quotes
them says no more than the runs do."""

from __future__ import annotations

import statistics
from typing import Any

from .metrics import paired_interval, verdict

__all__ = ["INSTRUCT_CLAIM_KINDS", "instruct_claim", "instruct_table", "per_order"]

#: What the claims of an instruction benchmark can say (``KEY:METHOD[:BASELINE]``, and ``command``).
INSTRUCT_CLAIM_KINDS = ("final", "forgetting", "held_out", "command")


def per_order(runs: list[dict[str, Any]], method: str, key: str) -> list[float]:
    """One figure of ``method``'s runs in task-order order: a metric (``final_acc``, ``forgetting``, ...) or
    ``held_out`` (the held-out perplexity after the sequence over the base model's).

    Raises:
        ValueError: ``method`` has no runs.
    """
    mine = sorted((r for r in runs if r["method"] == method), key=lambda r: r["order"])
    if not mine:
        methods = sorted({r["method"] for r in runs})
        raise ValueError(f"no runs of {method!r} in the instruction results; methods there: {methods}")
    if key == "held_out":
        return [r["extras"]["held_out_perplexity"]["ratio"] for r in mine]
    return [r["metrics"][key] for r in mine]


def _where(payload: dict[str, Any], n: int) -> str:
    settings = payload["settings"]
    orders = "one task order" if n == 1 else f"{n} task orders"
    return f"{settings['model']}, {len(settings['families'])} instruction tasks, {orders}"


def instruct_claim(payload: dict[str, Any], key: str) -> str:
    """One generated claim of an instruction benchmark's results.

    Keys: ``final:METHOD:BASELINE`` (the final average score against another method's, paired over the orders),
    ``forgetting:METHOD`` (its forgetting against sequential LoRA's), ``held_out:METHOD`` (the held-out perplexity
    after the sequence over the base model's), ``command``.

    Raises:
        ValueError: An unknown key, or a method without runs.
    """
    kind, _, rest = key.partition(":")
    if kind not in INSTRUCT_CLAIM_KINDS:
        raise ValueError(f"unknown instruction claim {key!r}; kinds: {list(INSTRUCT_CLAIM_KINDS)}")
    if kind == "command":
        return f"`{payload['command']}`"
    if kind == "final":
        method, _, baseline = rest.partition(":")
        a, b = per_order(payload["runs"], method, "final_acc"), per_order(payload["runs"], baseline, "final_acc")
        d, lo, hi = (100 * x for x in paired_interval(a, b))
        if len(a) < 2:  # no interval from one order: the difference, and no verb
            return f"is {d:+.1f} points from {baseline} on final average ({_where(payload, 1)}: no interval)"
        interval = f"{d:+.1f} points [{lo:+.1f}, {hi:+.1f}]"
        return f"{verdict(lo, hi)} {baseline} on final average ({interval}, {_where(payload, len(a))})"
    if kind == "forgetting":
        a, b = per_order(payload["runs"], rest, "forgetting"), per_order(payload["runs"], "seq_lora", "forgetting")
        d, lo, hi = (100 * x for x in paired_interval(a, b))
        if len(a) < 2:
            return (
                f"forgets {100 * a[0]:.1f} points against sequential LoRA's {100 * b[0]:.1f} ({_where(payload, 1)}: "
                "no interval)"
            )
        return (
            f"forgets {100 * statistics.mean(a):.1f} points against sequential LoRA's {100 * statistics.mean(b):.1f} "
            f"({d:+.1f} [{lo:+.1f}, {hi:+.1f}], {_where(payload, len(a))})"
        )
    ratios = per_order(payload["runs"], rest, "held_out")
    where = _where(payload, len(ratios))
    return f"leaves held-out perplexity at {statistics.mean(ratios):.3f}x the base model's ({where})"


def _cell(values: list[float], scale: float = 100.0) -> str:
    """Mean ± sd of ``values`` (times ``scale``), one value as it is, none as a dash."""
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0] * scale:.1f}"
    return f"{statistics.mean(values) * scale:.1f} ± {statistics.stdev(values) * scale:.1f}"


def _final_by_family(run: dict[str, Any]) -> dict[str, float]:
    """The final row of a run's score matrix by task family (task names are ``t<i>:<family>``)."""
    last = run["accuracy_matrix"][-1]
    return {name.split(":", 1)[1]: score for name, score in zip(run["tasks"], last)}


def instruct_table(payload: dict[str, Any]) -> str:
    """The table an instruction benchmark's results publish: per method the final average score, the score each task
    had right after it was trained (``learned``: what the method could learn, before any forgetting), forgetting and
    BWT (percent, mean ± sd over the task orders), the held-out perplexity after the sequence over the base model's,
    and each task's final score (exact match, or ROUGE-L for a sentence answer), then the line saying how it was
    made."""
    runs = payload["runs"]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    families = list(payload["settings"]["families"])
    head = ["method", "orders", "final average", "learned", "forgetting", "BWT", "held-out ppl / base", *families]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for method in methods:
        mine = sorted((r for r in runs if r["method"] == method), key=lambda r: r["order"])

        def metric(key: str, mine: list[dict[str, Any]] = mine) -> list[float]:
            return [r["metrics"][key] for r in mine if r["metrics"].get(key) is not None]

        ratio = [r["extras"]["held_out_perplexity"]["ratio"] for r in mine]
        per_family = [_final_by_family(r) for r in mine]
        cells = [method, str(len(mine)), _cell(metric("final_acc")), _cell(metric("learning_acc"))]
        cells += [_cell(metric("forgetting")), _cell(metric("bwt"))]
        cells.append(f"{statistics.mean(ratio):.3f}")
        cells += [_cell([f[family] for f in per_family if f.get(family) is not None]) for family in families]
        lines.append("| " + " | ".join(cells) + " |")
    orders = sorted({r["order"] for r in runs})
    lines += [
        "",
        f"(percent; {payload['settings']['model']}, task orders {orders}, {payload['settings']['train_per_task']} "
        f"training / {payload['settings']['test_per_task']} test examples per task; `{payload['command']}`; "
        f"commit {str(payload.get('machine', {}).get('commit') or '?')[:7]})",
    ]
    return "\n".join(lines) + "\n"
