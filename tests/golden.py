"""Golden runs: a miniature of every shipped job, with fixed seeds, against the results committed in
``tests/golden/runs.json``.

Each case is a shipped config (``configs/*.yaml``) shrunk to a tiny random BERT, a few WordNet classes and a few
steps, and run through ``peft-ext run`` as users run it: every continual method of ``make run`` and every optimizer
comparison. What is compared (``tests/test_golden.py``): each method's accuracy matrix and its mean training loss per
task. A refactor that keeps behaviour keeps these; a changed mechanism (a lost regularizer, another initialization,
a different update) moves the losses far beyond the noise of another CPU or thread count.

Changing the golden file is one explicit command, after which the change gets a line in ``CHANGELOG.md`` saying why::

    make golden          # = python -m tests.golden --update
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from .helpers import save_tiny_bert
from .single_thread import torch_threads

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "runs.json"

#: How each shipped config is shrunk: data, training, and per-method edits (keyed by the method's name).
SHRINK: dict[str, dict[str, Any]] = {
    "quickstart": {
        "data": {"n_tasks": 3, "classes_per_task": 2, "train_per_class": 8, "test_per_class": 6},
        "train": {"epochs": 2, "batch_size": 4},
        "adapter": {"r": 2},
        "pclr": {"pool_size": 6, "ranks_schedule": [3], "top_k": 3, "compress_schedule": [0.0, 0.5]},
        "inflora": {"r": 2},
    },
    "riemannion_wordnet": {
        "data": {"classes_per_task": 6, "train_per_class": 8, "test_per_class": 6},
        "train": {"epochs": 2, "batch_size": 4},
        "adapter": {"r": 2},
    },
    "dct_adamw_wordnet": {
        "data": {"classes_per_task": 6, "train_per_class": 8, "test_per_class": 6},
        "train": {"epochs": 2, "batch_size": 4},
        # 30x the shipped lr: at 1e-4 a dozen steps hardly move a random tiny model, and the three optimizers'
        # losses would differ by less than the tolerance
        "full_ft": {"lr": 3e-3},
        "optimizer": {"rank": 2},  # into every method's optimizer section that has options
    },
}


def shrunk_config(name: str, backbone: Path, out_dir: Path) -> dict[str, Any]:
    """``configs/<name>.yaml`` shrunk by :data:`SHRINK`, on ``backbone``, writing to ``out_dir``."""
    data = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    edits = SHRINK[name]
    data["model"]["backbone"] = str(backbone)
    data["data"].update(edits["data"])
    data["train"].update(edits["train"])
    for method in data["methods"]:
        if method["name"] == "pclr":
            method["adapter"].update(edits["pclr"])
        elif "adapter" in method and "adapter" in edits:
            method["adapter"].update(edits["adapter"])
        if method["name"] in edits and method["name"] != "pclr":
            method.update(edits[method["name"]])
        if isinstance(method.get("optimizer"), dict) and "optimizer" in edits:
            method["optimizer"].update(edits["optimizer"])
    data["output"]["dir"] = str(out_dir)
    return data


def run_case(
    name: str, work: Path, backbone: Path, threads: int = 1, only: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Run the shrunk config ``name`` with ``peft-ext run`` on ``threads`` intra-op threads (``only``: just these
    method labels; each method starts from the seed, so a subset gives the same records); returns ``{label:
    record}`` with each method's accuracy matrix and per-task mean training loss."""
    from peft_ext_cli import main

    cfg = work / f"{name}.yaml"
    out = work / f"{name}-out"
    cfg.write_text(yaml.safe_dump(shrunk_config(name, backbone, out)))
    with torch_threads(threads):
        status = main(["run", str(cfg), "--no-progress", *(["--only", ",".join(only)] if only else [])])
    if status != 0:
        raise RuntimeError(f"the golden run {name} failed with status {status} (its error is printed above)")
    payload = json.loads((out / "results.json").read_text())
    if payload.get("failed"):
        raise RuntimeError(f"methods of the golden run {name} failed: {payload['failed']}")
    runs = {}
    for r in payload["results"]:
        runs[r["label"]] = {"accuracy_matrix": r["accuracy_matrix"], "task_losses": r["task_losses"]}
        compared = r["extras"].get("heads")
        if compared:  # the heads scored on the same run (compare_heads)
            runs[r["label"]]["heads"] = {name: data["accuracy_matrix"] for name, data in sorted(compared.items())}
    return runs


def run_all(work: Path, threads: int = 1) -> dict[str, dict[str, dict[str, Any]]]:
    """Every case of :data:`SHRINK`, in ``work``."""
    backbone = save_tiny_bert(work / "tiny-bert", num_layers=2, seed=0)
    return {name: run_case(name, work, backbone, threads) for name in SHRINK}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help=f"rewrite {GOLDEN.relative_to(ROOT)}")
    parser.add_argument("--out", type=Path, help="write the runs' JSON here instead (to compare, e.g. threads)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (the golden file: 1)")
    args = parser.parse_args(argv)
    if args.update and args.threads != 1:
        parser.error("the golden file is written on one thread (--threads 1)")
    with tempfile.TemporaryDirectory() as tmp:
        runs = run_all(Path(tmp), args.threads)
    text = json.dumps(runs, indent=1, sort_keys=True) + "\n"
    if not args.update:
        if args.out is None:
            print(text)
        else:
            args.out.write_text(text)
        return 0
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(text)
    print(f"wrote {GOLDEN.relative_to(ROOT)}: {sum(len(v) for v in runs.values())} method runs; add a CHANGELOG line")
    return 0


if __name__ == "__main__":
    sys.exit(main())
