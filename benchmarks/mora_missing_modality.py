"""MoRA against LoRA on both towers, a frozen backbone + linear head, and missing-aware prompts (MMP), on the emoji
image + name pairs with missing modalities; prints a markdown table.

Backbone (:mod:`peft_ext.multimodal.dual_encoder`): the real pretrained MiniLM-L6 text tower (offline, width 384,
6 layers) and a small ViT (width 192, 4 layers, 8 x 8 patches of the 32 x 32 images), pretrained LiT-style on the
complete training pairs (text tower locked; cached under ``--cache-dir``, keyed by the settings). Each method then
fine-tunes on the 9-way emoji group label with the missing-modality protocol (the same spec on train and test, each
split its own draw; placeholders: empty text, white image). MoRA and LoRA adapt the attention projections (q, k, v,
out) of the top 2 layers of both towers (MiniLM 4-5 paired with ViT 2-3), r = 4; the prompts enter the same layers.
Inference time: full forward of 64 test examples from token ids and pixels, LoRA / MoRA merged into the backbone.

Usage::

    python benchmarks/mora_missing_modality.py                  # the 7-setting grid, 4 methods, seed 0
    python benchmarks/mora_missing_modality.py --seeds 0 1 2    # the same with three seeds
    python benchmarks/mora_missing_modality.py --rates 0.7 --kinds both --methods lora mora
    python benchmarks/mora_missing_modality.py --table-from runs/seed0.json runs/seeds12.json  # merge runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from peft_ext.multimodal import MISSING_TYPES  # noqa: E402
from peft_ext.multimodal.experiment import (  # noqa: E402
    METHODS,
    ExperimentSettings,
    grid_specs,
    markdown_table,
    prepare,
    run_grid,
    time_inference,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ExperimentSettings()
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.3, 0.7], help="missing rates")
    parser.add_argument("--kinds", nargs="+", default=list(MISSING_TYPES), choices=MISSING_TYPES, help="types")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="fine-tuning seeds")
    for field in dataclasses.fields(ExperimentSettings):
        flag = "--" + field.name.replace("_", "-")
        kind = {"int": int, "float": float}.get(type(getattr(defaults, field.name)).__name__, str)
        if field.name == "train_limit":
            kind = int
        parser.add_argument(flag, type=kind, default=getattr(defaults, field.name), help="default: %(default)s")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and settings to this file")
    parser.add_argument(
        "--table-from",
        type=Path,
        nargs="+",
        default=None,
        help="print the table of earlier --json files (e.g. runs with different seeds) and exit",
    )
    args = parser.parse_args()
    if args.table_from:
        saved = [json.loads(path.read_text()) for path in args.table_from]
        if len({json.dumps(s["settings"], sort_keys=True) for s in saved}) > 1:
            raise SystemExit("--table-from: the files were run with different settings")
        rows = [row for s in saved for row in s["rows"]]
        print(markdown_table(rows, saved[0]["infer_ms"]))
        print(f"\nseeds {sorted({row['seed'] for row in rows})}; inference times from {args.table_from[0]}")
        print("\n".join(targets(rows, saved[0]["infer_ms"])))
        return
    torch.set_num_threads(args.threads)
    settings = ExperimentSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ExperimentSettings)})

    start = time.perf_counter()
    prep = prepare(settings)
    print(
        f"emoji pairs: {len(prep.train.y)} train / {len(prep.test.y)} test, {prep.num_classes} groups; backbone "
        f"{settings.text} + ViT {settings.vision_width}x{settings.vision_layers}, pretraining loss "
        f"{prep.pretrain_log['first_loss']:.2f} -> {prep.pretrain_log['last_loss']:.2f}",
        flush=True,
    )
    specs = grid_specs(args.rates, args.kinds)
    rows = run_grid(prep, specs, args.methods, args.seeds, echo=_echo)
    infer_ms = time_inference(prep, args.methods, specs[-1])
    wall = time.perf_counter() - start
    print()
    print(markdown_table(rows, infer_ms))
    print(
        f"\nseeds {args.seeds}; same missing spec on train and test; {settings.epochs} epochs, lr {settings.lr}, "
        f"batch {settings.batch_size}, r {settings.r}, top {settings.top_layers} layers per tower, "
        f"{settings.prompt_length} prompt tokens per layer; {args.threads} thread(s), wall {wall:.0f} s"
    )
    print("\n".join(targets(rows, infer_ms)))
    if args.json is not None:
        args.json.write_text(
            json.dumps({"settings": dataclasses.asdict(settings), "rows": rows, "infer_ms": infer_ms}, indent=2)
        )


def targets(rows: list[dict[str, Any]], infer_ms: dict[str, float]) -> list[str]:
    """Issue 7's target as verdict lines: MoRA best at missing rate 0.7 (each type), at an inference time no higher
    than the prompt baseline's."""
    lines = []
    for kind in dict.fromkeys(r["kind"] for r in rows if r["rate"] == 0.7):
        accs: dict[str, list[float]] = {}
        for r in rows:
            if r["rate"] == 0.7 and r["kind"] == kind:
                accs.setdefault(r["method"], []).append(r["acc"])
        if "mora" not in accs or len(accs) < 2:
            continue
        mean = {m: statistics.mean(v) for m, v in accs.items()}
        rival = max((m for m in mean if m != "mora"), key=mean.get)
        ok = mean["mora"] >= mean[rival]
        lines.append(
            f"target: rate 0.7 {kind}: MoRA accuracy {100 * mean['mora']:.1f} vs best other ({rival}) "
            f"{100 * mean[rival]:.1f} (MoRA best): {'met' if ok else 'NOT met'}"
        )
    if "mora" in infer_ms and "prompts" in infer_ms:
        ratio = infer_ms["mora"] / infer_ms["prompts"]
        verdict = "met" if ratio <= 1 else "NOT met"
        lines.append(f"target: MoRA inference time / prompt baseline = {ratio:.2f}x (<= 1.00x): {verdict}")
    return lines


def _echo(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    main()
