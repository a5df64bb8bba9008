"""DCT-AdamW in the paper's own regime: a small Llama pretrained from scratch, every optimizer at the same budget.

The DCT-AdamW paper (arXiv 2505.17967) and GaLore / APOLLO make their claims on Llama pretraining (perplexity),
not fine-tuning. This benchmark shrinks that setting to two CPU cores.

- Model: ``tiny_llama`` (transformers ``LlamaForCausalLM``) trained from its random init: hidden 256, 8 layers,
  4 heads (2 key/value heads), MLP 512, byte vocabulary (256): 4.85 M parameters, of which 4.72 M sit in the 56
  attention / MLP projections. A step is ``--batch`` x ``--seq`` = 16 x 64 = 1,024 bytes; ``--steps`` 400 make
  410 k training tokens per run, the same for every optimizer.
- Data: the WordNet gloss corpus (``peft_ext.data.wordnet.read_gloss_file``, committed): each synset's definition and
  its example sentences, one per line, as UTF-8 bytes (8.8 MB). Split by synset: WordNet's own test split (about 20 %
  of synsets) is the reported **test** split; **validation** is 10 % of the training synsets, carved by a SHA-1 hash of
  the synset id, used only to choose learning rates. Batches are random windows of the training stream drawn from the
  seed (``causal_lm_bf16``'s pipeline, in ``benchmarks/_lib/data.py``); evaluation uses ``--eval-windows`` evenly
  spaced windows of each split, the same for every run.
- Optimizers: ``adamw`` (``torch.optim.AdamW``), ``galore`` (``galore_torch.GaLoreAdamW``, SVD), ``apollo``
  (``apollo_torch.APOLLOAdamW``, random projection, channel-wise scaling), ``dct_adamw`` (``DCTAdamW``,
  ``projection="dct"``), ``subspace_adamw`` (``SubspaceAdamW``, ``projection="power"``), ``dct_channel``
  (``DCTAdamW(update="channel")``) and ``subspace_channel`` (``SubspaceAdamW(update="channel")``). Every low-rank
  one projects the same 56 matrices (q/k/v/o and gate/up/down projections) at the same ``--rank`` (64 = hidden / 4,
  GaLore's ratio for its 60 M model) and refreshes its subspace every ``--gap`` = 50 steps (GaLore's and APOLLO's
  200 in a 10 k-step run is 50 refreshes; at 400 steps 50 gives 8; the DCT paper's own default is 1); embeddings,
  the LM head and the norms get plain AdamW inside the same optimizer, as in GaLore's pretraining. Scale: each
  update rule's paper default, not tuned: 0.25 for the projected updates (GaLore's pretraining recipe; GaLore,
  DCT-AdamW, SubspaceAdamW), 1 for the channel-scaled ones (APOLLO's default; APOLLO and both ``update="channel"``
  options). Everything else is shared: betas (0.9, 0.999), eps 1e-8, no weight decay, gradient clipping at norm
  ``--clip`` 1.0, linear warmup over 10 % of the steps then cosine decay to 10 % of the lr (GaLore's schedule).
- Protocol (``benchmarks/_lib/protocol.py``): each optimizer's lr from a 3-point log grid (``GRIDS``, the same budget)
  by final validation loss on seed 0, then test seeds 0, 1, 2 at that lr (a seed sets the init and the batches).
  Perplexity is per byte, ``exp(mean loss)``. A run whose loss turns non-finite counts as infinite loss.
- Time per step: all optimizers of one lr setting train side by side in one process, one step of each in turn on
  the same batch (forward + backward + clip + step), so machine load hits them alike; the median over the steps
  after the first 3 and the mean (which carries the periodic refreshes, e.g. GaLore's SVD) are printed.
- Optimizer state: bytes of every tensor reachable from ``optimizer.state`` (GaLore's and APOLLO's projector
  matrices included); the DCT matrix shared by every layer of one size is process-wide and printed apart.

Prints the table (validation and test perplexity mean ± sd, chosen lr, state, step time) and three verdict lines:
DCT-AdamW ~ GaLore (the 95 % interval of the paired test-perplexity ratio inside [1/1.02, 1.02]); the best SVD-free
peft-ext option (picked by validation) has perplexity <= min(GaLore, APOLLO) (upper end of the interval <= 1); its
optimizer state <= GaLore's. Writes the validation loss curves (mean ± sd over test seeds) to ``--png``.

Usage (the default is 5 rounds of the 7 optimizers side by side: 35 runs of 400 steps, ``--jobs`` rounds at a time
in worker processes, 2 by default: the 3 grid rounds, then the 2 further test seeds' rounds; every round is
single-threaded and deterministic, so the numbers are those of one process, and the step times of a round are still
measured side by side within it; with ``--runs`` every finished run is saved and a restarted job trains only the
missing ones)::

    python -m benchmarks.pretrain_llama --png docs/figures/pretrain_llama_loss.png \\
        --json runs/benchmarks/pretrain_llama.json --runs runs/benchmarks/pretrain_llama-runs.json
    python -m benchmarks.pretrain_llama --quick      # every code path at toy size, under a minute

Cost, measured on the shared 2-core machine (load average 5 to 8) with one torch thread: forward + backward of one
step 0.49 s, the optimizer step 15 ms (AdamW) to 55 ms (channel variants), GaLore's first SVD refresh 0.54 s; one
full-size run (``--optimizers dct_adamw --grid-points 1 --test-seeds 0``: one optimizer, one lr, one seed) took
4.4 min wall (median step 562 ms). The default is 35 such runs in 5 rounds: 100 min on 2 idle cores one round after
another (``--jobs 1``), about an hour with the default 2 jobs (3 rounds of grid, 2 at once, then 2 of test). One
thread per process is the default because two threads on the loaded machine stalled at OpenMP barriers (the same
step took 1 s or 8 s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._lib import machine
from benchmarks._lib.cache import RunCache, without, write_json_atomic
from benchmarks._lib.cli import benchmark_parser, int_options, parse
from benchmarks._lib.data import (
    eval_loss,
    evaluation_windows,
    plot_loss_curves,
    random_windows,
    tensor_bytes,
)
from benchmarks._lib.jobs import in_workers, missing_runs
from benchmarks._lib.protocol import Protocol, Study, paired_interval, tune_and_test
from benchmarks._lib.tables import markdown_table
from benchmarks._lib.timing import Interleaved
from peft_ext.data.wordnet import read_gloss_file
from peft_ext.models import tiny_llama
from peft_ext.optim import DCTAdamW, SubspaceAdamW
from peft_ext.optim.dct import dct_cache_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 256  # bytes
OPTIMIZERS = ("adamw", "galore", "apollo", "dct_adamw", "subspace_adamw", "dct_channel", "subspace_channel")
#: peft-ext's SVD-free options (APOLLO is SVD-free too, but it is the peer)
OURS = ("dct_adamw", "subspace_adamw", "dct_channel", "subspace_channel")
PROJECTED_SCALE = 0.25  # GaLore's pretraining scale, for every projected update
CHANNEL_SCALE = 1.0  # APOLLO's default scale, for every channel-scaled update
#: Each optimizer's 3-point grid (the same budget): the first two points were 3e-3 and 1e-2 (AdamW 1e-3 and 3e-3),
#: around GaLore's / APOLLO's pretraining lr 1e-2; the third extends the grid half a decade beyond the better of the
#: two on validation (seed 0), so the chosen lr is interior unless the third point wins. Measured (val nats / byte):
#: AdamW 1.984 / 2.180 at 1e-3 / 3e-3, GaLore 1.924 / 1.886 at 3e-3 / 1e-2; APOLLO 1.903 / 1.991, DCT-AdamW
#: 1.975 / 2.045, SubspaceAdamW 1.875 / 1.880, DCT channel 1.899 / 2.082, power channel 1.933 / 2.013 at 3e-3 / 1e-2.
GRIDS = {name: (1e-3, 3e-3, 1e-2) for name in OPTIMIZERS} | {"adamw": (3e-4, 1e-3, 3e-3), "galore": (3e-3, 1e-2, 3e-2)}
EQUIVALENCE = 0.02  # "DCT-AdamW ~ GaLore": perplexity ratio within 2 %, judged on the 95 % interval


# -- data ----------------------------------------------------------------------------------------------------------


def _validation(synset: str, percent: int = 10) -> bool:
    return int.from_bytes(hashlib.sha1(f"pretrain-val:{synset}".encode()).digest()[:8], "big") % 100 < percent


def gloss_streams() -> dict[str, torch.Tensor]:
    """``train`` / ``validation`` / ``test`` byte streams of the gloss corpus, disjoint by synset.

    Each synset contributes its definition and its example sentences, one per line.
    """
    parts: dict[str, list[str]] = {"train": [], "validation": [], "test": []}
    for record in read_gloss_file():
        split = "test" if record.split == "test" else "validation" if _validation(record.synset) else "train"
        parts[split].append("\n".join((record.definition, *record.examples)))
    return {k: torch.frombuffer(bytearray("\n".join(v).encode()), dtype=torch.uint8).long() for k, v in parts.items()}


# -- optimizers ----------------------------------------------------------------------------------------------------


def _is_target(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in TARGETS


def build_optimizer(name: str, model: nn.Module, lr: float, args: argparse.Namespace) -> torch.optim.Optimizer:
    """``name``'s optimizer over ``model``: the projections low-rank (rank ``args.rank``, refresh every
    ``args.gap`` steps), everything else plain AdamW; betas (0.9, 0.999), eps 1e-8, no weight decay for all."""
    named = list(model.named_parameters())
    common = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    if name == "adamw":
        return torch.optim.AdamW([p for _, p in named], **common)
    if name in ("galore", "apollo"):
        plain = [p for n, p in named if not _is_target(n)]
        low = {"params": [p for n, p in named if _is_target(n)], "rank": args.rank, "update_proj_gap": args.gap}
        low["proj_type"] = "std"  # project the smaller side, as DCT-AdamW's side="auto"
        if name == "galore":
            from galore_torch import GaLoreAdamW

            groups = [{"params": plain}, {**low, "scale": PROJECTED_SCALE}]
            return GaLoreAdamW(groups, no_deprecation_warning=True, **common)
        from apollo_torch import APOLLOAdamW

        groups = [{"params": plain}, {**low, "proj": "random", "scale_type": "channel", "scale": CHANNEL_SCALE}]
        return APOLLOAdamW(groups, **common)
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {OPTIMIZERS}")
    cls = DCTAdamW if name.startswith("dct") else SubspaceAdamW
    channel = name.endswith("_channel")
    return cls(
        named,
        rank=args.rank,
        update_proj_gap=args.gap,
        target_modules=TARGETS,
        scale=CHANNEL_SCALE if channel else PROJECTED_SCALE,
        update="channel" if channel else "projected",
        **common,
    )


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 10 % (GaLore's pretraining schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


# -- one round: several optimizers side by side ----------------------------------------------------------------------


def train_round(
    args: argparse.Namespace, data: dict[str, torch.Tensor], lrs: dict[str, float], seed: int
) -> dict[str, dict[str, Any]]:
    """Train one model per entry of ``lrs`` for ``args.steps`` steps on the same batches, one step of each in turn.

    Returns ``{name: {"val", "test" (final losses), "curve", "times", "state_bytes", "diverged"}}``.
    """
    runs: dict[str, dict[str, Any]] = {}
    warmup = max(1, round(args.warmup * args.steps))
    for name, lr in lrs.items():
        model = tiny_llama(vocab_size=VOCAB, hidden_size=args.hidden, num_layers=args.layers, seed=seed).train()
        optimizer = build_optimizer(name, model, lr, args)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, total=args.steps, warmup=warmup))
        runs[name] = {"model": model, "optimizer": optimizer, "schedule": schedule, "diverged": None}
        runs[name]["curve"] = [(0, eval_loss(model, data["val_windows"]))]
    gen = torch.Generator().manual_seed(seed)
    timer = Interleaved(list(runs), warmup=3)  # the first 3 steps (lazy state) are not timed
    for step in range(1, args.steps + 1):
        ids = random_windows(data["train"], args.batch, args.seq, gen)
        live = {name: partial(_step, run, ids, args.clip) for name, run in runs.items() if run["diverged"] is None}
        for name, loss in timer.round(live).items():
            if loss is None or not math.isfinite(loss):
                runs[name]["diverged"] = step
        if step % args.eval_every == 0 or step == args.steps:
            for run in runs.values():
                value = math.inf if run["diverged"] is not None else eval_loss(run["model"], data["val_windows"])
                run["curve"].append((step, value))
    out = {}
    for name, run in runs.items():
        failed = run["diverged"] is not None
        out[name] = {
            "val": run["curve"][-1][1],
            "test": math.inf if failed else eval_loss(run["model"], data["test_windows"]),
            "curve": run["curve"],
            "times": timer.times(name),
            "state_bytes": tensor_bytes(run["optimizer"].state),
            "shared_dct_bytes": dct_cache_bytes(),  # process-wide, after this round (the process may be a worker)
            "diverged": run["diverged"],
        }
        print(
            f"[round seed {seed}] {name:<17} lr {lrs[name]:<7g} val {out[name]['val']:.4f} "
            f"test {out[name]['test']:.4f}" + (f" (diverged at step {run['diverged']})" if failed else ""),
            flush=True,
        )
    return out


def _step(run: dict[str, Any], ids: torch.Tensor, clip: float) -> float | None:
    """One training step (forward, backward, clipping, optimizer and schedule step): the loss, or ``None`` when the
    optimizer refused a non-finite gradient."""
    try:
        loss = run["model"](input_ids=ids, labels=ids).loss
        loss.backward()
        if clip > 0:
            nn.utils.clip_grad_norm_(run["model"].parameters(), clip)
        run["optimizer"].step()
    except FloatingPointError:  # DCTAdamW's non-finite gradient check
        return None
    run["optimizer"].zero_grad(set_to_none=True)
    run["schedule"].step()
    return loss.item()


def run_protocol(args: argparse.Namespace, data: dict[str, torch.Tensor], names: list[str]) -> Study:
    """``tune_and_test`` over ``names``, its runs served from rounds of every optimizer side by side: a
    validation miss trains grid point ``i`` of every optimizer, a test miss every optimizer at its chosen lr. With
    ``--jobs`` above 1 the rounds the protocol needs next are trained that many at a time in worker processes first
    (the grid's rounds, then the test seeds'): the same numbers, each round being single-threaded and deterministic."""
    grids = {n: GRIDS[n][: args.grid_points] if args.grid_points < 3 else GRIDS[n] for n in names}
    protocol = Protocol(tune_seeds=tuple(args.tune_seeds), test_seeds=tuple(args.test_seeds))
    fixed = ("hidden", "layers", "rank", "gap", "batch", "seq", "steps", "warmup", "clip")
    fixed += ("eval_every", "eval_windows")
    cache = RunCache(args.runs, {k: getattr(args, k) for k in fixed})
    if args.runs is not None:
        print(f"[pretrain_llama] {len(cache)} finished run(s) saved in {args.runs} will be reused", flush=True)

    def chosen(name: str) -> float:  # the protocol's rule: first maximum of the mean validation score
        return max(grids[name], key=lambda lr: statistics.mean(-cache[(name, lr, s)]["val"] for s in args.tune_seeds))

    def round_of(name: str, lr: float, seed: int, split: str) -> tuple[dict[str, float], int]:
        """The round that trains run ``(name, lr, seed)``: only its optimizers not saved yet (a resumed job)."""
        if split == "validation":
            point = grids[name].index(lr)
            lrs = {n: g[point] for n, g in grids.items()}
        else:
            lrs = {n: chosen(n) for n in names}
        return {n: lr_n for n, lr_n in lrs.items() if (n, lr_n, seed) not in cache}, seed

    def save(round_: tuple[dict[str, float], int], results: dict[str, dict[str, Any]]) -> None:
        lrs, seed = round_
        for n, result in results.items():
            cache.put((n, lrs[n], seed), result)

    def score(name: str, lr: float, seed: int, split: str) -> tuple[float, dict[str, Any]]:
        if (name, lr, seed) not in cache:
            lrs, seed_ = round_of(name, lr, seed, split)
            save((lrs, seed_), train_round(args, data, lrs, seed_))
        result = cache[(name, lr, seed)]
        return -result["val" if split == "validation" else "test"], result

    if args.jobs > 1:

        def known(key: tuple[str, float, int, str]) -> tuple[float, dict[str, Any]] | None:
            return score(*key) if key[:3] in cache else None

        while todo := missing_runs(grids, protocol, known):
            if any(split == "validation" for *_, split in todo):  # the test rounds' lrs need every grid run first
                todo = [key for key in todo if key[3] == "validation"]
            rounds = {json.dumps(r, sort_keys=True): r for r in (round_of(*key) for key in todo)}  # one per round
            print(f"[pretrain_llama] {len(rounds)} round(s), {args.jobs} at a time", flush=True)
            in_workers(
                list(rounds.values()),
                partial(train_round, args, data),
                jobs=args.jobs,
                threads=args.threads,
                done=save,
            )
    return tune_and_test(grids, score, protocol, echo=lambda line: print(line, flush=True))


# -- report ----------------------------------------------------------------------------------------------------------


def _ppl(losses: list[float]) -> str:
    values = [math.exp(x) if math.isfinite(x) else math.inf for x in losses]
    if len(values) == 1 or not all(map(math.isfinite, values)):
        return " / ".join(f"{v:.3f}" for v in values)
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def table(study: Study) -> str:
    head = ["optimizer", "lr grid", "chosen lr", "val ppl", "test ppl", "optimizer state KiB", "step ms (median)"]
    rows = []
    for name, lr in study.chosen.items():
        runs = study.extras[name]
        times = [t for r in runs for t in r["times"]] or [math.nan]
        grid = " / ".join(f"{x:g}" for x in sorted(study.validation[name]))
        edge = " (grid edge)" if lr in (min(study.validation[name]), max(study.validation[name])) else ""
        rows.append(
            [name, grid, f"{lr:g}{edge}", _ppl([r["val"] for r in runs]), _ppl([r["test"] for r in runs]),
             f"{runs[0]['state_bytes'] / 1024:.0f}", f"{1e3 * statistics.median(times):.0f}",
             f"{1e3 * statistics.mean(times):.0f}"]
        )  # fmt: skip
    return markdown_table([*head, "step ms (mean, with refreshes)"], rows, align="ll" + "r" * 6)


def _ratio(study: Study, a: str, b: str) -> tuple[float, float, float]:
    """Paired test-perplexity ratio ``a / b`` over the test seeds and its 95 % interval (from the loss differences)."""
    mean, lo, hi = paired_interval([r["test"] for r in study.extras[a]], [r["test"] for r in study.extras[b]])
    return math.exp(mean), math.exp(lo), math.exp(hi)


def verdicts(study: Study) -> list[str]:
    lines = []
    have = study.chosen
    if "dct_adamw" in have and "galore" in have:
        r, lo, hi = _ratio(study, "dct_adamw", "galore")
        met = lo >= 1 / (1 + EQUIVALENCE) and hi <= 1 + EQUIVALENCE
        lines.append(
            f"target: DCT-AdamW ~ GaLore (test perplexity ratio {r:.3f}, 95 % CI [{lo:.3f}, {hi:.3f}], within "
            f"{100 * EQUIVALENCE:.0f} % on both ends): {'met' if met else 'NOT met'}"
        )
    ours = [n for n in OURS if n in have]
    peers = [n for n in ("galore", "apollo") if n in have]
    if ours and peers:
        # the option is picked on validation; the peer is the better one on test (the stricter comparison)
        best = min(ours, key=lambda n: statistics.mean(r["val"] for r in study.extras[n]))
        peer = min(peers, key=lambda n: statistics.mean(r["test"] for r in study.extras[n]))
        r, lo, hi = _ratio(study, best, peer)
        lines.append(
            f"target: best SVD-free option ({best}, by validation) perplexity <= min(GaLore, APOLLO) ({peer}): "
            f"ratio {r:.3f}, 95 % CI [{lo:.3f}, {hi:.3f}] (upper end <= 1): {'met' if hi <= 1 else 'NOT met'}"
            + (" (met on the mean only)" if r <= 1 < hi else "")
        )
        if "galore" in have:
            mine, theirs = study.extras[best][0]["state_bytes"], study.extras["galore"][0]["state_bytes"]
            lines.append(
                f"target: optimizer state {best} {mine / 1024:.1f} KiB <= GaLore's {theirs / 1024:.1f} KiB: "
                f"{'met' if mine <= theirs else 'NOT met'}"
            )
    return lines


def plot(study: Study, path: Path, title: str) -> None:
    """Validation loss curves at each optimizer's chosen lr (its runs that did not diverge)."""
    curves = {
        f"{name} (lr {study.chosen[name]:g})": [r["curve"] for r in runs if r["diverged"] is None]
        for name, runs in study.extras.items()
    }
    plot_loss_curves({k: v for k, v in curves.items() if v}, path, title, top=math.log(VOCAB) + 0.2)


#: ``--quick``: toy sizes, 2 grid points, 2 test seeds
QUICK = {"hidden": 32, "layers": 2, "rank": 4, "gap": 3, "batch": 4, "seq": 16, "steps": 8, "eval_every": 4}
QUICK |= {"eval_windows": 8, "grid_points": 2, "tune_seeds": [0], "test_seeds": [0, 1]}


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(
        __doc__, quick="toy sizes, 2 grid points, 2 test seeds: a smoke run", json=True, threads=1, runs=True
    )
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    int_options(parser, hidden=256, layers=8, rank=64)
    parser.add_argument("--gap", type=int, default=50, help="update_proj_gap of every low-rank optimizer")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64, help="bytes per window (tiny_llama's positions: <= 128)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=float, default=0.1, help="warmup as a fraction of --steps")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-windows", type=int, default=128, help="evaluation windows per split")
    parser.add_argument("--grid-points", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--tune-seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--test-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--png", type=Path, default=None, help="write the validation loss curves here")
    parser.add_argument("--jobs", type=int, default=2, help="rounds trained at once, --threads each (2: one per core)")
    args = parse(parser, argv, quick=QUICK)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.seq > 128:
        raise ValueError(f"--seq must be <= 128 (tiny_llama's max_position_embeddings), got {args.seq}")
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()

    streams = gloss_streams()
    data = evaluation_windows(streams, args.eval_windows, args.seq, val_windows="validation", test_windows="test")
    sizes = {k: v.numel() for k, v in streams.items()}
    model = tiny_llama(vocab_size=VOCAB, hidden_size=args.hidden, num_layers=args.layers)
    params = sum(p.numel() for p in model.parameters())
    projected = sum(p.numel() for n, p in model.named_parameters() if _is_target(n))
    del model
    size = f"hidden {args.hidden}, {args.layers} layers, {params / 1e6:.2f} M parameters"
    size += f" ({projected / 1e6:.2f} M projected)"
    print(f"[pretrain_llama] tiny Llama {size}; corpus bytes {sizes}", flush=True)

    study = run_protocol(args, data, args.optimizers)
    tokens = args.steps * args.batch * args.seq
    print(
        f"\n### Pretraining a tiny Llama from scratch on WordNet glosses (bytes): {size}, rank {args.rank} on "
        f"every attention / MLP projection, update_proj_gap {args.gap}, {args.steps} steps x {args.batch} x {args.seq}"
        f" = {tokens:,} tokens per run; {study.protocol.describe()} (perplexity per byte, mean ± sd)\n"
    )
    print(table(study))
    shared = max((e.get("shared_dct_bytes", 0) for runs in study.extras.values() for e in runs), default=0)
    print(f"\nshared DCT matrices (process-wide, every DCT-family optimizer): {shared / 1024:.0f} KiB")
    for line in verdicts(study):
        print(line)
    print(machine.wall_line(wall, args.threads))
    if args.png is not None:
        plot(study, args.png, f"tiny Llama ({size}), {len(args.test_seeds)} seed(s)")
        print(f"loss curves: {args.png}")
    if args.json is not None:
        out = {**study.to_dict(), "extras": without(study.extras, "times")}
        out["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        write_json_atomic(args.json, out)


if __name__ == "__main__":
    main()
