"""Causal-LM fine-tuning in bf16 on a tiny Llama: LoRA + AdamW, Riemannion and LoRA + DCT-AdamW, measured in one run.

The setting users train in, shrunk to a CPU: a decoder-only LM whose weights *and* adapters are bfloat16
(``model.to(torch.bfloat16)``, ``autocast_adapter_dtype=False``), every attention and MLP projection adapted at rank
8, next-token loss on byte-level text.

- Base: ``tiny_llama`` (hidden 128, 2 layers, 258-token byte vocabulary) pretrained from its random init in float32
  with AdamW on WordNet **noun** glosses (committed data, ``peft_ext/data``), then cast to bf16 and frozen. The
  adapters then learn a shifted domain, WordNet **verb** glosses, so there is something to adapt.
- Data: each split's definitions joined by newlines as UTF-8 bytes; batches are random windows of ``--seq`` bytes
  (drawn from the seed). Validation: 20% of the training-split verb synsets (by synset id hash), used only to choose
  each method's learning rate; test: WordNet's own test split of the verb synsets.
- Methods, same steps and batches per seed: ``lora_adamw`` (PEFT LoRA r=8, alpha 16, ``torch.optim.AdamW``),
  ``riemannion`` (Riemannion r=8 with the Riemannion optimizer), ``lora_dct_adamw`` (the same LoRA with DCT-AdamW,
  rank 4 of each factor's 8-wide side). Each method's lr is the best final validation loss over its 3-point grid
  (seed 0; ``GRID``); the other seeds rerun only that lr.
- Step time: forward + backward + optimizer step, the three methods' steps interleaved (one step of each in turn) so
  load on a shared machine hits them alike; median over all steps after the first 3 of every seed.
- Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during training minus the memory before the adapters were
  added. On CPU, one fresh process per method (``--memory-probe``): its peak resident set (Linux ``VmHWM``, reset
  through ``/proc/self/clear_refs``) while it adds the adapters and trains ``--probe-steps`` steps, minus its resident
  set just before. Optimizer state is counted exactly (bytes of the tensors in ``optimizer.state``).

Prints one markdown table (final validation and test loss, mean ± sd over seeds; step time; peak memory; optimizer
state) and writes the loss curves (validation loss against step, mean ± sd band) to ``--png``.

Usage (about 10 minutes on 2 shared CPU cores; ``--quick`` is a one-minute smoke run)::

    python -m benchmarks.causal_lm_bf16 --png docs/figures/causal_lm_bf16.png

bf16 matrix products on a CPU without AVX512-BF16 / AMX run about 10x slower than float32; the sizes are chosen for
that, and the step times say nothing about a GPU. Timings default to one thread (``--threads``), as in the other
benchmarks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from benchmarks._lib import machine
from benchmarks._lib.cache import without, write_json_atomic
from benchmarks._lib.cli import benchmark_parser, int_options, parse
from benchmarks._lib.data import (
    eval_loss,
    evaluation_windows,
    plot_loss_curves,
    random_windows,
    state_bytes,
)
from benchmarks._lib.tables import markdown_table, mean_sd
from benchmarks._lib.timing import Interleaved
from peft_ext import RiemannionConfig
from peft_ext.data.wordnet import LEXNAMES, load_wordnet_glosses
from peft_ext.models import tiny_llama
from peft_ext.optim import DCTAdamW, Riemannion

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB, PAD = 258, 256  # bytes, then a padding id the loss never sees (windows are full, so it is never used)
RANK = 8
METHODS = ("lora_adamw", "riemannion", "lora_dct_adamw")
GRID = {
    "lora_adamw": (1e-3, 3e-3, 1e-2),
    "riemannion": (3e-3, 1e-2, 3e-2),  # a first run's grid (1e-2, 3e-2, 1e-1) was best at its low edge
    "lora_dct_adamw": (1e-3, 3e-3, 1e-2),
}


# -- data ----------------------------------------------------------------------------------------------------------


def _held_out(synset: str) -> bool:
    return hashlib.sha1(f"val:{synset}".encode()).digest()[0] < 52  # ~20% of the training split


def byte_streams() -> dict[str, torch.Tensor]:
    """``pretrain`` (noun glosses), ``train`` / ``val`` (verb glosses of the training split) and ``test`` (verb
    glosses of WordNet's test split), each one long uint8 stream of newline-joined definitions."""
    nouns = [name for name in LEXNAMES if name.startswith("noun.")]
    verbs = [name for name in LEXNAMES if name.startswith("verb.")]
    parts: dict[str, list[str]] = {"pretrain": [], "train": [], "val": [], "test": []}
    for ex in load_wordnet_glosses(split="train", supersenses=nouns):
        parts["pretrain"].append(ex.definition)
    for ex in load_wordnet_glosses(split="train", supersenses=verbs):
        parts["val" if _held_out(ex.synset) else "train"].append(ex.definition)
    for ex in load_wordnet_glosses(split="test", supersenses=verbs):
        parts["test"].append(ex.definition)
    return {k: torch.frombuffer(bytearray("\n".join(v).encode()), dtype=torch.uint8).long() for k, v in parts.items()}


# -- models ----------------------------------------------------------------------------------------------------------


def pretrained_base(args: argparse.Namespace, stream: torch.Tensor, cache: Path | None) -> dict[str, torch.Tensor]:
    """The float32 state dict of the base after full pretraining on ``stream`` (cached in ``cache``)."""
    key = f"h{args.hidden}-l{args.layers}-s{args.pretrain_steps}-q{args.seq}"
    path = cache / f"base-{key}.pt" if cache is not None else None
    if path is not None and path.is_file():
        return torch.load(path, weights_only=True)
    model = tiny_llama(vocab_size=VOCAB, hidden_size=args.hidden, num_layers=args.layers, seed=1234).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1234)
    for step in range(args.pretrain_steps):
        ids = random_windows(stream, 32, args.seq, gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.pretrain_steps - 1:
            print(f"[pretrain] step {step} loss {loss.item():.3f}", flush=True)
    state = model.state_dict()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    return state


def bf16_base(args: argparse.Namespace, state: dict[str, torch.Tensor] | None) -> nn.Module:
    model = tiny_llama(vocab_size=VOCAB, hidden_size=args.hidden, num_layers=args.layers, seed=1234)
    if state is not None:
        model.load_state_dict(state)
    return model.to(torch.bfloat16)


def with_adapter(method: str, base: nn.Module, lr: float, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The bf16 PEFT model of ``method`` (adapters in bf16 too) and its optimizer."""
    torch.manual_seed(seed)
    if method == "riemannion":
        config = RiemannionConfig(r=RANK, target_modules=TARGETS)
    else:
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(base, config, autocast_adapter_dtype=False)
    model.train()
    if method == "riemannion":
        optimizer: torch.optim.Optimizer = Riemannion(model, lr=lr)
    elif method == "lora_dct_adamw":
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimizer = DCTAdamW(named, lr=lr, rank=RANK // 2, target_modules=TARGETS)
    else:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


# -- one interleaved run -------------------------------------------------------------------------------------------


def run_interleaved(
    args: argparse.Namespace, state: dict[str, torch.Tensor], data: dict[str, Any], lrs: dict[str, float], seed: int
) -> dict[str, dict[str, Any]]:
    """Train every method of ``lrs`` for ``args.steps`` steps on the same batches, one step of each in turn."""
    runs = {}
    for method, lr in lrs.items():
        model, optimizer = with_adapter(method, bf16_base(args, state), lr, seed)
        runs[method] = {"model": model, "optimizer": optimizer, "curve": [(0, eval_loss(model, data["val"]))]}
    gen = torch.Generator().manual_seed(seed)
    timer = Interleaved(list(runs), warmup=3)  # the first 3 steps (lazy state) are not timed
    for step in range(1, args.steps + 1):
        ids = random_windows(data["train"], args.batch, args.seq, gen)
        steps = {method: partial(train_step, run["model"], run["optimizer"], ids) for method, run in runs.items()}
        for loss in timer.round(steps).values():
            if not torch.isfinite(torch.tensor(loss)):
                raise FloatingPointError(f"non-finite loss at step {step}")
        if step % args.eval_every == 0 or step == args.steps:
            for run in runs.values():
                run["curve"].append((step, eval_loss(run["model"], data["val"])))
    out = {}
    for method, run in runs.items():
        out[method] = {
            "lr": lrs[method],
            "curve": run["curve"],
            "val": run["curve"][-1][1],
            "test": eval_loss(run["model"], data["test"]),
            "times": timer.times(method),
            "state_bytes": state_bytes(run["optimizer"]),
            "trainable": sum(p.numel() for p in run["model"].parameters() if p.requires_grad),
        }
    return out


# -- memory ----------------------------------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory_probe(args: argparse.Namespace, method: str) -> dict[str, float]:
    """Peak memory of adding ``method``'s adapters and training ``args.probe_steps`` steps (this process alone)."""
    base = bf16_base(args, None)  # the values do not matter for memory
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    if torch.cuda.is_available():
        base, ids = base.cuda(), ids.cuda()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model, optimizer = with_adapter(method, base, GRID[method][0], 0)
        for _ in range(args.probe_steps):
            train_step(model, optimizer, ids)
        torch.cuda.synchronize()
        return {"peak_mib": (torch.cuda.max_memory_allocated() - before) / 2**20, "how": "cuda max_memory_allocated"}
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _rss_kib("VmRSS")
    model, optimizer = with_adapter(method, base, GRID[method][0], 0)
    for _ in range(args.probe_steps):
        train_step(model, optimizer, ids)
    return {"peak_mib": (_rss_kib("VmHWM") - before) / 1024, "how": "peak RSS delta (VmHWM)"}


def measure_memory(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    if torch.cuda.is_available():
        return {m: memory_probe(args, m) for m in METHODS}
    if not Path("/proc/self/clear_refs").exists():
        return {m: {"peak_mib": float("nan"), "how": "not measured (needs Linux /proc)"} for m in METHODS}
    out = {}
    for method in METHODS:
        cmd = [sys.executable, "-m", "benchmarks.causal_lm_bf16", "--memory-probe", method, *_size_flags(args)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        text = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT).stdout
        out[method] = json.loads(text.strip().splitlines()[-1])
    return out


def _size_flags(args: argparse.Namespace) -> list[str]:
    return [
        f"--hidden={args.hidden}",
        f"--layers={args.layers}",
        f"--batch={args.batch}",
        f"--seq={args.seq}",
        f"--probe-steps={args.probe_steps}",
        f"--threads={args.threads}",
    ]


# -- report ----------------------------------------------------------------------------------------------------------


def plot(results: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    curves = {f"{method} (lr {seeds[0]['lr']:g})": [r["curve"] for r in seeds] for method, seeds in results.items()}
    plot_loss_curves(curves, path, title)


#: ``--quick``: tiny sizes, 1 seed, 1 lr per method
QUICK = {"seeds": [0], "steps": 4, "eval_every": 2, "hidden": 64, "layers": 1, "pretrain_steps": 5}
QUICK |= {"eval_windows": 8, "probe_steps": 1}


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, quick="smoke run: tiny sizes, 1 seed, 1 lr per method", json=True, threads=1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    int_options(parser, steps=60, eval_every=10, batch=8, seq=32, hidden=128, layers=2, pretrain_steps=300)
    int_options(parser, eval_windows=64, probe_steps=3)
    parser.add_argument("--png", type=Path, default=None, help="write the loss curves here")
    parser.add_argument("--cache", type=Path, default=Path("runs/causal_lm_bf16"), help="pretrained base cache")
    parser.add_argument("--memory-probe", choices=METHODS, default=None, help=argparse.SUPPRESS)
    args = parse(parser, argv, quick=QUICK)
    torch.set_num_threads(args.threads)
    if args.memory_probe is not None:
        print(json.dumps(memory_probe(args, args.memory_probe)))
        return

    wall = time.perf_counter()
    streams = byte_streams()
    data = evaluation_windows(streams, args.eval_windows, args.seq, val="val", test="test")
    state = pretrained_base(args, streams["pretrain"], None if args.quick else args.cache)

    # learning rates: seed 0, every grid point, best final validation loss
    grid = {m: (GRID[m][1],) if args.quick else GRID[m] for m in METHODS}
    sweep: dict[str, dict[float, dict[str, Any]]] = {m: {} for m in METHODS}
    for i in range(max(len(g) for g in grid.values())):
        lrs = {m: g[i] for m, g in grid.items() if i < len(g)}
        for method, result in run_interleaved(args, state, data, lrs, args.seeds[0]).items():
            sweep[method][lrs[method]] = result
            print(f"[sweep] {method} lr {lrs[method]:g}: val {result['val']:.4f}", flush=True)
    chosen = {m: min(sweep[m], key=lambda lr, m=m: sweep[m][lr]["val"]) for m in METHODS}
    results = {m: [sweep[m][chosen[m]]] for m in METHODS}
    for seed in args.seeds[1:]:
        for method, result in run_interleaved(args, state, data, chosen, seed).items():
            results[method].append(result)
            print(f"[seed {seed}] {method}: val {result['val']:.4f}", flush=True)
    memory = measure_memory(args)

    base_val = eval_loss(bf16_base(args, state), data["val"])
    size = f"hidden {args.hidden}, {args.layers} layers, r={RANK} on all 7 projections"
    print(
        f"\n### bf16 causal-LM fine-tuning, tiny Llama ({size}), WordNet verb glosses (bytes), {args.steps} steps "
        f"x {args.batch} x {args.seq} bytes, seeds {args.seeds} (loss: nats / byte, mean ± sd over seeds; frozen base "
        f"val {base_val:.3f})\n"
    )
    how = next(iter(memory.values()))["how"]
    head = ["method", "lr (grid)", "final val loss", "test loss", "step ms (median)", f"peak memory MiB ({how})"]
    rows = []
    for method in METHODS:
        runs = results[method]
        times = [t for r in runs for t in r["times"]]
        grid_text = ", ".join(f"{lr:g}" for lr in grid[method])
        rows.append(
            [method, f"{chosen[method]:g} ({grid_text})", mean_sd([r["val"] for r in runs], scale=1.0, digits=3),
             mean_sd([r["test"] for r in runs], scale=1.0, digits=3), f"{1000 * statistics.median(times):.1f}",
             f"{memory[method]['peak_mib']:.1f}", f"{runs[0]['state_bytes'] / 1024:.1f}", f"{runs[0]['trainable']:,}"]
        )  # fmt: skip
    print(markdown_table([*head, "optimizer state KiB", "trainable params"], rows, align="ll" + "r" * 6))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    device = "CUDA" if torch.cuda.is_available() else "CPU"
    print(machine.wall_line(wall, args.threads, f"{device}; peak RSS of this process {rss:.0f} MiB"))
    if args.png is not None:
        plot(results, args.png, f"tiny Llama bf16 ({size}), {len(args.seeds)} seed(s)")
        print(f"loss curves: {args.png}")
    if args.json is not None:
        write_json_atomic(args.json, {"chosen": chosen, "results": without(results, "times"), "memory": memory})


if __name__ == "__main__":
    main()
