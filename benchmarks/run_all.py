"""Run every benchmark at a size that fits a 2-core CPU machine and write the report ``docs/benchmarks.md``.

Each entry below is one benchmark module (``python -m benchmarks.NAME``) with the arguments of its small run. The
script's stdout is kept in ``runs/benchmarks/<name>.log`` (written atomically when the run ends); the report quotes
every markdown table and every "target ... met / NOT met" line the script printed, with the exact command, its wall
time and the machine. Because the logs are kept, an interrupted report resumes where it stopped (``--reuse``), and one
entry can be re-run alone (``--only``).

Usage, from the repository root::

    python -m benchmarks.run_all                 # everything: the full protocol (see --list: about 7 hours)
    python -m benchmarks.run_all --quick         # every benchmark's --quick smoke run (about 10 minutes)
    python -m benchmarks.run_all --list          # the entries, their commands and expected minutes
    python -m benchmarks.run_all --reuse         # keep the logs already there, run the missing entries
    python -m benchmarks.run_all --only kernels pclr_overhead --reuse
    python -m benchmarks.run_all --report-only   # rebuild docs/benchmarks.md from the logs

``make benchmarks`` runs the first command.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._lib import machine
from benchmarks._lib.cli import benchmark_parser

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "runs" / "benchmarks"
REPORT = ROOT / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Entry:
    """One benchmark run of the report.

    Args:
        name: Short id (log file name, ``--only``).
        title: Section heading.
        args: The module (``benchmarks.NAME``, run with ``python -m`` from the repository root) and its arguments.
        minutes: Expected wall minutes on 2 idle cores (for ``--list``).
        about: What the run compares and at what size, for the report.
        figure: A figure the run writes, relative to ``docs/`` (shown in the report under the tables), or ``""``.
        quick: The script has a ``--quick`` smoke run (``--quick`` runs it instead of ``args``).
    """

    name: str
    title: str
    args: tuple[str, ...]
    minutes: float
    about: str
    figure: str = ""
    quick: bool = True


ENTRIES: tuple[Entry, ...] = (
    Entry(
        "continual",
        "Continual learning: SplitLoRA and PCLR against their peers (WordNet, MiniLM-L6)",
        ("benchmarks.continual_wordnet", "--resume", "--out", "runs/benchmark_continual_wordnet"),
        91,
        "Class-incremental, 5 tasks x 4 supersenses; seq_lora, InfLoRA-style, O-LoRA, OSF, SplitLoRA, PCLR "
        "(measured-contribution rule) and joint training. Each method's learning rate is chosen from a 3-point grid "
        "(half a decade apart) on the validation split of seed 0, then run on the test split of 5 seeds, each its own "
        "class draw and order; seq_lora and joint are rerun at twice the epochs to check convergence. `--resume` "
        "reuses the runs already recorded in `runs/benchmark_continual_wordnet/checkpoint.json` with the same "
        "settings, so a rerun costs only what is missing (`--tasks 10` runs the 10 x 2 sequence).",
    ),
    Entry(
        "continual_fortunes",
        "Continual learning on a second data set: fortunes (MiniLM-L6)",
        (
            "benchmarks.continual_wordnet",
            "--dataset",
            "fortunes",
            "--tasks",
            "4",
            "--train-per-class",
            "40",
            "--val-per-class",
            "20",
            "--test-per-class",
            "30",
            "--max-length",
            "64",
            "--methods",
            "seq_lora",
            "inflora",
            "splitlora",
            "pclr",
            "joint",
            "--seeds",
            "0",
            "1",
            "2",
            "--resume",
        ),
        65,
        "The same protocol on twelve topics of Debian's `fortunes` (4 tasks x 3 topics, 40 train / 20 validation / 30 "
        "test per class, 64 tokens): seq_lora, InfLoRA-style, SplitLoRA, PCLR and joint training, each method's "
        "learning rate chosen on the validation split of seed 0, then the test split of 3 seeds (class draws and "
        "orders). The grid centres are the WordNet run's, so the two tables compare the same settings.",
    ),
    Entry(
        "riemannion",
        "Riemannion against LoRA optimizers (WordNet, MiniLM-L6, one task)",
        (
            "benchmarks.riemannion",
            "--json",
            "runs/benchmarks/riemannion.json",
            "--runs",
            "runs/benchmarks/riemannion-runs.json",
        ),
        58,
        "All 44 supersenses in one task, rank 16, 330 steps of 16 (6 epochs), five methods (LoRA-GA with "
        "`--methods`): a 3-point lr grid per method (half a decade apart) tuned on the validation split with "
        "seed 0, test over seeds 0-4 with paired "
        "95 % intervals to LoRA + AdamW, accuracy vs steps (55 / 110 / 220 / 330), step time interleaved in one "
        "process, LOI cost in steps; the figure is validation accuracy vs learning rate.",
        "figures/riemannion_lr.png",
    ),
    Entry(
        "dct",
        "DCT-AdamW and SVD-free siblings against GaLore, APOLLO and AdamW",
        (
            "benchmarks.dct_vs_galore",
            "--json",
            "runs/benchmarks/dct_vs_galore.json",
            "--runs",
            "runs/benchmarks/dct_vs_galore-runs.json",
            "--png",
            "docs/figures/dct_vs_galore_lr.png",
        ),
        145,
        "Refresh time of every basis at 1024 and 4096, captured gradient energy of every basis on real MiniLM-L6 "
        "gradients, full fine-tuning of MiniLM-L6 on WordNet at ranks 8 and 64 with each optimizer's lr chosen on "
        "validation (3-point grid) and 3 test seeds (90 runs of about 90 s; `--ranks 8` halves it), step time; the "
        "figure is validation accuracy vs learning rate per rank (seed 0).",
        "figures/dct_vs_galore_lr.png",
    ),
    Entry(
        "fsdp_state",
        "Optimizer state per rank under FSDP2 (2 ranks) and Riemannion's gather cost",
        ("benchmarks.fsdp_optimizer_state", "--json", "runs/benchmarks/fsdp_state.json"),
        2,
        "Full fine-tuning of a tiny Llama (hidden 256) sharded with fully_shard over 2 gloo processes on CPU: AdamW, "
        "DCT-AdamW and GaLore-AdamW state per rank against one process; Riemannion's optimizer step with its per-step "
        "gathers (docs/dct_adamw.md, docs/riemannion.md).",
        quick=False,
    ),
    Entry(
        "mora",
        "MoRA with missing modalities (emoji image-text pairs)",
        (
            "benchmarks.mora_missing_modality",
            "--json",
            "runs/benchmarks/mora.json",
            "--runs",
            "runs/benchmarks/mora-runs.json",
        ),
        42,
        "Each method's learning rate chosen on the emoji validation split (3-point grid, 70 % missing of both kinds, "
        "seed 0), then test accuracy over 5 seeds with complete pairs and at 70 % missing (text, image, both): MoRA "
        "vs LoRA (r = 4, and at MoRA's exact parameter count), frozen backbone and a missing-aware prompt baseline.",
    ),
    Entry(
        "splitlora_scaling",
        "SplitLoRA at LLM scale: statistics, task boundary, memory and checkpoints against LoRA",
        ("benchmarks.splitlora_scaling", "--json", "runs/benchmarks/splitlora_scaling.json"),
        15,
        "Random Llama models of width 256-4096 (r = 16 on all seven projections, batches of 4 x 64 tokens, one "
        "thread): statistics pass against a plain forward, end_task in LoRA-step equivalents, memory and checkpoint "
        "sizes against LoRA; each Llama-3-8B / 70B projection shape measured alone and summed on paper per 1k tokens, "
        "per task boundary and per GPU under FSDP2 (docs/splitlora.md).",
    ),
    Entry(
        "splitlora_fsdp2",
        "SplitLoRA's statistics under FSDP2: sharded over the input features or whole on every process",
        ("benchmarks.splitlora_fsdp2", "--json", "runs/benchmarks/splitlora_fsdp2.json"),
        2,
        "A random Llama (hidden 256, 2 layers, r = 16 on all seven projections) sharded with fully_shard over 2 gloo "
        "processes on CPU: one task's statistics (dense, and 64-row sketches) with shard_statistics on and off, bytes "
        "per process against one process, the statistics pass against a plain forward, collectives, end_task and "
        "the splits; Llama-3-8B / 70B per-process bytes on 8 processes on paper (docs/distributed.md).",
        quick=False,
    ),
    Entry(
        "riemannion_step",
        "Riemannion's step time and LOI's cost against LoRA + AdamW",
        ("benchmarks.riemannion", "--timing-only"),
        2,
        "MiniLM-L6 on WordNet (r = 16 on query and value, batches of 16): a training step of Riemannion (LOI and "
        "random start), LoRA + AdamW, LoRA with the Riemannian preconditioner and with Muon, interleaved in one "
        "process (40 rounds), and LOI's one-off cost as a share of the protocol's 330-step run (docs/riemannion.md).",
    ),
    Entry(
        "pclr_sequence",
        "PCLR's CPU over a 10-task sequence against sequential LoRA",
        ("benchmarks.pclr", "--sequence-cost", "--tasks", "10", "--cost-rounds", "2"),
        9,
        "The continual benchmark's pclr entry (contribution rule, task-routed distillation) and seq_lora on one "
        "seed's 10 x 2 WordNet sequence, each in its own thread, taking turns task by task on one core, each timed "
        "by its thread's CPU clock (docs/pclr.md, 'What a run costs').",
        quick=False,
    ),
    Entry(
        "pclr_overhead",
        "PCLR routing overhead per forward",
        ("benchmarks.pclr", "--overhead-only"),
        1,
        "MiniLM-L6 eval forward, batch 32 x 32 tokens: base, LoRA r=16, PCLR pool 32 / top-16 per-sample routing.",
        quick=False,
    ),
    Entry(
        "pclr_step",
        "PCLR training step against LoRA",
        ("benchmarks.pclr", "--step", "--widths", "256", "1024", "2048", "--rounds", "20", "12", "8"),
        25,
        "Random Llama (2 layers, all 7 projections, batch 4 x 64 tokens, one thread): a training step (forward, "
        "backward, AdamW) of PCLR with its pool at the cap (64 ranks: 48 static of three finished 16-rank tasks, 16 "
        "new; top-16, query-key loss) against PEFT's LoRA r = 16, the two taking turns in one process.",
        quick=False,
    ),
    Entry(
        "kernels",
        "Kernels: rank-pool gather and batched retraction (torch reference paths on CPU)",
        ("benchmarks.kernel_speed",),
        1,
        "On CPU only the reference paths run; GPU figures need benchmarks/gpu_check.sh on a CUDA machine.",
        quick=False,
    ),
    Entry(
        "causal_lm_bf16",
        "Causal-LM fine-tuning in bf16: LoRA + AdamW, Riemannion, LoRA + DCT-AdamW (tiny Llama, WordNet bytes)",
        (
            "benchmarks.causal_lm_bf16",
            "--png",
            "docs/figures/causal_lm_bf16.png",
            "--json",
            "runs/benchmarks/causal_lm_bf16.json",
        ),
        10,
        "Model and adapters in bf16, all 7 projections at rank 8, a tiny Llama pretrained in the script on noun "
        "glosses and fine-tuned on verb glosses; lr per method from a 3-point grid on a validation split, 3 seeds, "
        "steps interleaved for timing. Optimizer state is exact; at this size the peak-memory delta is mostly "
        "activations and allocator slack, so it separates the methods less than the state does. Riemannion's "
        "trainable count includes its zero gradient probe Z (no optimizer state). This CPU has no bf16 matrix "
        "instructions, so the step times are CPU-only figures (bf16 products run about 10x slower than fp32 here). "
        "60 steps is a budget-matched comparison, not a converged one: the validation curves are still falling at the "
        "end (figure), and the three methods end within 0.013 nats / byte of each other.",
        "figures/causal_lm_bf16.png",
    ),
    Entry(
        "pretrain_llama",
        "Pretraining a tiny Llama from scratch: AdamW, GaLore, APOLLO, DCT-AdamW and SVD-free options (WordNet bytes)",
        (
            "benchmarks.pretrain_llama",
            "--png",
            "docs/figures/pretrain_llama_loss.png",
            "--json",
            "runs/benchmarks/pretrain_llama.json",
            "--runs",
            "runs/benchmarks/pretrain_llama-runs.json",
        ),
        130,
        "The DCT-AdamW paper's regime shrunk to a CPU: a 4.9 M-parameter Llama (hidden 256, 8 layers, byte "
        "vocabulary) trained from scratch on WordNet definitions and examples, 400 steps x 1,024 bytes for every "
        "optimizer; the 56 attention / MLP projections at rank 64, refreshed every 50 steps, for every low-rank "
        "optimizer (embeddings, head and norms plain AdamW); lr per optimizer from a 3-point grid on a validation "
        "split (seed 0), then 3 test seeds; perplexity per byte; the optimizers trained side by side for the step "
        "times.",
        "figures/pretrain_llama_loss.png",
    ),
)

TARGET = re.compile(r"\b(met|NOT met|PASS|FAIL)\b")


QUICK = False  # --quick: each script's own smoke run, logs in runs/benchmarks-quick, no report in docs/
TIMEOUT: float | None = None  # seconds an entry may run before it is stopped (None: no limit; tests set one)


def arguments(entry: Entry) -> tuple[str, ...]:
    """The entry's arguments; with ``--quick`` the script's ``--quick`` run where it has one (its other arguments
    dropped, so no figure or JSON of the real run is overwritten)."""
    if QUICK and entry.quick:
        return (entry.args[0], "--quick")
    return entry.args


def command(entry: Entry) -> list[str]:
    return [sys.executable, "-m", *arguments(entry)]


def shown(entry: Entry) -> str:
    return "python -m " + " ".join(arguments(entry))


def run(entry: Entry) -> tuple[int, float]:
    """Run one entry from the repository root, streaming its output to the terminal and keeping it in its log
    (atomically)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log, tmp = LOGS / f"{entry.name}.log", LOGS / f"{entry.name}.log.tmp"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    print(f"[run_all] {entry.name}: {shown(entry)}", flush=True)
    start = time.perf_counter()
    with tmp.open("w") as out:
        proc = subprocess.Popen(
            command(entry), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        watchdog = threading.Timer(TIMEOUT, proc.kill) if TIMEOUT is not None else None
        if watchdog is not None:
            watchdog.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if "\r" not in line:  # progress bars stay out of the terminal
                sys.stdout.write(line)
        code = proc.wait()
        if watchdog is not None:
            watchdog.cancel()
        seconds = time.perf_counter() - start
        out.write(f"\n[run_all] exit {code}, {seconds:.0f} s wall\n")
    os.replace(tmp, log)
    return code, seconds


def extract(text: str) -> tuple[list[str], list[str], str]:
    """The markdown tables (with the line before each, often its caption), target lines and the run footer."""
    lines = [line.rstrip() for line in text.replace("\r", "\n").splitlines()]
    blocks: list[str] = []
    targets: list[str] = []
    footer = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            caption = next((lines[k] for k in range(i - 1, max(i - 3, -1), -1) if lines[k].strip()), "")
            caption = caption if caption and not caption.startswith(("[", "|")) else ""
            blocks.append(((caption.strip() + "\n\n") if caption else "") + "\n".join(lines[i:j]))
            i = j
            continue
        if TARGET.search(line) and ("target" in line.lower() or "PASS" in line or "FAIL" in line):
            targets.append(line.strip())
        if line.startswith("[run_all] exit"):
            footer = line.removeprefix("[run_all] ").strip()
        i += 1
    return blocks, targets, footer


def earlier_report(text: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """A report's sections by title (their lines after the heading) and its targets-at-a-glance rows by entry name,
    so a partial re-run keeps what it did not re-run."""
    sections: dict[str, list[str]] = {}
    glance: dict[str, list[str]] = {}
    title = None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            sections[title] = []
        elif title == "Targets at a glance":
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and len(cells) == 2 and cells[0] not in ("benchmark", "---"):
                name = cells[0].removesuffix(" (kept)")
                glance.setdefault(name, []).append(f"| {name} (kept) | {cells[1]} |")
        elif title is not None:
            sections[title].append(line)
    return sections, glance


def _earlier_section(entry: Entry, sections: dict[str, list[str]]) -> str | None:
    """The earlier section of ``entry``: the one with its title, else the one whose command runs its script (titles
    change; reports before the benchmarks became a package ran ``python benchmarks/NAME.py``); none if that section
    only said it was not run."""
    runs = [t for t, lines in sections.items() if shown(entry) in lines]
    starts = (f"python -m {entry.args[0]} ", f"python {entry.args[0].replace('.', '/')}.py ")
    runs_script = [t for t, lines in sections.items() if any(f"{x} ".startswith(starts) for x in lines)]
    candidates = [entry.title, *runs, *runs_script]
    for title in candidates:
        if title in sections and "Not run yet." not in sections[title]:
            return title
    return None


def report(entries: list[Entry], earlier: str | None = None) -> str:
    """The markdown report from the logs of ``entries``. An entry without a log keeps its section (and its verdict
    rows) from ``earlier``, the report being replaced, marked as such; otherwise it is listed as not run."""
    sections, glance = earlier_report(earlier) if earlier else ({}, {})
    out = [
        "# Benchmarks",
        "",
        "Written by `python -m benchmarks.run_all` (`make benchmarks`) from the logs in `runs/benchmarks/`; every "
        "table below is the benchmark script's own output, every target line its own verdict. Sizes are chosen so the "
        "whole report fits a 2-core CPU machine; each method's docs page has the larger runs.",
        "",
        f"Machine: {machine.summary()}. Report written {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        "",
    ]
    summary: list[str] = []
    for entry in entries:  # re-run entries replace their own sections: none of those may be kept for another
        if (LOGS / f"{entry.name}.log").is_file():
            sections.pop(entry.title, None)
    for entry in entries:
        log = LOGS / f"{entry.name}.log"
        earlier_title = _earlier_section(entry, sections) if not log.is_file() else None
        if earlier_title is not None:
            note = (
                "_Kept from the previous report: not re-run since, so its sizes and protocol may predate the script._"
            )
            body = "\n".join(line for line in sections.pop(earlier_title) if line != note).strip("\n")
            out += [f"## {entry.title}", "", note, "", body, ""]
            summary += glance.get(entry.name, [])
            continue
        out += [f"## {entry.title}", "", entry.about, "", "```bash", shown(entry), "```", ""]
        if not log.is_file():
            out += ["Not run yet.", ""]
            continue
        blocks, targets, footer = extract(log.read_text())
        if footer:
            out += [f"Run: {footer}.", ""]
        for block in blocks:
            out += [block, ""]
        if entry.figure:
            out += [f"![{entry.title}]({entry.figure})", ""]
        if targets:
            out += ["Targets:", ""] + [f"- {t}" for t in targets] + [""]
            summary += [f"| {entry.name} | {t} |" for t in targets]
    if summary:
        out[6:6] = ["## Targets at a glance", "", "| benchmark | verdict |", "|---|---|", *summary, ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, quick="smoke runs (each script's --quick), into runs/benchmarks-quick")
    names = [e.name for e in ENTRIES]
    parser.add_argument("--only", nargs="+", choices=names, help="run only these entries")
    parser.add_argument("--reuse", action="store_true", help="skip entries that already have a log")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from the logs")
    parser.add_argument("--list", action="store_true", help="print the entries and exit")
    parser.add_argument("--out", type=Path, default=None, help="the report (default docs/benchmarks.md)")
    args = parser.parse_args(argv)
    global QUICK, LOGS
    if args.quick:
        QUICK, LOGS = True, ROOT / "runs" / "benchmarks-quick"
    if args.out is None:
        args.out = LOGS / "report.md" if args.quick else REPORT
    selected = [e for e in ENTRIES if not args.only or e.name in args.only]
    if args.list:
        for e in ENTRIES:
            print(f"{e.name:<14} ~{e.minutes:>4.0f} min  {shown(e)}")
        print(f"{'total':<14} ~{sum(e.minutes for e in ENTRIES):>4.0f} min")
        return 0
    failed = []
    if not args.report_only:
        for entry in selected:
            if args.reuse and (LOGS / f"{entry.name}.log").is_file():
                print(f"[run_all] {entry.name}: reusing {LOGS / (entry.name + '.log')}")
                continue
            code, _ = run(entry)
            if code != 0:
                failed.append(entry.name)
    text = report(list(ENTRIES), args.out.read_text() if args.out.is_file() else None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, args.out)
    print(f"[run_all] wrote {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if args.out == REPORT:
        from benchmarks import figures

        if figures.main([]) != 0:  # the pages' figures follow the report they quote
            failed.append("figures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
