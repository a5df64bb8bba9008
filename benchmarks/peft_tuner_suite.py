"""PEFT's own tuner tests (``tests/test_custom_models.py`` of its source distribution) over peft-ext's adapter types.

PEFT checks each of its tuners with one test class over a list of ``(name, model, config class, config kwargs)``
cases: save / load, merge / unmerge / safe merge, disable, several adapters, delete, mixed-adapter batches, only
adapter parameters trainable, half precision, ``low_cpu_mem_usage``, ... This script fetches the source
distribution of the installed PEFT version (``pip download``; or ``--sdist`` a local one), puts Riemannion,
SplitLoRA and PCLR cases in the shape of LoRA's (PEFT's MLP variants and its GPT-2 style ``Conv1D`` model) in front
of PEFT's list, runs those cases only, and prints a table per adapter type with the failures grouped by message.

    python -m benchmarks.peft_tuner_suite                  # all three types (a few minutes on 2 cores)
    python -m benchmarks.peft_tuner_suite --types pclr -x  # one type, stop at the first failure

It writes ``runs/peft_tuner_suite/results.json`` (counts and every failure's first line). By design, PCLR refuses to
merge while its routing depends on the input, and its routing keys learn through the query-key loss the training
adds rather than the task loss (docs/pclr.md); those failures are counted as such, with the reason.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import peft

from benchmarks._lib.cli import benchmark_parser
from benchmarks._lib.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]

#: Each type's config class and the kwargs it adds to every case (small pools and ranks: PEFT's MLP is 10 -> 20 -> 2).
TYPES = {
    "riemannion": ("RiemannionConfig", {"r": 2}),
    "splitlora": ("SplitLoRAConfig", {"r": 2}),
    # alpha = top_k: the pool's output scale alpha / top_k is 1, as LoRA's alpha / r is in PEFT's cases (PCLR's
    # default alpha of 64 over top_k = 2 diverges under the tests' SGD on their unnormalized inputs)
    "pclr": ("PCLRConfig", {"pool_size": 8, "ranks_schedule": [4], "top_k": 2, "alpha": 2.0}),
}
#: LoRA's custom-model cases that mean something for an adapter on linear layers: (label, model id, kwargs).
CASES = [
    ("Vanilla MLP 1", "MLP", {"target_modules": "lin0"}),
    ("Vanilla MLP 2", "MLP", {"target_modules": ["lin0"]}),
    ("Vanilla MLP 3", "MLP", {"target_modules": ["lin1"]}),
    ("Vanilla MLP 4", "MLP", {"target_modules": ["lin0", "lin1"]}),
    ("Vanilla MLP 5", "MLP", {"target_modules": ["lin0"], "modules_to_save": ["lin1"]}),
    ("Vanilla MLP 6", "MLP", {"target_modules": ["lin0", "lin1"], "modules_to_save": ["lin1"]}),
    ("Embedding + transformers Conv1D 1", "EmbConv1D", {"target_modules": ["conv1d"]}),
]
#: Deviations by design, per type: (what matches: the failure message or the test's name, why).
BY_DESIGN = {
    "pclr": [
        (re.compile(r"routing depends on the input|merging needs top_k"), "merging needs static routing"),
        (
            re.compile(r"test_training_custom_models|test_only_params_are_updated"),
            "the routing keys learn through the query-key loss the training adds, not through the task loss",
        ),
    ]
}


def sdist(path: str | None, work: Path) -> Path:
    """The ``tests`` folder of PEFT's source distribution for the installed version, extracted into ``work``."""
    if path is None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"peft=={peft.__version__}",
                "--no-binary",
                ":all:",
                "--no-deps",
                "-d",
                str(work),
                "-q",
            ],
            check=True,
        )
        path = str(next(work.glob("peft-*.tar.gz")))
    with tarfile.open(path) as archive:
        archive.extractall(work, filter="data")
    return next(work.glob("peft-*/tests"))


def inject(tests: Path, types: list[str]) -> list[str]:
    """Put the peft-ext cases first in ``TEST_CASES`` of test_custom_models.py; return the case names."""
    names, lines = [], []
    for kind in types:
        config, extra = TYPES[kind]
        for label, model_id, kwargs in CASES:
            name = f"{label} {config[:-6]}"
            names.append(name)
            lines.append(f"    ({name!r}, {model_id!r}, peft_ext.{config}, {dict(kwargs, **extra)!r}),")
    (tests / "__init__.py").touch()  # the tests import each other relatively
    try:
        import diffusers  # noqa: F401
    except ImportError:  # testing_common imports it for PEFT's Stable Diffusion tests only: a stand-in will do
        stub = tests.parent / "diffusers"
        stub.mkdir(exist_ok=True)
        (stub / "__init__.py").write_text(
            "class StableDiffusionPipeline:  # stand-in: diffusers is not installed\n    pass\n"
        )
    path = tests / "test_custom_models.py"
    text = path.read_text()
    head = "import peft_ext  # registers peft-ext's adapter types with PEFT\n"
    text = text.replace("TEST_CASES = [\n", "TEST_CASES = [\n" + "\n".join(lines) + "\n", 1)
    path.write_text(head + text)
    return names


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {sorted(TYPES)}")
    parser.add_argument("--sdist", help="a local peft-<version>.tar.gz (default: pip download the installed version)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "peft_tuner_suite"), help="where results.json goes")
    parser.add_argument("-x", action="store_true", help="stop at the first failure")
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = sorted(set(types) - set(TYPES))
    if unknown:
        parser.error(f"--types: unknown {unknown}; valid: {sorted(TYPES)}")
    with tempfile.TemporaryDirectory() as tmp:
        tests = sdist(args.sdist, Path(tmp))
        inject(tests, types)
        report = Path(tmp) / "junit.xml"
        selector = " or ".join(TYPES[t][0][:-6] for t in types)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            str(tests / "test_custom_models.py"),
            "-q",
            "-o",
            "addopts=",
            "-p",
            "no:cacheprovider",
            "-k",
            selector,
            f"--junitxml={report}",
            "-W",
            "ignore",
        ] + (["-x"] if args.x else [])
        subprocess.run(cmd, cwd=tests.parent, check=False)
        rows = summarize(ET.parse(report).getroot(), types)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"peft": peft.__version__, "types": rows}, indent=2))
    print(f"\nPEFT {peft.__version__} tests/test_custom_models.py over peft-ext's adapter types\n")
    counts = ["passed", "failed", "by_design", "skipped"]
    table = [[kind, *(str(row[c]) for c in counts)] for kind, row in rows.items()]
    print(markdown_table(["type", "passed", "failed", "by design", "skipped"], table))
    for kind, row in rows.items():
        for reason, count in row["design_reasons"].items():
            print(f"  {kind}, by design: {count} x {reason}")
        for message, count in row["failures"].items():
            print(f"  {kind}: {count} x {message}")
    print(f"\nwrote {out / 'results.json'}")
    if not sum(row["passed"] + row["failed"] + row["by_design"] for row in rows.values()):
        print("no test ran: see pytest's output above", file=sys.stderr)
        return 2
    return 0 if all(row["failed"] == 0 for row in rows.values()) else 1


def summarize(root: ET.Element, types: list[str]) -> dict[str, dict]:
    """Counts per type from pytest's JUnit XML: passed, failed (by message), by design, skipped."""
    rows = {
        t: {"passed": 0, "failed": 0, "by_design": 0, "skipped": 0, "failures": Counter(), "design_reasons": Counter()}
        for t in types
    }
    for case in root.iter("testcase"):
        name = case.get("name", "")
        kind = next((t for t in types if TYPES[t][0][:-6] in name), None)
        if kind is None:
            continue
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if case.find("skipped") is not None:
            rows[kind]["skipped"] += 1
        elif problem is None:
            rows[kind]["passed"] += 1
        else:
            message = (problem.get("message") or problem.text or "").strip().splitlines()[0][:160]
            text = f"{name} {problem.get('message') or ''}"
            reason = next((why for pattern, why in BY_DESIGN.get(kind, []) if pattern.search(text)), None)
            if reason is not None:
                rows[kind]["by_design"] += 1
                rows[kind]["design_reasons"][reason] += 1
            else:
                rows[kind]["failed"] += 1
                rows[kind]["failures"][message] += 1
    for row in rows.values():
        row["failures"] = dict(row["failures"].most_common())
        row["design_reasons"] = dict(row["design_reasons"].most_common())
    return rows


if __name__ == "__main__":
    sys.exit(main())
