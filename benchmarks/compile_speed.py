"""``torch.compile`` against eager, per adapter type: graphs, compile time, training-step time, gradient agreement.

Each adapter type of peft_ext (Riemannion, SplitLoRA, PCLR on a random Llama with all 7 projections of every layer
adapted; MoRA, a dual-encoder adapter, on a random CLIP) and PEFT's LoRA as the reference. Per type two copies of
one model: one eager, one ``torch.compile``-d (the backend wrapped in a graph counter). The first compiled step
compiles (its time is the compile column); then the copies take turns, the order alternating per round, each step a
forward + backward (what ``torch.compile`` compiles; the optimizer step is the same eager code either way). The
ratio column is the median over rounds of compiled / eager step time, measured side by side in one run (absolute
times on a shared machine are not comparable between runs). The gradient column is the largest difference between
the copies' gradients of the first step, relative to the largest gradient.

PCLR runs as it trains a second task (static ranks of task 0 with its prototype stored, new ranks of task 1, a
shared LoRA), so every branch of its forward is timed.

Usage::

    OMP_NUM_THREADS=1 python -m benchmarks.compile_speed                 # inductor, width 256, every type
    python -m benchmarks.compile_speed --quick                           # smoke run: aot_eager, toy sizes

Target: every type compiles to one graph (0 graph breaks) with gradients equal to eager's to float
rounding (relative difference < 1e-4 printed as met).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn

from benchmarks._lib.cli import benchmark_parser, int_options, parse
from benchmarks._lib.graphs import GraphCounter
from benchmarks._lib.tables import markdown_table
from benchmarks._lib.timing import Interleaved, timed
from peft_ext import MoRAConfig, PCLRConfig, RiemannionConfig, SplitLoRAConfig
from peft_ext.models import tiny_clip, tiny_llama
from peft_ext.tuners.pclr import query_loss

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TYPES = ("lora", "riemannion", "splitlora", "pclr", "mora")
VOCAB = 256
#: Gradient agreement counted as float rounding: largest difference / largest gradient.
GRAD_TOLERANCE = 1e-4


def _pclr_second_task(model: nn.Module, batch: dict[str, torch.Tensor]) -> nn.Module:
    proto = model.query_prototype([batch])
    model.end_task(0, proto)
    model.begin_task(1, proto)
    with torch.no_grad():  # new b_i non-zero, so every factor gets a gradient
        for name, p in model.named_parameters():
            if ".pclr_B." in name:
                p.normal_(0.0, 0.02)
    return model


def _llama_case(name: str, args: argparse.Namespace) -> tuple[Callable[[], nn.Module], Callable[..., torch.Tensor]]:
    r = args.rank
    configs = {
        "lora": lambda: LoraConfig(r=r, target_modules=PROJECTIONS, init_lora_weights=False),
        "riemannion": lambda: RiemannionConfig(r=r, target_modules=PROJECTIONS, init_weights=False),
        "splitlora": lambda: SplitLoRAConfig(r=r, target_modules=PROJECTIONS, init_weights=False),
        "pclr": lambda: PCLRConfig(
            target_modules=PROJECTIONS,
            pool_size=4 * r,
            ranks_schedule=[2 * r],
            compress_schedule=[0.0],
            compress_rule="importance",
            top_k=r,
            alpha=float(r),
            shared_r=2,
            init_weights=False,
        ),
    }
    ids = torch.randint(0, VOCAB, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))

    def make() -> nn.Module:
        base = tiny_llama(vocab_size=VOCAB, hidden_size=args.width, num_layers=args.layers)
        torch.manual_seed(1)
        model = get_peft_model(base, configs[name]())
        if name == "pclr":
            torch.manual_seed(2)
            model = _pclr_second_task(model, {"input_ids": ids})
        return model.train()

    def loss(model: nn.Module, call: Callable[..., Any]) -> torch.Tensor:
        logits = call(input_ids=ids).logits
        value = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        extra = query_loss(model) if name == "pclr" else None
        return value if extra is None else value + extra

    return make, loss


def _clip_case(args: argparse.Namespace) -> tuple[Callable[[], nn.Module], Callable[..., torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    inputs = {
        "input_ids": torch.randint(3, 128, (args.batch, 16), generator=g),
        "pixel_values": torch.randn(args.batch, 3, 16, 16, generator=g),
    }

    def make() -> nn.Module:
        base = tiny_clip(text_hidden=args.width, vision_hidden=args.width)
        torch.manual_seed(1)
        return get_peft_model(base, MoRAConfig(r=args.rank, init_weights=False)).train()

    def loss(model: nn.Module, call: Callable[..., Any]) -> torch.Tensor:
        return call(**inputs, return_loss=True).loss

    return make, loss


def _step(
    model: nn.Module, call: Callable[..., Any], loss: Callable[..., torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward + backward: its seconds and the gradients it left (then cleared)."""
    seconds = timed(lambda: loss(model, call).backward())
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return seconds, grads


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One adapter type: graphs, compile seconds, eager / compiled step times and their ratio, gradient agreement."""
    make, loss = _clip_case(args) if name == "mora" else _llama_case(name, args)
    torch._dynamo.reset()
    eager, compiled = make(), make()
    counter = GraphCounter(args.backend)
    compiled_call = torch.compile(compiled, backend=counter)
    _, reference = _step(eager, eager, loss)
    compile_s, first = _step(compiled, compiled_call, loss)
    scale = max(g.abs().max().item() for g in reference.values())
    diff = max((first[n] - g).abs().max().item() for n, g in reference.items())
    calls = {"eager": (eager, eager), "compiled": (compiled, compiled_call)}
    for label in calls:  # one more warm-up step each (allocator, caches)
        _step(*calls[label], loss)
    timer = Interleaved(list(calls))  # the order alternates round by round
    for _ in range(args.rounds):
        timer.round({label: partial(_step, *calls[label], loss) for label in calls})
    return {
        "adapter": name,
        "graphs": counter.graphs,
        "compile_s": compile_s,
        "eager_ms": 1000 * timer.median("eager"),
        "compiled_ms": 1000 * timer.median("compiled"),
        "ratio": timer.ratio("compiled", "eager").median,
        "grad_rel_diff": diff / scale,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ["adapter", "graphs", "compile s", "eager ms / step", "compiled ms / step", "compiled / eager"]
    cells = [
        [r["adapter"], r["graphs"], f"{r['compile_s']:.1f}", f"{r['eager_ms']:.1f}", f"{r['compiled_ms']:.1f}",
         f"{r['ratio']:.2f}x", f"{r['grad_rel_diff']:.1e}"]
        for r in rows
    ]  # fmt: skip
    return markdown_table([*head, "max grad diff (rel.)"], cells)


#: ``--quick``: aot_eager, width 32, lora and pclr, 2 rounds
QUICK = {"backend": "aot_eager", "width": 32, "rank": 4, "tokens": 8, "rounds": 2, "types": ["lora", "pclr"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    quick = "smoke run: aot_eager, width 32, lora and pclr, 2 rounds"
    parser = benchmark_parser(__doc__, quick=quick, json="also write the rows here", threads=1)
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, ...)")
    parser.add_argument("--width", type=int, default=256, help="hidden width of the Llama (and of CLIP's towers)")
    int_options(parser, layers=2, rank=16, batch=4, tokens=64)
    parser.add_argument("--rounds", type=int, default=20, help="interleaved timed steps per copy")
    return parse(parser, argv, quick=QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.types:
        rows.append(measure(name, args))
        print(f"  {name}: {rows[-1]}", flush=True)
    print(
        f"\n### torch.compile ({args.backend}) vs eager, forward + backward, random Llama width {args.width} x "
        f"{args.layers} layers (CLIP towers width {args.width} for MoRA), r={args.rank}, batch {args.batch} x "
        f"{args.tokens} tokens, {args.threads} thread(s), median of {args.rounds} interleaved rounds\n"
    )
    print(table(rows))
    ok = all(r["graphs"] == 1 and r["grad_rel_diff"] < GRAD_TOLERANCE for r in rows)
    print(
        f"\ntarget: every type one graph (0 graph breaks) with gradients equal to eager's (relative difference < "
        f"{GRAD_TOLERANCE:g}): {'met' if ok else 'NOT met'}"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
