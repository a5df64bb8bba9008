"""SplitLoRA's statistics under FSDP2: what each process holds, sharded over the input features or whole.

Part 1, measured on 2 CPU processes (gloo, ``fully_shard`` on every decoder layer and the root): a random Llama
(hidden 256, intermediate 512, 2 layers, r = 16 on all seven projections), one task's statistics collected over the
same global batches (8 x 64 tokens, each process its half) with ``shard_statistics=True`` (each process keeps its
share of the features) and ``False`` (every process whole, the increment all-reduced at ``end_task``), for dense
covariances and for frequent-directions sketches of 64 rows. Per process: the running statistics after ``end_task``
and their peak while collecting (running + the task in progress), against one process; the statistics pass against a
plain forward of the sharded model (interleaved, per batch), the collectives per statistics batch, ``end_task``'s
time; and whether every module's split ``k*`` is one process's.

Part 2, on paper: the same per-process bytes for Llama-3-8B and -70B (``statistics="auto"``: every projection is
wider than 2048, so each keeps a 256-row sketch) on 8 processes, from the layout the code uses (``torch.chunk``'s
over the input features, :class:`peft_ext.distributed.features.FeatureShards`).

Usage (about a minute on a 2-core CPU; starts its own 2 processes, no torchrun needed)::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.splitlora_fsdp2 --json runs/benchmarks/splitlora_fsdp2.json

Target: statistics per process, running and while collecting, about ``1 / world`` of one process's (<= 0.55x at 2
processes: half, and what a split that is not even leaves over).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import torch
from peft import get_peft_model
from torch import nn

from benchmarks._lib.cli import benchmark_parser
from benchmarks._lib.processes import on_processes
from benchmarks._lib.tables import fmt_bytes, markdown_table
from peft_ext import SplitLoRAConfig
from peft_ext.continual.sharding import shard_model
from peft_ext.distributed import count_collectives
from peft_ext.models import tiny_llama
from peft_ext.tuners.splitlora import SplitLoRALayer
from peft_ext.tuners.splitlora.sharing import distinct_accumulators

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HIDDEN, LAYERS, VOCAB, RANK, BATCHES = 256, 2, 512, 16, 6  # BATCHES: the default of --batches
KINDS = {"dense": {"statistics": "dense"}, "sketch (64 rows)": {"statistics": "sketch", "sketch_rank": 64}}
LAYOUTS = {"sharded": True, "whole on every process": False}
LLAMA3 = (("Llama-3-8B", 4096, 1024, 14336, 32), ("Llama-3-70B", 8192, 1024, 28672, 80))
TARGET = 0.55


def batches(part: slice, count: int = BATCHES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (8, 64), generator=g)[part] for _ in range(count)]


def make_model(kind: dict[str, Any], sharded: bool) -> nn.Module:
    config = SplitLoRAConfig(r=RANK, target_modules=PROJECTIONS, shard_statistics=sharded, **kind)
    return get_peft_model(tiny_llama(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, seed=0), config)


def held_bytes(model: nn.Module) -> tuple[int, int]:
    """(running, task in progress) statistics bytes this process holds, over every module; an accumulator of the task
    in progress that modules fed the same input share is counted once."""
    layers = [m for m in model.modules() if isinstance(m, SplitLoRALayer)]
    running = sum(m.local_statistics("default").nbytes for m in layers)
    pending = sum(t.nbytes for p in distinct_accumulators(layers, "default") for t in p.values())
    return running, pending


def measure(
    kind: dict[str, Any], sharded: bool, part: slice, distributed: bool, count: int = BATCHES
) -> dict[str, Any]:
    model = make_model(kind, sharded)
    if distributed:  # each decoder layer a unit, the PeftModel the root: as the job shards it
        model = shard_model(model, torch.device("cpu"))
    model.begin_task()
    data = batches(part, count)
    plain, collect, calls, peak = [], [], [], 0
    with torch.no_grad():
        model(input_ids=data[0])  # warm-up (FSDP2's lazy init)
        with model.collect_statistics():
            for ids in data:
                with count_collectives() as counted:
                    model(input_ids=ids)
                calls.append(counted.calls)
                peak = max(peak, sum(held_bytes(model)))
        # timing: the same batches again, statistics and plain forward in turn (the order alternates)
        for i, ids in enumerate(data):
            for mode in ("plain", "stats") if i % 2 else ("stats", "plain"):
                start = time.perf_counter()
                if mode == "stats":
                    with model.collect_statistics():
                        model(input_ids=ids)
                else:
                    model(input_ids=ids)
                (collect if mode == "stats" else plain).append(time.perf_counter() - start)
    start = time.perf_counter()
    splits = model.end_task()
    end_task = time.perf_counter() - start
    with torch.no_grad():
        plain_calls = _plain_collectives(model, data[0])
    return {
        "running_bytes": held_bytes(model)[0],
        "collecting_bytes": peak,
        "plain_s": plain,
        "statistics_s": collect,
        "collectives_per_batch": statistics.median(calls) - plain_calls,
        "end_task_s": end_task,
        "splits": {key: s.k_star for key, s in splits.items()},
    }


def _plain_collectives(model: nn.Module, ids: torch.Tensor) -> int:
    with count_collectives() as counted:
        model(input_ids=ids)
    return counted.calls


def _on_process(rank: int, world: int, count: int = BATCHES) -> dict:
    per = 8 // world
    part = slice(rank * per, (rank + 1) * per)
    return {
        (kind, layout): measure(KINDS[kind], sharded, part, distributed=True, count=count)
        for kind in KINDS
        for layout, sharded in LAYOUTS.items()
    }


def _held(widths: list[int], rows: int, parts: int) -> int:
    # float32 bytes of a `rows`-row sketch (or buffer) per input width, each split over `parts` processes
    return sum(rows * -(-n // parts) * 4 for n in widths)


def on_paper(world: int, ell: int = 256) -> list[dict[str, Any]]:
    """Statistics bytes per process for the Llama-3 shapes: a float32 ``ell``-row sketch per projection, and while
    collecting the ``2 ell``-row buffer of the task in progress per distinct input (q/k/v share one, gate/up one),
    whole or split over ``world`` processes."""
    rows = []
    for name, h, _kv, inter, layers in LLAMA3:
        inputs = [h] * 6 + [inter]  # q, k, v, o, gate, up read the hidden state (or o the attention's); down inter
        distinct = [h, h, h, inter]  # q/k/v's hidden state, o's attention output, gate/up's hidden state, down's

        whole, mine = layers * _held(inputs, ell, 1), layers * _held(inputs, ell, world)
        buffers = layers * _held(distinct, 2 * ell, 1), layers * _held(distinct, 2 * ell, world)
        collecting = whole + buffers[0], mine + buffers[1]
        rows.append({"model": name, "world": world, "whole": whole, "sharded": mine, "collecting": collecting})
    return rows


def report(one: dict, ranks: list[dict], count: int = BATCHES) -> list[str]:
    head = ["statistics", "layout", "running / process", "while collecting", "/ one process (running, collecting)"]
    head += ["stats pass / plain forward", "collectives per stats batch", "end_task", "k* = one process's"]
    rows, lines = [], []
    for kind in KINDS:
        base = one[kind]
        for layout in LAYOUTS:
            r = [rank[(kind, layout)] for rank in ranks]
            running = max(x["running_bytes"] for x in r)
            collecting = max(x["collecting_bytes"] for x in r)
            # a batch ends when its slower process does; ratios per batch, median
            stats = [max(t) for t in zip(*(x["statistics_s"] for x in r))]
            plain = [max(t) for t in zip(*(x["plain_s"] for x in r))]
            ratio = statistics.median(s / p for s, p in zip(stats, plain))
            same = all(x["splits"] == base["splits"] for x in r)
            shares = (running / base["running_bytes"], collecting / base["collecting_bytes"])
            rows.append(
                [kind, layout, fmt_bytes(running), fmt_bytes(collecting), f"{shares[0]:.2f}x, {shares[1]:.2f}x",
                 f"{ratio:.2f}x", f"{r[0]['collectives_per_batch']:.0f}",
                 f"{1e3 * max(x['end_task_s'] for x in r):.0f} ms", "yes" if same else "NO"]
            )  # fmt: skip
            if LAYOUTS[layout]:
                verdict = "met" if max(shares) <= TARGET and same else "NOT met"
                lines.append(
                    f"target: {kind} statistics per process <= {TARGET}x one process's at 2 processes: running "
                    f"{shares[0]:.2f}x, while collecting {shares[1]:.2f}x, splits as one process's: {same}: {verdict}"
                )
    print(
        f"\n### Part 1: random Llama (hidden {HIDDEN}, {LAYERS} layers), r = {RANK} on 7 projections, FSDP2 on 2 "
        f"processes (gloo, CPU), {count} batches of 8 x 64 tokens (4 x 64 per process)\n"
    )
    print(markdown_table(head, rows, align="llrrlrrrl"))
    print("\n### Part 2, on paper: 256-row sketches of every projection's input, float32, 8 processes\n")
    head = ["model", "processes", "whole on every process", "sharded (per process)", "while collecting"]
    paper = [
        [p["model"], str(p["world"]), f"{p['whole'] / 2**30:.2f} GiB", f"{p['sharded'] / 2**30:.3f} GiB",
         f"{p['collecting'][0] / 2**30:.2f} -> {p['collecting'][1] / 2**30:.3f} GiB"]
        for p in on_paper(8)
    ]  # fmt: skip
    print(markdown_table(head, paper, align="lrrrr"))
    print()
    for line in lines:
        print(line)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, json="also write the numbers here")
    parser.add_argument("--batches", type=int, default=BATCHES, help=f"statistics batches per run (default {BATCHES})")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error(f"--batches must be at least 2 (a median of collectives needs them), got {args.batches}")
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    one = {kind: measure(KINDS[kind], True, slice(None), distributed=False, count=args.batches) for kind in KINDS}
    ranks = on_processes(_on_process, 2, args.batches)
    report(one, ranks, args.batches)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        flat = [{f"{k} / {layout}": v for (k, layout), v in rank.items()} for rank in ranks]
        args.json.write_text(json.dumps({"one_process": one, "ranks": flat}, indent=2, default=str))


if __name__ == "__main__":
    main()
