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

``--step`` times a training step instead (forward, backward, AdamW step) of a random Llama (2 layers, all seven
projections adapted) with PCLR at a full pool against PEFT's LoRA of rank ``top_k``, interleaved in one process, per
width::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.pclr --step --widths 256 1024 2048 --rounds 20 12 6

PCLR runs as it trains the fourth task of 16-rank tasks: 48 static ranks of tasks 0-2 (their prototypes stored, so
prototype routing runs), 16 new trainable ranks, top-16 of the 64 (the pool at its cap), the query-key loss in the
loss. Target: PCLR step / LoRA step <= 1.10x at every width (median of the per-round ratios).

``--sequence-cost`` times whole runs instead: the continual benchmark's ``pclr`` entry against ``seq_lora``
(benchmarks/continual_wordnet.py's methods, sizes and data; its defaults unless ``--tasks``, ``--classes-per-task``,
``--train-per-class``, ``--test-per-class`` or ``--epochs`` are given), the two alternating run by run, one thread,
``--cost-rounds`` runs each::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.pclr --sequence-cost --tasks 10 --cost-rounds 2

Target: PCLR CPU s per run <= 1.5x sequential LoRA's (median of the per-round ratios).
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
    parser = benchmark_parser(__doc__, threads=1)
    for name, default in SIZES.items():
        option = "--" + name.replace("_", "-")
        text = f"default {default}; --sequence-cost: the continual benchmark's"
        parser.add_argument(option, type=int, default=None, help=text)
    int_options(parser, pool_size=32, ranks=16)
    parser.add_argument("--compress", type=float, default=0.5, help="fraction dropped after every task but the first")
    int_options(parser, top_k=16, seed=0)
    parser.add_argument("--no-baselines", action="store_true", help="skip seq_lora and the no-integration variant")
    parser.add_argument("--overhead-only", action="store_true", help="only time one forward: PCLR vs LoRA")
    parser.add_argument("--step", action="store_true", help="only time a training step: PCLR vs LoRA, per width")
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024, 2048], help="--step: Llama widths")
    parser.add_argument(
        "--rounds", type=int, nargs="+", default=[20, 12, 6], help="--step: timed rounds per width (last repeats)"
    )
    parser.add_argument(
        "--sequence-cost",
        action="store_true",
        help="only time whole continual runs: the benchmark's pclr entry vs seq_lora, alternating, CPU s per run",
    )
    parser.add_argument("--cost-rounds", type=int, default=1, help="--sequence-cost: runs of each method")
    args = parser.parse_args(argv)
    if args.sequence_cost:
        sequence_cost_table(args)
        return
    for name, default in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.overhead_only or args.step:  # timings of one process on its own threads, interleaved
        torch.set_num_threads(args.threads)
        (routing_overhead if args.overhead_only else step_overhead)(args)
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

            def after_task(
                model, task_id, task, ctx, _original=original, _pools=pools, _survivors=survivors, _method=method
            ):
                out = _original(model, task_id, task, ctx)
                _pools.append(_method.state["pclr_pool"][-1])
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


#: The sizes of the comparison table (``--sequence-cost`` takes the continual benchmark's unless they are given).
SIZES = {"tasks": 4, "classes_per_task": 3, "train_per_class": 40, "test_per_class": 20, "epochs": 2}
#: The whole-run target: PCLR CPU s per run / sequential LoRA's (median of the per-round ratios).
SEQUENCE_COST_TARGET = 1.5


def sequence_cost_table(args: argparse.Namespace) -> None:
    """Time whole runs of the continual benchmark's ``pclr`` entry and ``seq_lora``, alternating (see the module
    docstring), and print CPU seconds per run, the ratio and its verdict."""
    from benchmarks._lib.continual import Runs
    from benchmarks._lib.continual import parse_args as benchmark_args
    from benchmarks._lib.sequence_cost import cost_report, sequence_cost

    argv = ["--methods", "seq_lora", "pclr", "--convergence"]
    for name in SIZES:
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    torch.set_num_threads(1)
    cost = sequence_cost(Runs(benchmark_args(argv)), "pclr", "seq_lora", args.cost_rounds, seed=args.seed)
    print("\n".join(cost_report(cost, SEQUENCE_COST_TARGET)))


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


#: The training step's target: PCLR step / LoRA step (median of the per-round ratios) at every width.
STEP_TARGET = 1.10
LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _full_pool_pclr(base: torch.nn.Module, ids: torch.Tensor, ranks: int, top_k: int) -> torch.nn.Module:
    """PCLR on ``base`` training the fourth task of ``ranks``-rank tasks: the pool (``4 * ranks``) at its cap."""
    from peft import get_peft_model

    from peft_ext import PCLRConfig

    config = PCLRConfig(
        target_modules=LLAMA_PROJECTIONS,
        pool_size=4 * ranks,
        ranks_schedule=[ranks],
        compress_schedule=[0.0],
        compress_rule="importance",
        top_k=top_k,
        alpha=float(top_k),
        init_weights=False,
    )
    model = get_peft_model(base, config)
    for task in range(3):  # each task's prototype from its own sample, so prototype routing has work to do
        proto = model.query_prototype([{"input_ids": ids[task : task + 1]}])
        model.end_task(task, proto)
        model.begin_task(task + 1, proto)
    with torch.no_grad():  # new b_i non-zero (begin_task starts them at 0), as after a few steps of training
        for name, p in model.named_parameters():
            if ".pclr_B." in name:
                p.normal_(0.0, 0.02)
    return model


def _training_step(model: torch.nn.Module, ids: torch.Tensor, vocab: int, extra_loss=None):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        extra = extra_loss(model) if extra_loss is not None else None
        (loss if extra is None else loss + extra).backward()
        optimizer.step()

    return step


def step_overhead(args: argparse.Namespace, batch: int = 4, tokens: int = 64, layers: int = 2, vocab: int = 256):
    """Time a training step of PCLR at a full pool against LoRA of rank ``top_k``, side by side, per width.

    Per width both models adapt the same random Llama; each round runs one step of each (the order alternating),
    and the ratio is taken within each round (a shared machine's load moves both alike), then summarized over the
    rounds: the median and the geometric mean with its 95 % interval.
    """
    import copy

    from peft import LoraConfig, get_peft_model

    from peft_ext.models import tiny_llama
    from peft_ext.tuners.pclr import query_loss

    ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0))
    cells, met = [], True
    for i, width in enumerate(args.widths):
        rounds = args.rounds[min(i, len(args.rounds) - 1)]
        base = tiny_llama(vocab_size=vocab, hidden_size=width, num_layers=layers).train()
        torch.manual_seed(1)
        lora = get_peft_model(
            copy.deepcopy(base),
            LoraConfig(r=args.top_k, lora_alpha=args.top_k, target_modules=LLAMA_PROJECTIONS, init_lora_weights=False),
        )
        torch.manual_seed(2)
        pclr = _full_pool_pclr(base, ids, args.ranks, args.top_k)
        steps = {
            "pclr": _training_step(pclr.train(), ids, vocab, query_loss),
            "lora": _training_step(lora.train(), ids, vocab),
        }
        timer = Interleaved(list(steps), warmup=2)
        for _ in range(rounds + 2):
            timer.round(steps)
        ratio = timer.ratio("pclr", "lora")
        mean, low, high = ratio.interval
        met = met and ratio.median <= STEP_TARGET
        cells.append(
            [width, rounds, f"{1000 * timer.median('pclr'):.1f}", f"{1000 * timer.median('lora'):.1f}",
             f"{ratio.median:.2f}x", f"{mean:.2f}x [{low:.2f}, {high:.2f}]"]
        )  # fmt: skip
        print(f"  width {width}: {cells[-1]}", flush=True)
    pool = 4 * args.ranks
    print(
        f"\nTraining step (forward, backward, AdamW), random Llama x {layers} layers, all 7 projections, batch "
        f"{batch} x {tokens} tokens, {torch.get_num_threads()} thread(s); PCLR pool {pool} full ({pool - args.ranks} "
        f"static + {args.ranks} new ranks, top-{args.top_k}) vs LoRA r={args.top_k}; interleaved, after 2 warm-up "
        "rounds\n"
    )
    head = ["width", "rounds", "PCLR ms / step", "LoRA ms / step", "PCLR / LoRA (median)", "geo. mean [95 % CI]"]
    print(markdown_table(head, cells))
    print(f"\ntarget: PCLR step / LoRA step <= {STEP_TARGET:.2f}x at every width: {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
