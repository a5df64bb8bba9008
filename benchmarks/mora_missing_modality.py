"""MoRA against LoRA on both towers (at r = 4, and at MoRA's trainable-parameter count), a frozen backbone + linear
head, and missing-aware prompts (MMP), on the emoji image + name pairs with missing modalities, under the benchmark
protocol of ``benchmarks/_lib/protocol.py``; prints markdown tables and the target's verdicts.

Backbone (:mod:`peft_ext.multimodal.dual_encoder`): the real pretrained MiniLM-L6 text tower (offline, width 384,
6 layers) and a small ViT (width 192, 4 layers, 8 x 8 patches of the 32 x 32 images), pretrained LiT-style on the
complete training pairs, the validation pairs held out (text tower locked; cached under ``--cache-dir``, keyed by
the settings). Each method then fine-tunes on the 9-way emoji group label with the missing-modality protocol (the
same spec on train, validation and test, each split its own draw; placeholders: empty text, white image). MoRA and
LoRA adapt the attention projections (q, k, v, out) of the top 2 layers of both towers (MiniLM 4-5 paired with ViT
2-3), r = 4; ``lora_matched`` is LoRA on the same modules at ranks 5-6 (:func:`matched_lora_ranks`), which trains
exactly MoRA's 53,001 parameters (LoRA r = 4: 39,177); the prompts enter the same layers.

Protocol: the emoji validation split (293 pairs carved from the train split by a hash, ``load_emoji_pairs``) is
held out of training; each method's learning rate is chosen from a 3-point grid (half a decade apart around 1e-2,
the same grid and budget for every method) by its validation accuracy at the main setting (missing rate 0.7, type
both) with seed 0; then every method is trained with its chosen rate on the 1,214 remaining train pairs and scored
on the test split (363 pairs) over seeds 0-4 at every setting of the grid. A seed sets the initialization and the
batch order; the missing draws are fixed per split. Target: MoRA best at missing rate 0.7, i.e. its paired
difference to the best other method (by mean test accuracy) has a 95 % t-interval whose lower end is above 0.
Inference time: full forward of 64 test examples from token ids and pixels, LoRA / MoRA merged into the backbone.

Cost, measured as CPU seconds on one thread (the shared 2-core machine was loaded, so wall times were 2-3x these):
backbone pretraining and the lower-layer cache 142 s once (the pretrained backbone is cached afterwards); one
full-size fine-tuning run (5 epochs = 95 steps on the 1,214 pairs, rate 0.7 both, scored on validation): frozen +
linear head 2.6 s, LoRA 21.4 s, LoRA at MoRA's count 20.6 s, MoRA 30.0 s, prompts 26.6 s; 101 s for the five.
The default is 15 validation runs + 5 methods x 5 seeds x 4 settings = 23 runs per method: about 23 x 101 s + 142 s
+ timing = 42 minutes on one idle core (``--kinds both``: 2 settings, about 25 minutes). Measured: the
default took 3,693 s wall (2026-12-01, one thread, with up to three other benchmarks on the 2 cores). Five epochs
are the docs/methods.md (MoRA) schedule, kept from the earlier runs.

Usage::

    python -m benchmarks.mora_missing_modality --json runs/benchmarks/mora.json   # the protocol, rates 0 and 0.7
    python -m benchmarks.mora_missing_modality --runs runs/benchmarks/mora-runs.json  # a killed job loses no run
    python -m benchmarks.mora_missing_modality --rates 0 0.3 0.7                  # the 7-setting grid
    python -m benchmarks.mora_missing_modality --quick                            # smoke run of every path (< 1 min)
    python -m benchmarks.mora_missing_modality --table-from runs/a.json runs/b.json  # merge the rows of runs
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.cache import RunCache
from benchmarks._lib.cli import benchmark_parser, parse
from benchmarks._lib.protocol import Protocol, Study, log_grid, paired_interval, tune_and_test
from benchmarks._lib.tables import mean_sd
from peft_ext.multimodal import MISSING_TYPES, MissingSpec
from peft_ext.multimodal.experiment import (
    ALL_METHODS,
    ExperimentSettings,
    grid_specs,
    markdown_table,
    prepare,
    run_method,
    time_inference,
)

MAIN = MissingSpec(0.7, "both")  # where the learning rates are chosen and the headline target is judged
# --quick: every code path at toy sizes (a narrow 2-layer ViT, 128 training pairs, one epoch, 2 seeds, 2 settings)
QUICK = {
    "rates": [0.0, 0.7],
    "kinds": ["both"],
    "vision_width": 32,
    "vision_layers": 2,
    "vision_heads": 2,
    "pretrain_epochs": 1,
    "train_limit": 128,
    "epochs": 1,
    "timing_batches": 2,
    "cache_dir": None,
}


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(
        __doc__, quick="smoke run: toy sizes, test seeds 0 1", json="also write the rows, studies and settings here",
        threads=1, runs=True
    )  # fmt: skip
    defaults = ExperimentSettings()
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.7], help="missing rates")
    parser.add_argument("--kinds", nargs="+", default=list(MISSING_TYPES), choices=MISSING_TYPES, help="types")
    parser.add_argument("--methods", nargs="+", default=list(ALL_METHODS), choices=ALL_METHODS)
    parser.add_argument("--tune-seeds", type=int, nargs="+", default=[0], help="seeds of the lr choice")
    parser.add_argument("--test-seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds of the test")
    parser.add_argument("--grid-points", type=int, default=3, help="learning rates per method (around --lr)")
    for field in dataclasses.fields(ExperimentSettings):
        flag = "--" + field.name.replace("_", "-")
        kind = {"int": int, "float": float}.get(type(getattr(defaults, field.name)).__name__, str)
        if field.name == "train_limit":
            kind = int
        parser.add_argument(flag, type=kind, default=getattr(defaults, field.name), help="default: %(default)s")
    parser.add_argument(
        "--table-from", type=Path, nargs="+", default=None, help="print the tables of earlier --json files and exit"
    )
    args = parse(parser, argv, quick=QUICK)
    if args.table_from:
        saved = [json.loads(path.read_text()) for path in args.table_from]
        if len({json.dumps(s["settings"], sort_keys=True) for s in saved}) > 1:
            raise SystemExit("--table-from: the files were run with different settings")
        rows = [row for s in saved for row in s["rows"]]
        print(markdown_table(rows, saved[0]["infer_ms"]))
        print(f"\ninference times from {args.table_from[0]}")
        print("\n".join(verdicts(rows, saved[0]["infer_ms"])))
        return
    if args.quick:
        args.test_seeds = args.test_seeds[:2]
    if args.grid_points < 1:
        raise SystemExit(f"--grid-points must be >= 1, got {args.grid_points}")
    torch.set_num_threads(args.threads)
    settings = ExperimentSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ExperimentSettings)})
    protocol = Protocol(tune_seeds=tuple(args.tune_seeds), test_seeds=tuple(args.test_seeds))
    specs = grid_specs(args.rates, args.kinds)
    if (MAIN.rate, MAIN.kind) not in {(s.rate, s.kind) for s in specs}:
        specs.append(MAIN)

    cache = RunCache(args.runs, {**dataclasses.asdict(settings), "grid_points": args.grid_points})
    if args.runs is not None:
        print(f"[mora] {len(cache)} finished run(s) saved in {args.runs} will be reused", flush=True)
    start = time.perf_counter()
    prep = prepare(settings, validation=True)
    print(
        f"emoji pairs: {len(prep.train.y)} train / {len(prep.validation.y)} validation / {len(prep.test.y)} test, "
        f"{prep.num_classes} groups; backbone {settings.text} + ViT {settings.vision_width}x"
        f"{settings.vision_layers}, pretraining loss {prep.pretrain_log['first_loss']:.2f} -> "
        f"{prep.pretrain_log['last_loss']:.2f}",
        flush=True,
    )
    rows, studies = run_protocol(prep, specs, args.methods, protocol, args.grid_points, cache)
    infer_ms = time_inference(prep, args.methods, MAIN)
    wall = time.perf_counter() - start

    print(f"\n{protocol.describe()}; lr chosen at missing rate {MAIN.rate} {MAIN.kind}, used at every setting")
    for key, study in studies.items():
        print(f"\n### missing rate {key}: test accuracy (%), chosen lr, paired difference to LoRA r = {settings.r}\n")
        print(study.table(baseline="lora" if "lora" in study.test else None))
    print("\n### every metric, mean ± sd over the test seeds\n")
    print(markdown_table(rows, infer_ms))
    print(
        f"\n{settings.epochs} epochs, batch {settings.batch_size}, r {settings.r}, top {settings.top_layers} layers "
        f"per tower, {settings.prompt_length} prompt tokens per layer; {args.threads} thread(s), wall {wall:.0f} s"
    )
    lines = verdicts(rows, infer_ms)
    print("\n".join(lines))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "settings": dataclasses.asdict(settings),
            "protocol": protocol.describe(),
            "main_setting": _key(MAIN.rate, MAIN.kind),
            "studies": {key: study.to_dict() for key, study in studies.items()},
            "rows": rows,
            "infer_ms": infer_ms,
            "verdicts": lines,
            "wall_s": wall,
        }
        args.json.write_text(json.dumps(payload, indent=2))


def _key(rate: float, kind: str) -> str:
    return f"{rate:g} {'-' if rate == 0 else kind}"


def run_protocol(
    prep: Any,
    specs: list[MissingSpec],
    methods: list[str],
    protocol: Protocol,
    points: int,
    cache: RunCache | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Study]]:
    """Choose each method's lr on validation at :data:`MAIN`, then test it over the seeds at every spec (every
    finished run recorded in ``cache``, and taken from it when it is already there).

    Returns:
        The rows (one per spec, method and test seed, as :func:`markdown_table` reads them) and one
        :class:`Study` per setting (the same validation grid and chosen rates, that setting's test scores).
    """
    grids = {method: log_grid(prep.settings.lr, points) for method in methods}

    cache = cache if cache is not None else RunCache(None, {})

    def train(method: str, lr: float, spec: MissingSpec, seed: int, split: str) -> dict[str, Any]:
        key = (method, lr, seed, split, _key(spec.rate, spec.kind))
        result = cache.get(key)
        if result is None:
            result = run_method(prep, method, spec, seed, lr=lr, split=split)
            cache.put(key, result)
        return result

    def score(method: str, lr: float, seed: int, split: str) -> tuple[float, dict[str, Any]]:
        result = train(method, lr, MAIN, seed, split)
        return result["acc"], result

    main = tune_and_test(grids, score, protocol)
    studies: dict[str, Study] = {}
    rows = []
    for spec in specs:
        if (spec.rate, spec.kind) == (MAIN.rate, MAIN.kind):
            study = main
        else:
            study = Study(protocol, validation=main.validation, chosen=main.chosen)
            for method, lr in main.chosen.items():
                results = []
                for seed in protocol.test_seeds:
                    result = train(method, lr, spec, seed, "test")
                    print(f"  test       {method:<20} lr {lr:<8g} seed {seed}: {100 * result['acc']:.1f} "
                          f"(rate {_key(spec.rate, spec.kind)})", flush=True)  # fmt: skip
                    results.append(result)
                study.test[method] = [r["acc"] for r in results]
                study.extras[method] = results
        studies[_key(spec.rate, spec.kind)] = study
        for method in study.chosen:
            for seed, result in zip(protocol.test_seeds, study.extras[method]):
                rows.append({"rate": spec.rate, "kind": spec.kind, "method": method, "seed": seed, **result})
    return rows, studies


def verdicts(rows: list[dict[str, Any]], infer_ms: dict[str, float]) -> list[str]:
    """The target at missing rate 0.7 (each type in the rows): MoRA's test accuracy above the best other method's
    (by mean), the 95 % t-interval of the paired (same seed) difference above 0; MoRA against LoRA at its parameter
    count at every setting (reported, not a target); MoRA's inference time against the prompt baseline's."""
    lines = []
    settings = dict.fromkeys((r["rate"], r["kind"]) for r in rows)
    for rate, kind in sorted(settings, key=lambda s: ((s[0], s[1]) != (MAIN.rate, MAIN.kind), s[0] != MAIN.rate)):
        acc: dict[str, dict[int, float]] = {}
        for r in rows:
            if (r["rate"], r["kind"]) == (rate, kind):
                acc.setdefault(r["method"], {})[r["seed"]] = r["acc"]
        if "mora" not in acc or len(acc) < 2:
            continue
        mean = {m: statistics.mean(v.values()) for m, v in acc.items()}
        rival = max((m for m in mean if m != "mora"), key=mean.get)
        if rate == MAIN.rate:
            diff, lo, hi, text = _paired(acc["mora"], acc[rival])
            met = "met" if diff > 0 and lo > 0 else "NOT met"
            lines.append(
                f"target: MoRA best at missing rate {_key(rate, kind)}: MoRA vs the best other method ({rival}) "
                f"{text} (lower end > 0): {met}"
            )
        if "lora_matched" in acc:
            lines.append(
                f"equal parameters, missing rate {_key(rate, kind)}: MoRA vs LoRA at MoRA's parameter count "
                f"(lora_matched) {_paired(acc['mora'], acc['lora_matched'])[3]}"
            )
    if "mora" in infer_ms and "prompts" in infer_ms:
        ratio = infer_ms["mora"] / infer_ms["prompts"]
        verdict = "met" if ratio <= 1 else "NOT met"
        lines.append(f"target: MoRA inference time / prompt baseline = {ratio:.2f}x (<= 1.00x): {verdict}")
    return lines


def _paired(ours: dict[int, float], peer: dict[int, float]) -> tuple[float, float, float, str]:
    """Paired (same seed) difference ``ours - peer``, its 95 % interval, and a line: both means and the interval."""
    seeds = sorted(set(ours) & set(peer))
    a, b = [ours[s] for s in seeds], [peer[s] for s in seeds]
    diff, lo, hi = paired_interval(a, b)
    text = (
        f"{mean_sd(a)} vs {mean_sd(b)}: {100 * diff:+.1f} points, 95 % CI [{100 * lo:+.1f}, {100 * hi:+.1f}] over "
        f"{len(seeds)} seeds"
    )
    return diff, lo, hi, text


if __name__ == "__main__":
    main()
