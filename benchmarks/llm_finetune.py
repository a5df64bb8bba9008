"""LLM fine-tuning optimizers on a pretrained model: SmolLM2-135M-Instruct on the six shipped instruction tasks.

pretrain_llama measures the low-rank optimizers on a tiny Llama trained from scratch; here they fine-tune a real
pretrained chat model, the setting most users are in. Two tracks, each judged against its own baseline:

- adapter track: ``riemannion_loi`` (Riemannion adapters r=8 started at their LOI point, trained by the Riemannion
  optimizer) against ``lora_adamw`` (PEFT LoRA r=8, alpha 16, trained by AdamW), both on ``q_proj`` and ``v_proj``
  of every decoder layer (the riemannion benchmark's query / value, in Llama's names);
- full fine-tuning track: ``dct_adamw`` and ``subspace_adamw`` against ``galore`` and ``apollo``, built by
  pretrain_llama's ``build_optimizer``: the 210 2-D hidden weights of the 30 decoder layers (q/k/v/o, gate/up/down)
  through the low-rank optimizer at rank ``--rank`` 144 (hidden / 4, pretrain_llama's ratio), refreshed every
  ``--gap`` steps, scale 0.25 for projected updates and 1 for APOLLO's channel-wise one; the tied embedding and the
  norms through plain AdamW inside the same optimizer.

Targets (printed as ``target: ...: met`` / ``NOT met``):

- Riemannion + LOI >= LoRA + AdamW on test score (lower end of the paired 95 % interval >= 0);
- DCT-AdamW's test answer loss within 1.05x GaLore's (upper end of the paired interval of the ratio <= 1.05);
- DCT-AdamW's step time <= GaLore's (upper end of the interval of the per-step ratio, measured side by side, <= 1).

Data: ``shipped_instruction_sequence`` (data seed 0) of the six families (supersense, gloss_to_word, part_of_speech,
fortune_topic, define, example_to_word), ``--train-per-task`` 32 / ``--val-per-task`` 8 / ``--test-per-task`` 16
examples each. Training sees the union of the training sets, shuffled by the run's seed, ``--steps`` 24 batches of
``--batch`` 8 (192 examples: one epoch), rendered by the chat template (``CausalLMCollator``, max 160 tokens, system
prompt "Answer briefly."), the loss on the answer tokens only. Validation is the union of the validation splits,
test the union of the test splits. A split's **score** is the mean over its tasks of each task's metric (greedy
answers: exact match, ROUGE-L for ``define``); its **answer loss** the mean over its tasks of the answers' mean
next-token loss under teacher forcing (``generation_scores``). The untouched model (zero-shot) is scored once as a
reference row. Riemannion's trainable count includes its zero gradient probes (no optimizer state). Shared by every
optimizer: betas (0.9, 0.999), eps 1e-8, no weight decay, gradient clipping at norm ``--clip`` 1.0, linear warmup
over 10 % of the steps then cosine decay to 10 % (pretrain_llama's ``lr_factor``).

Protocol (``benchmarks/_lib/protocol.py``): each optimizer's lr from its 3-point log grid (``GRIDS``) by validation
score on seed 0, then test seeds 0, 1, 2 at that lr (a seed sets the batch order, LoRA's random factor and LOI's
probes); paired 95 % intervals against LoRA + AdamW (adapter track) and GaLore (full track). One run serves both
splits. The optimizers of one track train side by side in one process, one step of each in turn on the same batch
(forward, backward, clipping, optimizer and schedule step; ``Interleaved``, the order rotating every step), so the
step times of a round are measured under the same load; the ratio table pairs steps of the same round. ``--jobs``
rounds train at once in worker processes of ``--threads`` 1 torch thread (single-threaded CPU runs are
deterministic, so the numbers are those of one process). Every finished run is saved to ``--runs``; ``--resume``
reuses the saved runs and trains only the missing ones.

Cost, measured on the shared 2-core machine while another benchmark held both cores, with one torch thread and
batches of 8 instruction examples (55-81 tokens). Each optimizer alone (load average 4.5-5.6), 4 steps: LoRA + AdamW
6.3-7.7 s a step (forward + backward; AdamW 0.01 s), Riemannion 4.8-8.1 s (its step 0.05 s; LOI once, 11.4 s on 2
batches); full fine-tuning 8.2-10.8 s forward + backward plus the optimizer step: GaLore 1.5 s (its SVD refresh of the
210 matrices 19.8 s), DCT-AdamW 1.5 s, SubspaceAdamW 1.5 s (first refresh 3.9 s), APOLLO 1.3 s. Scoring 16 examples
took 9 s, so one run's validation and test (48 + 96 examples) about 80 s. Side by side as the benchmark runs them
(``--steps 4``, load average 6, the process getting 47 % of a core), median step: LoRA + AdamW 8.7 s, Riemannion
8.6 s, DCT-AdamW 15.1 s, SubspaceAdamW 14.9 s, GaLore 15.9 s, APOLLO 15.1 s; peak resident memory 7.0 GB (a full
round's 4 models, each with 0.43-0.49 GiB of optimizer state, mostly the embedding's AdamW moments).

Budget, from the first figures: a full-track round (4 optimizers) is about 4 x 11 s x 24 steps + 2 GaLore refreshes
of 20 s + 4 x 80 s = 24 min, an adapter round about 2 x 6.5 s x 24 + 11 s + 2 x 80 s = 8 min. The protocol needs 3
grid rounds and 2 test rounds per track; with 2 jobs the grid takes 2 full rounds of wall time (the 3 adapter rounds
fit beside the third full one), the test 1 full and 1 adapter round, plus the zero-shot scoring (2 min): about
3 x 24 + 8 + 2 = 82 min, and about 14 GB of memory (two full rounds at once). At the side-by-side figures (a more
loaded machine) it would be about 110 min; on idle cores less than 82.

Usage::

    python -m benchmarks.llm_finetune --resume   # docs/results/llm_finetune.json (runs: llm_finetune_runs.json)
    python -m benchmarks.llm_finetune --quick    # every code path at toy size (2 tasks, 2 decoder layers), ~1 min
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from benchmarks._lib import machine
from benchmarks._lib.cache import RunCache, without, write_json_atomic
from benchmarks._lib.cli import benchmark_parser, int_options, parse
from benchmarks._lib.data import causal_lm, tensor_bytes
from benchmarks._lib.jobs import in_workers, missing_runs
from benchmarks._lib.protocol import Protocol, Study, paired_interval, tune_and_test
from benchmarks._lib.tables import fmt_s, markdown_table, mean_sd
from benchmarks._lib.timing import Interleaved, Ratio
from benchmarks.pretrain_llama import build_optimizer, lr_factor
from peft_ext import RiemannionConfig
from peft_ext.continual.context import model_logits
from peft_ext.continual.generation import generation_scores, next_token_loss
from peft_ext.data.collate import CausalLMCollator
from peft_ext.data.instruct_tasks import INSTRUCTION_TASKS, shipped_instruction_sequence
from peft_ext.data.tasks import TaskSequence
from peft_ext.optim import create_riemannion_optimizer
from peft_ext.tuners.riemannion import initialize_loi

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "llm_finetune.json"
RUNS = ROOT / "docs" / "results" / "llm_finetune_runs.json"  # kept with the results: --resume on a fresh clone
MODEL = "smollm2-135m"
FAMILIES = tuple(INSTRUCTION_TASKS)
MAX_LENGTH, SYSTEM_PROMPT = 160, "Answer briefly."  # configs/instruct.yaml's rendering
ADAPTER_TARGETS = ["q_proj", "v_proj"]  # benchmarks/riemannion.py adapts query and value
ADAPTER_RANK = 8
TRACKS = {"adapter": ("riemannion_loi", "lora_adamw"), "full": ("dct_adamw", "subspace_adamw", "galore", "apollo")}
BASELINE = {"adapter": "lora_adamw", "full": "galore"}
OPTIMIZERS = tuple(name for names in TRACKS.values() for name in names)
#: Each optimizer's 3-point grid, half a decade apart. Adapters: causal_lm_bf16's grids (Riemannion's lr is in
#: spectral-norm units). Full fine-tuning: a decade around 1e-4, at which a 4-step probe lowered the training loss
#: of all four (pretrain_llama's 1e-3-1e-2 are from-scratch rates; the AdamW part here moves a pretrained embedding).
GRIDS = {"riemannion_loi": (3e-3, 1e-2, 3e-2), "lora_adamw": (1e-3, 3e-3, 1e-2)}
GRIDS |= {name: (3e-5, 1e-4, 3e-4) for name in TRACKS["full"]}
#: A grid whose best validation score lies at an end grows past it by up to this many points (the first full-size run
#: chose the top of the grid for Riemannion and for all four full fine-tuning optimizers)
EXTEND_EDGES = 2
LOSS_RATIO = 1.05  # "DCT-AdamW within 1.05x GaLore's test answer loss", judged on the upper end of the interval
ZERO_SHOT = "zero_shot"  # the untouched model's run-cache key


def track_of(name: str) -> str:
    return next(track for track, names in TRACKS.items() if name in names)


# -- data and models -------------------------------------------------------------------------------------------------


def instruction_data(args: argparse.Namespace) -> TaskSequence:
    """The shipped instruction tasks of ``args.families`` with their train / validation / test examples (seed 0)."""
    return shipped_instruction_sequence(
        args.families, args.train_per_task, args.test_per_task, args.val_per_task, seed=0
    )


def load_model(layers: int | None) -> tuple[nn.Module, Any]:
    """SmolLM2-135M-Instruct in float32 and its tokenizer; ``layers`` keeps only the first decoder layers (smoke
    runs)."""
    model, tokenizer = causal_lm(MODEL, layers)
    return model.train(), tokenizer


def batch_order(examples: list[Any], batch: int, steps: int, seed: int) -> list[list[Any]]:
    """``steps`` batches of ``batch`` examples: epochs over ``examples``, each shuffled by the seed."""
    rng = random.Random(f"llm_finetune:{seed}")
    order: list[Any] = []
    while len(order) < steps * batch:
        epoch = list(examples)
        rng.shuffle(epoch)
        order += epoch
    return [order[i * batch : (i + 1) * batch] for i in range(steps)]


def answer_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The training loss: next-token cross-entropy on the answer tokens."""
    return next_token_loss(model_logits(model, batch), batch["labels"])


def build(
    name: str,
    model: nn.Module,
    lr: float,
    seed: int,
    args: argparse.Namespace,
    calibration: list[dict[str, torch.Tensor]],
) -> tuple[nn.Module, torch.optim.Optimizer, float]:
    """``model`` (a fresh copy of :func:`load_model`'s) with ``name``'s adapters, if any, and ``name``'s optimizer at
    ``lr``; the seconds spent on LOI (0 for the others)."""
    torch.manual_seed(seed)  # LoRA's random factor, Riemannion's random start (LOI replaces it)
    if name == "lora_adamw":
        config = LoraConfig(r=ADAPTER_RANK, lora_alpha=2 * ADAPTER_RANK, target_modules=ADAPTER_TARGETS)
        model = get_peft_model(model, config)
        params = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), 0.0
    if name == "riemannion_loi":
        model = get_peft_model(model, RiemannionConfig(r=ADAPTER_RANK, target_modules=ADAPTER_TARGETS))
        loi = initialize_loi(model, calibration, loss_fn=answer_loss, seed=seed)
        return model, create_riemannion_optimizer(model, lr=lr), loi.seconds
    return model, build_optimizer(name, model, lr, args), 0.0


# -- scoring ---------------------------------------------------------------------------------------------------------


def split_scores(
    model: nn.Module, sequence: TaskSequence, split: str, collate: CausalLMCollator, args: argparse.Namespace
) -> dict[str, Any]:
    """``{"score", "answer_loss", "tasks": {family: generation_scores}}`` of ``model`` on ``split`` (the mean over
    tasks of each task's own metric, and of its answers' mean next-token loss)."""
    tasks = {}
    for task in sequence.tasks:
        scores = generation_scores(
            model, getattr(task, split), collate, torch.device("cpu"), batch_size=args.eval_batch
        )
        tasks[task.name.split(":", 1)[1]] = {**scores, "metric": task.metric}
    return {
        "score": statistics.mean(t[t["metric"]] for t in tasks.values()),
        "answer_loss": statistics.mean(t["answer_loss"] for t in tasks.values()),
        "tasks": tasks,
    }


def zero_shot(args: argparse.Namespace) -> dict[str, Any]:
    """The untouched model's validation and test scores: what the tasks score without tuning."""
    sequence = instruction_data(args)
    model, tokenizer = load_model(args.layers)
    collate = CausalLMCollator(tokenizer, MAX_LENGTH, chat_template=True, system_prompt=SYSTEM_PROMPT)
    return {split: split_scores(model, sequence, split, collate, args) for split in ("validation", "test")}


# -- one round: the optimizers of a track side by side ---------------------------------------------------------------


def _step(run: dict[str, Any], batch: dict[str, torch.Tensor], clip: float) -> float | None:
    """One training step (forward, backward, clipping, optimizer and schedule step): the loss, or ``None`` when the
    optimizer refused a non-finite gradient."""
    try:
        loss = answer_loss(run["model"], batch)
        loss.backward()
        if clip > 0:
            nn.utils.clip_grad_norm_(run["params"], clip)
        run["optimizer"].step()
    except FloatingPointError:  # the optimizers' non-finite gradient check (NonFiniteGradientError)
        return None
    run["optimizer"].zero_grad(set_to_none=True)
    run["schedule"].step()
    return loss.item()


def train_round(args: argparse.Namespace, lrs: dict[str, float], seed: int, tag: str) -> dict[str, dict[str, Any]]:
    """Fine-tune one model per entry of ``lrs`` for ``args.steps`` steps on the same batches, one step of each in
    turn, then score each on the validation and the test split.

    Returns ``{name: {"name", "val", "test" (split_scores), "times", "state_bytes", "trainable", "loi_seconds",
    "train_loss", "diverged", "round"}}``; ``round`` is ``tag``, so step times pair only within a round.
    """
    sequence = instruction_data(args)
    base, tokenizer = load_model(args.layers)
    collate = CausalLMCollator(tokenizer, MAX_LENGTH, chat_template=True, system_prompt=SYSTEM_PROMPT)
    train = [ex for task in sequence.tasks for ex in task.train]
    batches = [collate(b) for b in batch_order(train, args.batch, args.steps, seed)]
    warmup = max(1, round(args.warmup * args.steps))
    runs: dict[str, dict[str, Any]] = {}
    for name, lr in lrs.items():
        model, optimizer, loi_seconds = build(name, copy.deepcopy(base), lr, seed, args, batches[: args.loi_batches])
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, total=args.steps, warmup=warmup))
        params = [p for p in model.parameters() if p.requires_grad]
        runs[name] = {"model": model, "optimizer": optimizer, "schedule": schedule, "params": params}
        runs[name] |= {"loi_seconds": loi_seconds, "losses": [], "diverged": None}
    del base  # the copies are all that train
    # the first steps create the optimizers' state lazily (and GaLore's first SVD): not timed; at least 2 stay timed
    timer = Interleaved(list(runs), warmup=max(0, min(3, args.steps - 2)))
    for step, batch in enumerate(batches, start=1):
        live = {name: partial(_step, run, batch, args.clip) for name, run in runs.items() if run["diverged"] is None}
        for name, loss in timer.round(live).items():
            if loss is None or not math.isfinite(loss):
                runs[name]["diverged"] = step
            else:
                runs[name]["losses"].append(loss)
    out = {}
    for name, run in runs.items():
        failed = run["diverged"] is not None
        # a diverged model answers nothing: scored 0 with an infinite loss rather than evaluated
        lost = {"score": 0.0, "answer_loss": math.inf, "tasks": {}}
        val = lost if failed else split_scores(run["model"], sequence, "validation", collate, args)
        test = lost if failed else split_scores(run["model"], sequence, "test", collate, args)
        out[name] = {
            "name": name,
            "round": tag,
            "val": val,
            "test": test,
            "times": timer.times(name),
            "state_bytes": tensor_bytes(run["optimizer"].state),
            "trainable": sum(p.numel() for p in run["params"]),
            "loi_seconds": run["loi_seconds"],
            "train_loss": statistics.mean(run["losses"][-max(1, args.steps // 4) :]) if run["losses"] else math.inf,
            "diverged": run["diverged"],
        }
        run.clear()  # frees the model and its optimizer state before the next one is scored
        print(
            f"[round {tag}] {name:<15} lr {lrs[name]:<7g} val {100 * val['score']:.1f} (loss {val['answer_loss']:.3f})"
            f" test {100 * test['score']:.1f} (loss {test['answer_loss']:.3f})"
            + (f" (diverged at step {out[name]['diverged']})" if failed else ""),
            flush=True,
        )
    return out


def run_protocol(args: argparse.Namespace, cache: RunCache) -> Study:
    """``tune_and_test`` over every optimizer of ``args.optimizers``, its runs served from rounds of one track's
    optimizers side by side: the runs the protocol needs next (``missing_runs``: the grid, then the chosen lrs' test
    seeds) are grouped into rounds, a grid point or a test seed per track, and trained ``--jobs`` at a time."""
    names = [n for n in OPTIMIZERS if n in args.optimizers]
    grids = {n: GRIDS[n][1:2] if args.grid_points == 1 else GRIDS[n] for n in names}
    protocol = Protocol(tune_seeds=(0,), test_seeds=tuple(args.test_seeds), extend_edges=EXTEND_EDGES)

    def known(key: tuple[str, float, int, str]) -> tuple[float, dict[str, Any]] | None:
        name, lr, seed, split = key
        if (name, lr, seed) not in cache:
            return None
        run = cache[(name, lr, seed)]
        return run["val" if split == "validation" else "test"]["score"], run

    def save(unit: tuple[dict[str, float], int, str], results: dict[str, dict[str, Any]]) -> None:
        lrs, seed, _ = unit
        for name, result in results.items():
            cache.put((name, lrs[name], seed), result)

    while todo := missing_runs(grids, protocol, known):
        rounds: dict[tuple[str, str, int], dict[str, float]] = {}
        for name, lr, seed, split in todo:
            if split == "test":
                point = "chosen"
            else:  # a grid point by its index, a point past the grid's end (Protocol.extend_edges) by its value
                point = f"lr{grids[name].index(lr)}" if lr in grids[name] else f"lr{lr:g}"
            rounds.setdefault((track_of(name), point, seed), {})[name] = lr
        # a round's runs are saved together and never trained again, so its track, point, seed and optimizers name
        # it uniquely, also across resumed jobs of other --optimizers (its step times pair only with each other)
        units = [
            (lrs, seed, f"{track}-{point}-seed{seed}:{'+'.join(lrs)}") for (track, point, seed), lrs in rounds.items()
        ]
        # the longest rounds first (a full fine-tuning step costs about twice an adapter step), the short ones beside
        units.sort(key=lambda unit: -sum(2 if track_of(name) == "full" else 1 for name in unit[0]))
        print(f"[llm_finetune] {len(units)} round(s): {[u[2] for u in units]}, {args.jobs} at a time", flush=True)
        if args.jobs > 1:
            in_workers(units, partial(train_round, args), jobs=args.jobs, threads=args.threads, done=save)
        else:
            for unit in units:
                save(unit, train_round(args, *unit))
    return tune_and_test(grids, lambda *key: known(key), protocol, echo=lambda line: print(line, flush=True))


# -- report ----------------------------------------------------------------------------------------------------------


def _loss_ratio(study: Study, a: str, b: str) -> tuple[float, float, float]:
    """Paired test answer-loss ratio ``a / b`` over the test seeds and its 95 % interval (on the log losses)."""
    logs = {n: [math.log(r["test"]["answer_loss"]) for r in study.extras[n]] for n in (a, b)}
    mean, lo, hi = paired_interval(logs[a], logs[b])
    return math.exp(mean), math.exp(lo), math.exp(hi)


def loss_table(study: Study, reference: dict[str, Any] | None) -> str:
    """Answer loss, state and size of every optimizer, with the ratio of its test answer loss to its track's
    baseline; the zero-shot model as the first row."""
    head = ["optimizer", "track", "val answer loss", "test answer loss", "vs baseline (ratio, 95 % CI)"]
    head += ["final train loss", "optimizer state MiB", "trainable M"]
    rows = []
    if reference is not None:
        rows.append(
            [
                ZERO_SHOT,
                "-",
                f"{reference['validation']['answer_loss']:.3f}",
                f"{reference['test']['answer_loss']:.3f}",
            ]
            + ["—"] * 4
        )
    for name, runs in study.extras.items():
        base = BASELINE[track_of(name)]
        ratio = "—"
        if name != base and base in study.extras:
            r, lo, hi = _loss_ratio(study, name, base)
            ratio = f"{r:.3f} [{lo:.3f}, {hi:.3f}]"
        rows.append(
            [name, track_of(name), mean_sd([r["val"]["answer_loss"] for r in runs], 1, 3),
             mean_sd([r["test"]["answer_loss"] for r in runs], 1, 3), ratio,
             mean_sd([r["train_loss"] for r in runs], 1, 3), f"{runs[0]['state_bytes'] / 2**20:.1f}",
             f"{runs[0]['trainable'] / 1e6:.2f}"]
        )  # fmt: skip
    return markdown_table(head, rows)


def task_table(study: Study, reference: dict[str, Any] | None) -> str:
    """Each task's test metric (x 100, mean ± sd over the test seeds) at each optimizer's chosen lr."""
    runs = {name: [r["test"]["tasks"] for r in rs] for name, rs in study.extras.items()}
    if reference is not None:
        runs = {ZERO_SHOT: [reference["test"]["tasks"]], **runs}
    families = list(next(iter(runs.values()))[0]) if runs else []
    head = ["optimizer", *(f"{f} ({next(iter(runs.values()))[0][f]['metric']})" for f in families)]
    rows = [
        [name, *(mean_sd([t[f][t[f]["metric"]] for t in seeds if f in t]) for f in families)]
        for name, seeds in runs.items()
    ]
    return markdown_table(head, rows)


def step_ratios(runs: list[dict[str, Any]], a: str, b: str) -> Ratio | None:
    """``a``'s step time over ``b``'s, step by step within each round that trained both (``runs``: every cached run,
    each with its ``name``); ``None`` when no round did."""
    rounds: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        rounds.setdefault(run["round"], {})[run["name"]] = run["times"]
    pairs = [(x, y) for r in rounds.values() if a in r and b in r for x, y in zip(r[a], r[b])]
    if not pairs:
        return None
    mine, theirs = zip(*pairs)
    return Ratio([x / y for x, y in pairs], statistics.median(mine) / statistics.median(theirs))


def time_table(runs: list[dict[str, Any]], names: list[str]) -> tuple[str, dict[str, Any]]:
    """Median and mean step time of every optimizer over all its rounds, and its per-step ratio to its track's
    baseline (steps paired within a round); also the summary for the results file."""
    rows, summary = [], {}
    for name in names:
        times = [t for r in runs if r["name"] == name for t in r["times"]]
        if not times:
            continue
        base = BASELINE[track_of(name)]
        ratio = step_ratios(runs, name, base) if name != base else None
        cells = [name, track_of(name), fmt_s(statistics.median(times)), fmt_s(statistics.mean(times))]
        summary[name] = {"median_s": statistics.median(times), "mean_s": statistics.mean(times), "steps": len(times)}
        if ratio is None:
            cells += ["—", "—"]
        else:
            mean, lo, hi = ratio.interval if len(ratio.per_round) > 1 else (ratio.median, -math.inf, math.inf)
            cells += [f"{ratio.of_medians:.2f}x", f"{mean:.2f}x [{lo:.2f}, {hi:.2f}]"]
            summary[name] |= {"vs": base, "of_medians": ratio.of_medians, "interval": [mean, lo, hi]}
        rows.append(cells)
    head = ["optimizer", "track", "median step", "mean step (with refreshes)", "vs baseline (medians)"]
    return markdown_table([*head, "per-step ratio, geo. mean [95 % CI]"], rows), summary


def verdicts(study: Study, timing: dict[str, Any]) -> list[str]:
    lines = []
    if "riemannion_loi" in study.test and "lora_adamw" in study.test:
        name = "Riemannion + LOI >= LoRA + AdamW on test score"
        lines.append(study.verdict("riemannion_loi", "lora_adamw", at_least=0.0, name=name))
    if "dct_adamw" in study.test and "galore" in study.test:
        r, lo, hi = _loss_ratio(study, "dct_adamw", "galore")
        lines.append(
            f"target: DCT-AdamW test answer loss within {LOSS_RATIO:.2f}x GaLore's: ratio {r:.3f}, 95 % CI "
            f"[{lo:.3f}, {hi:.3f}] over {len(study.test['dct_adamw'])} seeds (upper end <= {LOSS_RATIO:.2f}): "
            f"{'met' if hi <= LOSS_RATIO else 'NOT met'}"
        )
    dct = timing.get("dct_adamw", {})
    if dct.get("vs") == "galore":
        mean, lo, hi = dct["interval"]
        lines.append(
            f"target: DCT-AdamW step time <= GaLore's: {dct['of_medians']:.2f}x (medians), per-step geometric mean "
            f"{mean:.2f}x, 95 % CI [{lo:.2f}, {hi:.2f}] over {timing['dct_adamw']['steps']} steps side by side "
            f"(upper end <= 1): {'met' if hi <= 1 else 'NOT met'}"
        )
    return lines


def report(
    args: argparse.Namespace, study: Study, runs: list[dict[str, Any]], reference: dict[str, Any]
) -> tuple[str, dict[str, Any], list[str]]:
    """The printed report (one score table per track, the answer-loss, per-task and step-time tables, the target
    lines), the step-time summary and the target lines."""
    zero = f"validation {100 * reference['validation']['score']:.1f}, test {100 * reference['test']['score']:.1f}"
    parts = [
        f"\n### Fine-tuning SmolLM2-135M-Instruct on {len(args.families)} instruction tasks: {args.steps} steps x "
        f"{args.batch} examples, {study.protocol.describe()} (score: mean over tasks of exact match / ROUGE-L, x 100; "
        f"zero-shot: {zero})"
    ]
    about = {"adapter": f"r={ADAPTER_RANK} on {ADAPTER_TARGETS}", "full": f"rank {args.rank}, gap {args.gap}"}
    for track, names in TRACKS.items():
        view = study.subset(names)
        if view.chosen:
            parts.append(f"#### {track} track ({about[track]})\n\n{view.table(baseline=BASELINE[track])}")
    losses = loss_table(study, reference)
    parts.append(f"#### Answer loss (mean over tasks of the answers' next-token loss) and cost\n\n{losses}")
    parts.append(f"#### Test score per task (x 100)\n\n{task_table(study, reference)}")
    text, timing = time_table(runs, list(study.chosen))
    parts.append(f"#### Step time, the optimizers of a track side by side in each round (one thread)\n\n{text}")
    loi = [r["loi_seconds"] for r in runs if r["name"] == "riemannion_loi"]
    if loi:
        parts.append(
            f"LOI, once per run before its first step: {fmt_s(statistics.median(loi))} (median of {len(loi)})"
        )
    targets = verdicts(study, timing)
    return "\n\n".join(parts) + "\n\n" + "\n".join(targets), timing, targets


#: ``--quick``: every code path but the worker processes at toy size: 2 tasks of 4 / 2 / 2 examples, the first 2
#: decoder layers, 3 steps of 2, rank 8, one grid point, one seed
QUICK = {"families": list(FAMILIES[:2]), "train_per_task": 4, "val_per_task": 2, "test_per_task": 2, "layers": 2}
QUICK |= {"steps": 3, "batch": 2, "rank": 8, "gap": 2, "grid_points": 1, "test_seeds": [0], "loi_batches": 1}
QUICK |= {"jobs": 1}  # spawning workers costs more than the two toy rounds they would share


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(
        __doc__, quick="toy sizes (2 tasks, 2 decoder layers, 3 steps, 1 seed, 1 grid point): a smoke run",
        json=f"the results file (default {RESULTS.relative_to(ROOT)}; none with --quick)", threads=1, runs=True,
    )  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="reuse the runs saved in --runs (default: start anew)")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    int_options(parser, train_per_task=32, val_per_task=8, test_per_task=16, steps=24, batch=8, rank=144, gap=8)
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (smoke runs)")
    parser.add_argument("--warmup", type=float, default=0.1, help="warmup as a fraction of --steps")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    int_options(parser, loi_batches=2, eval_batch=48)
    parser.add_argument("--grid-points", type=int, default=3, choices=(1, 3))
    parser.add_argument("--test-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="rounds trained at once, --threads each (2: one per core)")
    args = parse(parser, argv, quick=QUICK)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.steps < 1 or args.batch < 1 or not 1 <= args.loi_batches <= args.steps:
        got = f"{args.steps}, {args.batch}, {args.loi_batches}"
        parser.error(f"need --steps, --batch >= 1 and 1 <= --loi-batches <= --steps, got {got}")
    if not args.quick:  # a smoke run writes no results and keeps no runs unless asked
        args.json = RESULTS if args.json is None else args.json
        args.runs = RUNS if args.runs is None else args.runs
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()

    fixed = ("families", "train_per_task", "val_per_task", "test_per_task", "steps", "batch", "rank", "gap")
    settings = {k: getattr(args, k) for k in (*fixed, "layers", "warmup", "clip", "loi_batches", "eval_batch")}
    cache = RunCache(args.runs, {**settings, "model": MODEL}, resume=args.resume)
    if args.runs is not None and args.resume:
        print(f"[llm_finetune] {len(cache)} finished run(s) saved in {args.runs} will be reused", flush=True)
    sequence = instruction_data(args)
    sizes = {s: sum(len(getattr(t, s)) for t in sequence.tasks) for s in ("train", "validation", "test")}
    print(f"[llm_finetune] {MODEL}, tasks {args.families}, examples {sizes}, torch threads {args.threads}", flush=True)
    if ZERO_SHOT not in cache:
        cache.put(ZERO_SHOT, zero_shot(args))
    reference = cache[ZERO_SHOT]
    study = run_protocol(args, cache)
    runs = [run for run in cache.values() if "round" in run]  # every training run (not the zero-shot entry)

    text, timing, targets = report(args, study, runs, reference)
    print(text)
    print(machine.wall_line(wall, args.threads))
    if args.json is not None:
        out = {**study.to_dict(), "extras": without(study.extras, "times")}
        out["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        out |= {"model": MODEL, "grids": GRIDS, "zero_shot": reference, "step_time": timing, "targets": targets}
        out |= {"machine": machine.record(), "wall_seconds": time.perf_counter() - wall}
        write_json_atomic(args.json, out)
        print(f"results: {args.json}")


if __name__ == "__main__":
    main()
