"""PCLR on the WordNet supersense sequence with MiniLM-L6: index vs importance compression (and sequential LoRA).

The question (docs/methods.md (PCLR)): the public code compresses the rank pool by dropping every s-th rank;
the paper speaks of importance. Which keeps more accuracy? Both PCLR variants see the same sequence, backbone, head
initialization, batches and schedule; only the compression rule differs. A variant without integration shows what
the distillation step adds, and sequential LoRA is the forgetting reference.

Run (about 6-8 minutes on 2 shared CPU cores at the defaults)::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.pclr

Prints one table: accuracy on each task right after learning it (the diagonal, after compression), final average
accuracy, forgetting, average incremental accuracy, pool ranks after each task, how many ranks of each task survive
at the end, and wall time per method. ``--overhead-only`` times one forward pass instead. docs/pclr.md records
the figures.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks._lib.cli import benchmark_parser, int_options
from benchmarks._lib.tables import markdown_table
from benchmarks._lib.timing import Interleaved
from peft_ext.continual import TrainConfig, get_continual_method, run_sequence
from peft_ext.data.collate import TextCollator
from peft_ext.data.wordnet import wordnet_task_sequence
from peft_ext.models import load_text_classifier
from peft_ext.tuners.pclr import group_layers


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__)
    int_options(
        parser, tasks=4, classes_per_task=3, train_per_class=40, test_per_class=20, epochs=2, pool_size=32, ranks=16
    )
    parser.add_argument("--compress", type=float, default=0.5, help="fraction dropped after every task but the first")
    int_options(parser, top_k=16, seed=0)
    parser.add_argument("--no-baselines", action="store_true", help="skip seq_lora and the no-integration variant")
    parser.add_argument("--overhead-only", action="store_true", help="only time one forward: PCLR vs LoRA")
    args = parser.parse_args(argv)
    if args.overhead_only:
        routing_overhead(args)
        return

    sequence = wordnet_task_sequence(
        n_tasks=args.tasks,
        classes_per_task=args.classes_per_task,
        seed=args.seed,
        train_per_class=args.train_per_class,
        test_per_class=args.test_per_class,
    )
    base, tokenizer = load_text_classifier("minilm", sequence.num_classes, dropout=0.1, seed=args.seed)
    collate = TextCollator(tokenizer, 32)
    train = TrainConfig(epochs=args.epochs, batch_size=16, eval_batch_size=128, seed=args.seed, progress=False)
    adapter = dict(
        pool_size=args.pool_size,
        ranks_schedule=[args.ranks],
        compress_schedule=[0.0, args.compress],
        top_k=args.top_k,
        alpha=float(args.top_k),
        shared_r=4,
        shared_alpha=8.0,
        target_modules=["query", "value"],
    )
    variants = [
        ("pclr_index", "pclr", {"lr": 2e-3, "adapter": {**adapter, "compress_rule": "index"}}),
        ("pclr_importance", "pclr", {"lr": 2e-3, "adapter": {**adapter, "compress_rule": "importance"}}),
    ]
    if not args.no_baselines:
        importance = {"lr": 2e-3, "adapter": {**adapter, "compress_rule": "importance"}}
        variants.append(("pclr_importance_no_integrate", "pclr", {**importance, "cycle": {"integrate_epochs": 0}}))
        lora = {"r": 8, "lora_alpha": 16.0, "target_modules": ["query", "value"]}
        variants.append(("seq_lora", "seq_lora", {"lr": 1e-3, "adapter": lora}))

    rows = []
    for label, name, options in variants:
        method = get_continual_method(name)(**options, label=label)
        pools: list[int] = []
        survivors: list[list[int]] = []
        if name == "pclr":
            original = method.after_task

            def after_task(model, task_id, task, ctx, _original=original, _pools=pools, _survivors=survivors):
                out = _original(model, task_id, task, ctx)
                _pools.append(ctx.state["pclr_pool"][-1])
                # which task each surviving rank of the first block came from: does a rule favour old or new ranks?
                owner = next(iter(group_layers(model).values()))[0]
                tags = owner.active_rank_task("default")
                _survivors.append([int((tags == t).sum()) for t in range(task_id + 1)])
                return out

            method.after_task = after_task
        start = time.perf_counter()
        result = run_sequence(sequence, method, base, collate, train)
        seconds = time.perf_counter() - start
        m = result.metrics
        diagonal = sum(result.accuracy_matrix[t][t] for t in range(len(sequence))) / len(sequence)
        rows.append(
            (label, diagonal, m["final_acc"], m["forgetting"], m["avg_incremental_acc"], pools, survivors, seconds)
        )
        print(
            f"[pclr bench] {label}: final {100 * m['final_acc']:.1f}  forgetting {100 * m['forgetting']:.1f}  "
            f"pool {pools}  ranks per task kept {survivors}  {seconds:.0f} s",
            flush=True,
        )

    print(
        f"\nWordNet supersenses, {args.tasks} tasks x {args.classes_per_task} classes, MiniLM-L6, class-incremental,"
        f" torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    head = ["method", "just-learnt acc %", "final acc %", "forgetting %", "avg incremental acc %"]
    head += ["pool ranks after each task", "ranks kept per task at the end (block 0)", "wall s"]
    cells = []
    for label, diagonal, final, forget, aia, pools, survivors, seconds in rows:
        pool = ", ".join(map(str, pools)) if pools else "-"
        kept = ", ".join(map(str, survivors[-1])) if survivors else "-"
        accs = [f"{100 * x:.1f}" for x in (diagonal, final, forget, aia)]
        cells.append([label, *accs, pool, kept, f"{seconds:.0f}"])
    print(markdown_table(head, cells, align="l" * 8))


def routing_overhead(args: argparse.Namespace, batch: int = 32, tokens: int = 32, rounds: int = 9) -> None:
    """Time one eval forward of MiniLM with PCLR (pool at its cap, top-K routing) against LoRA of rank ``top_k``.

    The models take turns (one forward each per round, ``rounds`` rounds after a warm-up), and each reports its
    fastest forward: on a shared machine the minimum of interleaved runs is the figure least moved by neighbours.
    """
    import copy
    from functools import partial

    from peft import LoraConfig, get_peft_model

    from peft_ext import PCLRConfig

    base, _ = load_text_classifier("minilm", 4, dropout=0.0, seed=0)
    ids = torch.randint(1000, 20000, (batch, tokens), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    configs = {
        "base": None,
        f"lora_r{args.top_k}": LoraConfig(r=args.top_k, target_modules=["query", "value"]),
        f"pclr_N{args.pool_size}_K{args.top_k}": PCLRConfig(
            target_modules=["query", "value"],
            pool_size=args.pool_size,
            # one forward over a full pool: task 0 fills it (the second entry, for later tasks, must leave room)
            ranks_schedule=[args.pool_size, max(1, args.pool_size // 2)],
            top_k=args.top_k,
            init_weights=False,
        ),
    }
    models = {}
    for label, config in configs.items():
        model = copy.deepcopy(base) if config is None else get_peft_model(copy.deepcopy(base), config)
        models[label] = model.eval()
    timer = Interleaved(list(models), warmup=1)  # the first round warms up; the order rotates round by round
    with torch.no_grad():
        for _ in range(rounds + 1):
            timer.round({label: partial(model, **inputs) for label, model in models.items()})
    best = {label: min(timer.times(label)) for label in models}
    print(
        f"\nForward time, batch {batch} x {tokens} tokens, eval, no grad, {torch.get_num_threads()} threads, "
        f"fastest of {rounds} interleaved rounds"
    )
    cells = [[label, f"{1000 * seconds:.1f}", f"{seconds / best['base']:.2f}x"] for label, seconds in best.items()]
    print(markdown_table(["model", "ms per forward", "vs base"], cells))


if __name__ == "__main__":
    main()
