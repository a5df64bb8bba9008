"""Where ``make run``'s time goes: the quickstart job (``configs/quickstart.yaml``, every method, the shipped data)
run as ``make run`` runs it, in a fresh interpreter, with the time per method and per phase (training, the heads'
pass and solves, evaluation) and the job's own phases (loading the model and data, saving adapters, writing
results) from its results file.

Target: ``make run`` at most 4 minutes on 2 idle cores (the job's process from start to exit; the Makefile's install
check before it takes about a second once installed).

Usage::

    python -m benchmarks.make_run            # about 7 minutes on 2 cores
    python -m benchmarks.make_run --quick    # two methods, one task: the script's smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._lib import machine
from benchmarks._lib.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"
TARGET_SECONDS = 240.0


def run_job(out: Path, quick: bool) -> float:
    """Run the quickstart job into ``out`` in a fresh interpreter; its wall seconds from start to exit."""
    command = [sys.executable, "-m", "peft_ext", "run", str(CONFIG), "--no-progress", "--set", f"output.dir={out}"]
    if quick:
        command += ["--only", "seq_lora,ncm", "--set", "data.n_tasks=1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def tables(payload: dict[str, Any], wall: float) -> tuple[list[list[str]], list[list[str]], float]:
    """Per-method rows, the job's phase rows and the seconds nothing above accounts for."""
    rows = []
    for r in payload["results"]:
        train = r["train_seconds"] - r.get("head_seconds", 0.0)
        heads, evaluation = r.get("head_seconds", 0.0), r["eval_seconds"]
        total = train + heads + evaluation
        rows.append([r["label"], f"{train:.1f}", f"{heads:.1f}", f"{evaluation:.1f}", f"{total:.1f}"])
    methods = sum(r["train_seconds"] + r["eval_seconds"] for r in payload["results"])
    phases = payload["meta"].get("phase_seconds", {})
    job = payload["meta"]["wall_seconds"]
    phase_rows = [["the methods (sum of the table above)", f"{methods:.1f}"]]
    phase_rows += [[name, f"{seconds:.1f}"] for name, seconds in phases.items()]
    rest_in_job = job - methods - sum(phases.values())
    phase_rows.append(["the rest of the job (each method's model built, callbacks)", f"{rest_in_job:.1f}"])
    phase_rows.append(["interpreter start, imports, exit", f"{wall - job:.1f}"])
    phase_rows.append(["the whole command", f"{wall:.1f}"])
    return rows, phase_rows, rest_in_job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two methods, one task (a smoke run of this script)")
    parser.add_argument("--out", default="runs/bench_make_run.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wall = run_job(Path(tmp) / "quickstart", args.quick)
        payload = json.loads((Path(tmp) / "quickstart" / "results.json").read_text())
    rows, phase_rows, _ = tables(payload, wall)
    threads = payload["meta"]["threads"]
    print(f"`peft-ext run configs/quickstart.yaml` ({machine.torch_platform()}, {threads} threads)\n")
    print(markdown_table(["method", "train s", "heads s", "eval s", "total s"], rows))
    print()
    print(markdown_table(["phase", "s"], phase_rows))
    verdict = "met" if wall <= TARGET_SECONDS else "NOT met"
    print(f"\n- target: make run <= {TARGET_SECONDS / 60:.0f} minutes on 2 idle cores: {wall:.0f} s: {verdict}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"wall_seconds": wall, "results": payload}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
