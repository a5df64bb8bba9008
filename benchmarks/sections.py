"""The benchmark runs of the report ``docs/benchmarks.md``: one :class:`Entry` per section, in report order.

Read by :mod:`benchmarks.run_all` (which runs each entry and writes its section) and by :mod:`benchmarks.figures`
(which finds a section by its entry's name). A module of its own, so the imports go one way: run_all imports figures
to rewrite the pages after the report, and figures needs nothing of run_all.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENTRIES", "RESULT_FILES", "Entry", "imported_benchmark_files", "result_code"]

ROOT = Path(__file__).resolve().parents[1]


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
        code: The package paths (git pathspecs) whose change makes the section older than its code, besides the
            script and the benchmark modules it imports (``run_all --stale``).
    """

    name: str
    title: str
    args: tuple[str, ...]
    minutes: float
    about: str
    figure: str = ""
    quick: bool = True
    code: tuple[str, ...] = ("peft_ext",)


SHARED_TUNER = ":(glob)peft_ext/tuners/*.py"  # the tuner base every adapter type builds on
RIEMANNION = (
    SHARED_TUNER,
    "peft_ext/tuners/riemannion",
    "peft_ext/optim",
    "peft_ext/manifolds",
    "peft_ext/kernels",
    "peft_ext/models",
)
CONTINUAL = ("peft_ext/continual", "peft_ext/tuners", "peft_ext/data", "peft_ext/models", "peft_ext/kernels")
PCLR = (SHARED_TUNER, "peft_ext/tuners/pclr", "peft_ext/kernels", "peft_ext/models")


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
        code=CONTINUAL,
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
        code=CONTINUAL,
    ),
    Entry(
        "continual_instruct",
        "Continual instruction tuning on a pretrained chat LM (SmolLM2-135M-Instruct, six shipped tasks)",
        ("benchmarks.continual_instruct",),
        110,
        "The shipped `configs/instruct.yaml` (`peft-ext run instruct`) over 3 task orders: six instruction tasks of "
        "WordNet and fortunes data (48 train / 24 test each, 2 epochs, chat-rendered), zero_shot, seq_lora, replay, "
        "O-LoRA, InfLoRA-style, SplitLoRA, PCLR and joint training at the config's learning rates; final average, "
        "forgetting, BWT and held-out perplexity after the sequence over the base model's; the targets judged by "
        "paired 95 % intervals over the orders. Finished runs are kept in `runs/benchmark_continual_instruct/`.",
        code=CONTINUAL + ("configs/instruct.yaml",),
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
        42,
        "All 44 supersenses in one task, rank 16, 330 steps of 16 (6 epochs), five methods (LoRA-GA with "
        "`--methods`): a 3-point lr grid per method (half a decade apart) tuned on the validation split with "
        "seed 0, test over seeds 0-4 with paired "
        "95 % intervals to LoRA + AdamW, accuracy vs steps (55 / 110 / 220 / 330), step time interleaved in one "
        "process, LOI cost in steps; the figure is validation accuracy vs learning rate.",
        "figures/riemannion_lr.png",
        code=RIEMANNION + ("peft_ext/continual", "peft_ext/data"),
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
        75,
        "Refresh time of every basis at 1024 and 4096, captured gradient energy of every basis on real MiniLM-L6 "
        "gradients, full fine-tuning of MiniLM-L6 on WordNet at ranks 8 and 64 with each optimizer's lr chosen on "
        "validation (3-point grid) and 3 test seeds (75 runs of about 90 s, each scored on both splits, two processes "
        "at a time; `--ranks 8` halves it), step time; the figure is validation accuracy vs learning rate per rank "
        "(seed 0).",
        "figures/dct_vs_galore_lr.png",
        code=("peft_ext/continual", "peft_ext/optim", "peft_ext/data", "peft_ext/models"),
    ),
    Entry(
        "fsdp_state",
        "Optimizer state per rank under FSDP2 (2 ranks) and Riemannion's gather cost",
        ("benchmarks.fsdp_optimizer_state", "--json", "runs/benchmarks/fsdp_state.json"),
        1,
        "Full fine-tuning of a tiny Llama (hidden 256) sharded with fully_shard over 2 gloo processes on CPU: AdamW, "
        "DCT-AdamW and GaLore-AdamW state per rank against one process; Riemannion's optimizer step with its per-step "
        "gathers (docs/dct_adamw.md, docs/riemannion.md).",
        quick=False,
        code=RIEMANNION + ("peft_ext/distributed", "peft_ext/continual/sharding.py"),
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
        62,
        "Each method's learning rate chosen on the emoji validation split (3-point grid, 70 % missing of both kinds, "
        "seed 0), then test accuracy over 5 seeds with complete pairs and at 70 % missing (text, image, both): MoRA "
        "vs LoRA (r = 4, and at MoRA's exact parameter count), frozen backbone and a missing-aware prompt baseline.",
        code=(SHARED_TUNER, "peft_ext/tuners/mora", "peft_ext/multimodal", "peft_ext/data", "peft_ext/models"),
    ),
    Entry(
        "head_cost",
        "What a continual head costs against its task's training (MiniLM-L6, the first task of `make run`)",
        ("benchmarks.head_cost",),
        2,
        "The first WordNet task of `make run` (4 supersenses x 40 glosses, real MiniLM-L6) trained as the config "
        "trains seq_lora (3 epochs); then the heads' one pass over the task's training data (shared by the heads) and "
        "each head's solve, timed apart; training and the heads take turns 3 times, medians. Memory: each head's "
        "saved state at width 4096 for 4 and 8 classes.",
        quick=True,
        code=CONTINUAL,
    ),
    Entry(
        "make_run",
        "`make run`: where the quickstart job's time goes",
        ("benchmarks.make_run",),
        8,
        "`peft-ext run configs/quickstart.yaml` in a fresh interpreter, every method on the shipped data (5 tasks x "
        "4 supersenses, 40 glosses per class): training, the heads and evaluation per method, and the job's own "
        "phases (model and data, saving adapters, writing results), from the run's results file.",
        code=CONTINUAL + ("peft_ext/jobs", "configs/quickstart.yaml"),
    ),
    Entry(
        "splitlora_scaling",
        "SplitLoRA at LLM scale: statistics, task boundary, memory and checkpoints against LoRA",
        ("benchmarks.splitlora_scaling", "--json", "runs/benchmarks/splitlora_scaling.json"),
        4,
        "Random Llama models of width 256-4096 (r = 16 on all seven projections, batches of 4 x 64 tokens, one "
        "thread): statistics pass against a plain forward, end_task in LoRA-step equivalents, memory and checkpoint "
        "sizes against LoRA; each Llama-3-8B / 70B projection shape measured alone and summed on paper per 1k tokens, "
        "per task boundary and per GPU under FSDP2 (docs/splitlora.md).",
        code=(SHARED_TUNER, "peft_ext/tuners/splitlora", "peft_ext/models"),
    ),
    Entry(
        "splitlora_fsdp2",
        "SplitLoRA's statistics under FSDP2: sharded over the input features or whole on every process",
        ("benchmarks.splitlora_fsdp2", "--json", "runs/benchmarks/splitlora_fsdp2.json"),
        1,
        "A random Llama (hidden 256, 2 layers, r = 16 on all seven projections) sharded with fully_shard over 2 gloo "
        "processes on CPU: one task's statistics (dense, and 64-row sketches) with shard_statistics on and off, bytes "
        "per process against one process, the statistics pass against a plain forward, collectives, end_task and "
        "the splits; Llama-3-8B / 70B per-process bytes on 8 processes on paper (docs/distributed.md).",
        quick=False,
        code=(
            SHARED_TUNER,
            "peft_ext/tuners/splitlora",
            "peft_ext/distributed",
            "peft_ext/continual/sharding.py",
            "peft_ext/models",
        ),
    ),
    Entry(
        "riemannion_step",
        "Riemannion's step time and LOI's cost against LoRA + AdamW",
        ("benchmarks.riemannion", "--timing-only"),
        2,
        "MiniLM-L6 on WordNet (r = 16 on query and value, batches of 16): a training step of Riemannion (LOI and "
        "random start), LoRA + AdamW, LoRA with the Riemannian preconditioner and with Muon, interleaved in one "
        "process (40 rounds), and LOI's one-off cost as a share of the protocol's 330-step run (docs/riemannion.md).",
        code=RIEMANNION + ("peft_ext/continual", "peft_ext/data"),
    ),
    Entry(
        "pclr_sequence",
        "PCLR's CPU over a 10-task sequence against sequential LoRA",
        ("benchmarks.pclr", "--sequence-cost", "--tasks", "10", "--cost-rounds", "2"),
        7,
        "The continual benchmark's pclr entry (contribution rule, task-routed distillation) and seq_lora on one "
        "seed's 10 x 2 WordNet sequence, each in its own thread, taking turns task by task on one core, each timed "
        "by its thread's CPU clock (docs/pclr.md, 'What a run costs').",
        quick=False,
        code=PCLR + ("peft_ext/continual", "peft_ext/data"),
    ),
    Entry(
        "pclr_overhead",
        "PCLR routing overhead per forward",
        ("benchmarks.pclr", "--overhead-only"),
        1,
        "MiniLM-L6 eval forward, batch 32 x 32 tokens: base, LoRA r=16, PCLR pool 32 / top-16 per-sample routing.",
        quick=False,
        code=PCLR,
    ),
    Entry(
        "pclr_step",
        "PCLR training step against LoRA",
        ("benchmarks.pclr", "--step", "--widths", "256", "1024", "2048", "--rounds", "20", "12", "8"),
        1,
        "Random Llama (2 layers, all 7 projections, batch 4 x 64 tokens, one thread): a training step (forward, "
        "backward, AdamW) of PCLR with its pool at the cap (64 ranks: 48 static of three finished 16-rank tasks, 16 "
        "new; top-16, query-key loss) against PEFT's LoRA r = 16, the two taking turns in one process.",
        quick=False,
        code=PCLR,
    ),
    Entry(
        "kernels",
        "Kernels: rank-pool gather and batched retraction (torch reference paths on CPU)",
        ("benchmarks.kernel_speed",),
        1,
        "On CPU only the reference paths run; GPU figures need benchmarks/gpu_check.sh on a CUDA machine.",
        quick=False,
        code=("peft_ext/kernels", "peft_ext/manifolds"),
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
        2,
        "Model and adapters in bf16, all 7 projections at rank 8, a tiny Llama pretrained in the script on noun "
        "glosses and fine-tuned on verb glosses; lr per method from a 3-point grid on a validation split, 3 seeds, "
        "steps interleaved for timing. Optimizer state is exact; at this size the peak-memory delta is mostly "
        "activations and allocator slack, so it separates the methods less than the state does. Riemannion's "
        "trainable count includes its zero gradient probe Z (no optimizer state). This CPU has no bf16 matrix "
        "instructions, so the step times are CPU-only figures (bf16 products run about 10x slower than fp32 here). "
        "60 steps is a budget-matched comparison, not a converged one: the validation curves are still falling at the "
        "end (figure), and the three methods end within 0.013 nats / byte of each other.",
        "figures/causal_lm_bf16.png",
        code=RIEMANNION + ("peft_ext/precision.py", "peft_ext/data"),
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
        74,
        "The DCT-AdamW paper's regime shrunk to a CPU: a 4.9 M-parameter Llama (hidden 256, 8 layers, byte "
        "vocabulary) trained from scratch on WordNet definitions and examples, 400 steps x 1,024 bytes for every "
        "optimizer; the 56 attention / MLP projections at rank 64, refreshed every 50 steps, for every low-rank "
        "optimizer (embeddings, head and norms plain AdamW); lr per optimizer from a 3-point grid on a validation "
        "split (seed 0), then 3 test seeds; perplexity per byte; the optimizers of one round trained side by side for "
        "the step times, two rounds at a time in two processes.",
        "figures/pretrain_llama_loss.png",
        code=("peft_ext/optim", "peft_ext/data", "peft_ext/models"),
    ),
    Entry(
        "llm_finetune",
        "Fine-tuning SmolLM2-135M-Instruct: Riemannion + LOI against LoRA + AdamW, DCT-AdamW and SubspaceAdamW "
        "against GaLore and APOLLO",
        ("benchmarks.llm_finetune", "--resume"),
        82,
        "The pretrained chat model (offline, 30 layers, hidden 576) fine-tuned on the union of the six shipped "
        "instruction tasks (32 training examples each; 24 steps of 8 examples, one epoch). Adapter track: Riemannion "
        "from LOI against LoRA + AdamW, r = 8 on q_proj and v_proj. Full track: DCT-AdamW and SubspaceAdamW against "
        "GaLore and APOLLO on the 210 decoder projections at rank 144 (embedding and norms AdamW). Each optimizer's "
        "lr from a 3-point grid by validation score (seed 0), then 3 test seeds with paired intervals against each "
        "track's baseline; the score is the mean over tasks of exact match / ROUGE-L, beside the answers' next-token "
        "loss; step times from the optimizers of a track trained side by side, two rounds at a time. "
        "Results in docs/results/llm_finetune.json; `--resume` reuses the finished runs.",
        code=RIEMANNION + ("peft_ext/continual", "peft_ext/data"),
    ),
)


#: Results files written outside this report (``kind`` in the file -> the benchmark module that writes it and the
#: package paths it measures): ``run_all --stale`` lists the files whose code changed since their recorded commit.
RESULT_FILES: dict[str, tuple[str, tuple[str, ...]]] = {
    "continual_heads": ("benchmarks.continual_heads", CONTINUAL),
}


def result_code(kind: str, config: str | None) -> tuple[str, tuple[str, ...]]:
    """The writing module and the code paths of a results file of ``kind`` made from shipped config ``config``."""
    module, code = RESULT_FILES[kind]
    return module, code + ((f"configs/{config}.yaml",) if config else ())


def _module_file(module: str, script: str, root: Path) -> str | None:
    """The file of ``module`` relative to the repository when it is the ``script`` or one of the benchmarks (``None``
    otherwise)."""
    if module not in (script, "benchmarks") and not module.startswith("benchmarks."):
        return None
    stem = module.replace(".", "/")
    return next((f for f in (f"{stem}.py", f"{stem}/__init__.py") if (root / f).is_file()), None)


def imported_benchmark_files(module: str, root: Path = ROOT) -> list[str]:
    """The files of benchmark ``module`` and of every benchmark module it imports, transitively, read from their
    source under ``root`` (nothing is imported): the files whose change makes its section older than its code."""
    seen: dict[str, None] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        path = _module_file(name, module, root)
        if path is None or path in seen:
            continue
        seen[path] = None
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        todo.append(name.rpartition(".")[0])  # importing a module runs its package's __init__ first
        for node in ast.walk(ast.parse((root / path).read_text())):
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: ``from .cache import RunCache`` in package ``benchmarks._lib``
                    parents = package.split(".")
                    base = ".".join(parents[: len(parents) - node.level + 1] + ([base] if base else []))
                todo += [base, *(f"{base}.{alias.name}" for alias in node.names)]  # ``from package import module``
    return list(seen)
