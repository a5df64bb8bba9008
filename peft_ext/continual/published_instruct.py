"""The claims a continual instruction benchmark's results file makes (``benchmarks/continual_instruct.py``, kind
``continual_instruct``): sentences whose verb follows a paired interval over the task orders, so a page that quotes
them says no more than the runs do."""

from __future__ import annotations

import statistics
from typing import Any

from .metrics import paired_interval, verdict

__all__ = ["INSTRUCT_CLAIM_KINDS", "instruct_claim"]

#: What the claims of an instruction benchmark can say (``KEY:METHOD[:BASELINE]``, and ``command``).
INSTRUCT_CLAIM_KINDS = ("final", "forgetting", "held_out", "command")


def _per_order(payload: dict[str, Any], method: str, key: str) -> list[float]:
    runs = sorted((r for r in payload["runs"] if r["method"] == method), key=lambda r: r["order"])
    if not runs:
        methods = sorted({r["method"] for r in payload["runs"]})
        raise ValueError(f"no runs of {method!r} in the instruction results; methods there: {methods}")
    if key == "held_out":
        return [r["extras"]["held_out_perplexity"]["ratio"] for r in runs]
    return [r["metrics"][key] for r in runs]


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
        a, b = _per_order(payload, method, "final_acc"), _per_order(payload, baseline, "final_acc")
        d, lo, hi = (100 * x for x in paired_interval(a, b))
        if len(a) < 2:  # no interval from one order: the difference, and no verb
            return f"is {d:+.1f} points from {baseline} on final average ({_where(payload, 1)}: no interval)"
        interval = f"{d:+.1f} points [{lo:+.1f}, {hi:+.1f}]"
        return f"{verdict(lo, hi)} {baseline} on final average ({interval}, {_where(payload, len(a))})"
    if kind == "forgetting":
        a, b = _per_order(payload, rest, "forgetting"), _per_order(payload, "seq_lora", "forgetting")
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
    ratios = _per_order(payload, rest, "held_out")
    where = _where(payload, len(ratios))
    return f"leaves held-out perplexity at {statistics.mean(ratios):.3f}x the base model's ({where})"
