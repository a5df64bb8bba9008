"""The missing-modality grid's settings and cells, and the markdown table of its rows (:mod:`.experiment`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .missing import MissingSpec

__all__ = ["LABELS", "cell_key", "grid_specs", "markdown_table"]

LABELS = {
    "linear_probe": "frozen + linear head",
    "lora": "LoRA (both towers)",
    "lora_matched": "LoRA, MoRA's parameter count",
    "mora": "MoRA",
    "prompts": "missing-aware prompts (MMP)",
}


def grid_specs(rates: Sequence[float], kinds: Sequence[str]) -> list[MissingSpec]:
    """The settings of a grid; rate 0 is the same for every type, so it appears once (as ``both``)."""
    specs, seen = [], set()
    for rate in rates:
        for kind in kinds:
            spec = MissingSpec(rate, "both" if rate == 0 else kind)
            if (spec.rate, spec.kind) not in seen:
                seen.add((spec.rate, spec.kind))
                specs.append(spec)
    return specs


def cell_key(rate: float, kind: str, method: str, seed: int) -> tuple[float, str, str, int]:
    """What identifies a cell of the grid (and its row): rate, missing type, method, seed."""
    return float(rate), str(kind), str(method), int(seed)


def _cell(values: list[float], scale: float = 100.0) -> str:
    mean = statistics.mean(values) * scale
    if len(values) == 1:
        return f"{mean:.1f}"
    return f"{mean:.1f} ± {statistics.stdev(values) * scale:.1f}"


def markdown_table(rows: list[dict[str, Any]], infer_ms: dict[str, float] | None = None) -> str:
    """One line per (rate, type, method): mean (± sd over seeds) accuracy, F1-macro, AUROC in percent, trainable
    parameters and (from :func:`time_inference`) inference ms per 64; the best accuracy of each setting in bold."""
    infer_ms = infer_ms or {}
    settings = list(dict.fromkeys((r["rate"], r["kind"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = [
        "| missing rate | type | method | accuracy | F1-macro | AUROC | trainable params | inference ms / 64 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rate, kind in settings:
        group = {m: [r for r in rows if (r["rate"], r["kind"], r["method"]) == (rate, kind, m)] for m in methods}
        best = max(methods, key=lambda m: statistics.mean(r["acc"] for r in group[m]) if group[m] else -1)
        for m in methods:
            if not group[m]:
                continue
            acc = _cell([r["acc"] for r in group[m]])
            acc = f"**{acc}**" if m == best else acc
            infer = f"{infer_ms[m]:.1f}" if m in infer_ms else "-"
            lines.append(
                f"| {rate:g} | {'-' if rate == 0 else kind} | {LABELS.get(m, m)} | {acc} | "
                f"{_cell([r['f1'] for r in group[m]])} | {_cell([r['auroc'] for r in group[m]])} | "
                f"{group[m][0]['params']:,} | {infer} |"
            )
    return "\n".join(lines)
