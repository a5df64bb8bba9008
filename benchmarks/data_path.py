"""Your own data at scale: time from ``peft-ext run`` to the first training step on a 100k-row CSV, and the data
path's throughput against the training step.

Run (about two minutes on 2 CPU cores)::

    .venv/bin/python -m benchmarks.data_path            # all 117,659 WordNet glosses, exported as one CSV

The CSV is written by ``python -m peft_ext.data export`` into a temporary folder, with a fresh ``datasets`` cache,
so the first pass is cold (CSV parsing and Arrow conversion, tokenization) and a second pass shows what the cache
saves. The stages are the job's own, in its order: the pre-flight check (reads the files and forms the tasks), the
sequence, the model, the tokenization (``datasets.map``, once for every method). Then, interleaved in one loop, the
collate of a batch of 32 pre-tokenized examples (all a method's batch costs on the data side) against one training
step of LoRA r=8 on MiniLM-L6 on that batch.

Targets: the data path is not the bottleneck (collate <= 5 % of a training step); time to the first step is reported.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from benchmarks._lib.cli import benchmark_parser
from benchmarks._lib.tables import markdown_table
from benchmarks._lib.timing import Interleaved


def stage(label: str, fn, rows: list) -> object:
    start = time.perf_counter()
    out = fn()
    rows.append((label, time.perf_counter() - start))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=20, help="interleaved collate / step rounds (after 3 warm-up)")
    parser.add_argument("--per-class", type=int, default=None, help="cap the export per class (default: all rows)")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="peft-ext-data-path-"))
    os.environ["HF_DATASETS_CACHE"] = str(tmp / "cache")  # cold: nothing of an earlier run is reused
    import torch
    from peft import LoraConfig, get_peft_model

    from peft_ext.continual.config import config_from_dict
    from peft_ext.data.build import export_csv
    from peft_ext.data.collate import TextCollator
    from peft_ext.data.user_data import tokenize_sequence
    from peft_ext.jobs.preflight import check_data
    from peft_ext.jobs.sequence import build_sequence
    from peft_ext.models import load_text_classifier

    csv_path = tmp / "wordnet_all.csv"
    n_rows = export_csv("wordnet", csv_path, per_class=args.per_class)
    config = config_from_dict(
        {
            "name": "data_path",
            "model": {"backbone": "minilm", "max_length": 32},
            "data": {"dataset": "files", "train": str(csv_path), "n_tasks": 5, "classes_per_task": 4},
            "methods": [{"name": "seq_lora", "adapter": {"r": 8, "target_modules": ["query", "value"]}}],
            "output": {"dir": str(tmp / "out")},
        }
    )
    passes = {}
    for name in ("cold", "warm"):
        rows: list[tuple[str, float]] = []
        stage("pre-flight (read, form tasks)", lambda: check_data(config), rows)
        sequence = stage("sequence (read, form tasks)", lambda: build_sequence(config), rows)
        n_classes = sequence.num_classes
        base, tokenizer = stage("model + tokenizer", lambda n=n_classes: load_text_classifier("minilm", n), rows)
        sequence = stage(
            "tokenize (datasets.map)", lambda s=sequence, t=tokenizer: tokenize_sequence(s, t, 32, False), rows
        )
        passes[name] = rows
    examples = sum(len(t.train) + len(t.test) for t in sequence.tasks)
    print(f"CSV: {n_rows:,} rows, {csv_path.stat().st_size / 2**20:.1f} MiB; the sequence uses {examples:,} examples")
    print(
        f"(5 tasks x 4 classes, test carved by hash; torch {torch.__version__}, {torch.get_num_threads()} threads)\n"
    )
    rows = [[label, f"{cold:.2f}", f"{warm:.2f}"] for (label, cold), (_, warm) in zip(passes["cold"], passes["warm"])]
    total = {k: sum(s for _, s in v) for k, v in passes.items()}
    rows.append(["**to the first training step**", f"**{total['cold']:.2f}**", f"**{total['warm']:.2f}**"])
    print(markdown_table(["stage", "cold (s)", "warm cache (s)"], rows) + "\n")

    collate = TextCollator(tokenizer, 32)
    model = get_peft_model(base, LoraConfig(r=8, target_modules=["query", "value"], modules_to_save=["classifier"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch_examples = sequence.tasks[0].train[:32]
    batch: dict = {}

    def step() -> None:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = torch.nn.functional.cross_entropy(
            logits.logits if hasattr(logits, "logits") else logits, batch["labels"]
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timer = Interleaved(["collate", "step"], warmup=3, rotate=False)  # the step trains on the batch just collated
    for _ in range(args.rounds + 3):
        timer.round({"collate": lambda: batch.update(collate(batch_examples)), "step": step})
    rows = [
        ["collate (pad stored ids)", f"{1e3 * timer.median('collate'):.2f}"],
        ["training step (LoRA r=8, MiniLM-L6)", f"{1e3 * timer.median('step'):.1f}"],
    ]
    print(markdown_table(["per batch of 32", "median ms"], rows))
    ratio = timer.ratio("collate", "step")
    share = ratio.median
    print(f"\ncollate / step, per-round median over {len(ratio.per_round)} interleaved rounds: {100 * share:.2f} %")
    verdict = "met" if share <= 0.05 else "NOT met"
    print(f"target: data path <= 5 % of a training step: {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
