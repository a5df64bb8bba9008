"""Run every benchmark at a size that fits a 2-core CPU machine and write the report ``docs/benchmarks.md``.

Each entry of ``benchmarks/sections.py`` is one benchmark module (``python -m benchmarks.NAME``) with the arguments of
its small run. The script's stdout is kept in ``runs/benchmarks/<name>.log`` (written atomically when the run ends);
the report quotes every markdown table and every "target ... met / NOT met" line the script printed, with the exact
command, its wall time, the commit of the code it ran and the machine. Because the logs are kept, an interrupted
report resumes where it stopped (``--reuse``), and one entry can be re-run alone (``--only``); ``--stale`` names the
sections whose code (the entry's package paths, its script or a benchmark module it imports) changed since they were
run.

Usage, from the repository root::

    python -m benchmarks.run_all                 # everything: the full protocol (see --list: about 7 hours)
    python -m benchmarks.run_all --quick         # every benchmark's --quick smoke run (about 10 minutes)
    python -m benchmarks.run_all --list          # the entries, their commands, minutes and the code each measured
    python -m benchmarks.run_all --stale         # the sections whose code changed since they were run
    python -m benchmarks.run_all --reuse         # keep the logs already there, run the missing entries
    python -m benchmarks.run_all --only kernels pclr_overhead --reuse
    python -m benchmarks.run_all --report-only   # rebuild docs/benchmarks.md from the logs

``make benchmarks`` runs the first command.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import figures
from benchmarks._lib import machine
from benchmarks._lib.cli import benchmark_parser
from benchmarks.sections import ENTRIES, RESULT_FILES, Entry, imported_benchmark_files, result_code

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "runs" / "benchmarks"
REPORT = ROOT / "docs" / "benchmarks.md"

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
        out.write(f"\n[run_all] exit {code}, {seconds:.0f} s wall, {provenance(entry)}\n")
    os.replace(tmp, log)
    return code, seconds


MEASURED = "code "  # the footer's provenance: "code <commit> (<date>)", " + uncommitted changes" when there were
# A section carried from the previous report (its log is not here): kept when its code changed since, carried when not
KEPT = "_Kept from the previous report"
KEPT_NOTE = f"{KEPT}: not re-run since, so its sizes and protocol may predate the script._"
CARRIED = "_Carried from the previous report"
CARRIED_NOTE = f"{CARRIED}: its code is unchanged since the run named below (`run_all --stale`)._"
FOOTER = re.compile(r"exit (-?\d+), (\d+) s wall(?:, code ([0-9a-f]+)( \+ uncommitted changes)?)?")


def code_paths(entry: Entry) -> tuple[str, ...]:
    """The files whose change makes ``entry``'s section older than its code: its package paths, its script and every
    benchmark module the script imports (``benchmarks/_lib``'s shared pieces among them)."""
    return (*entry.code, *imported_benchmark_files(entry.args[0], ROOT))


def provenance(entry: Entry) -> str:
    """``code <commit> (<UTC date>)`` of the checkout ``entry`` ran from, ``+ uncommitted changes`` when its code
    paths had any; ``code unknown`` outside a git checkout."""
    commit = machine.git("rev-parse", "--short=7", "HEAD", cwd=ROOT)
    if not commit:
        return f"{MEASURED}unknown"
    dirty = machine.git("status", "--porcelain", "--", *code_paths(entry), cwd=ROOT)
    date = f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d}"
    return f"{MEASURED}{commit} ({date})" + (" + uncommitted changes" if dirty else "")


def changed_since(entry: Entry, commit: str) -> list[str] | None:
    """The files of ``entry``'s code paths that differ between ``commit`` and the working tree (``None``: unknown,
    e.g. the commit is not in this clone)."""
    if machine.git("cat-file", "-e", f"{commit}^{{commit}}", cwd=ROOT) is None:
        return None
    out = machine.git("diff", "--name-only", commit, "--", *code_paths(entry), cwd=ROOT)
    return None if out is None else [line for line in out.splitlines() if line]


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
            targets.append(line.strip().removeprefix("- "))  # the report adds its own list marker
        if line.startswith("[run_all] exit"):
            footer = line.removeprefix("[run_all] ").strip()
        i += 1
    return blocks, targets, footer


def earlier_report(text: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """A report's sections by title (their lines after the heading) and its targets-at-a-glance verdicts by entry name,
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
                glance.setdefault(cells[0].removesuffix(" (kept)"), []).append(cells[1])
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


def measured(entry: Entry, sections: dict[str, list[str]]) -> dict[str, object] | None:
    """What a report's ``sections`` (:func:`earlier_report`) say of ``entry``'s run: its wall ``seconds``, the
    ``commit`` of the code it ran (``None`` for runs before commits were recorded), ``dirty`` (uncommitted changes of
    its code) and ``kept`` (carried over from an earlier report); ``None`` when the report has no run of it."""
    # its title, else its exact command (not its script alone: several entries run one script)
    title = next((t for t, lines in sections.items() if t == entry.title or shown(entry) in lines), None)
    if title is None:
        return None
    return _run_of(sections[title])


def _run_of(lines: list[str]) -> dict[str, object] | None:
    """:func:`measured` of one section's lines."""
    run = next((line for line in lines if line.startswith("Run: ")), None)
    found = FOOTER.search(run) if run else None
    if found is None:
        return None
    return {
        "seconds": int(found.group(2)),
        "commit": found.group(3),
        "dirty": bool(found.group(4)),
        "kept": any(line.startswith((KEPT, CARRIED)) for line in lines),
    }


def currency(entry: Entry, run: dict[str, object] | None) -> tuple[str, str]:
    """Whether ``entry``'s last ``run`` (:func:`measured`) is ``current``, ``stale`` or ``not run``, and why."""
    if run is None:
        return "not run", ""
    if run["commit"] is None:
        return "stale", "run before reports recorded their commit"
    changed = changed_since(entry, str(run["commit"]))
    if changed is None:
        return "stale", f"commit {run['commit']} is not in this clone"
    if changed or run["dirty"]:
        shown_files = ", ".join(changed[:4]) + (", ..." if len(changed) > 4 else "")
        why = f"{len(changed)} file(s) changed since {run['commit']}" + (f": {shown_files}" if changed else "")
        return "stale", why + (" (it ran with uncommitted changes)" if run["dirty"] else "")
    return "current", f"code {run['commit']}"


def result_files_currency(folder: Path | None = None) -> list[tuple[str, str, str]]:
    """``(file, state, why)`` of every results file in ``folder`` that a benchmark outside this report writes
    (:data:`~benchmarks.sections.RESULT_FILES`): ``current`` when none of its code changed since the commit it
    records, ``stale`` otherwise (or when it records none)."""
    out = []
    for path in sorted((folder or ROOT / "docs" / "results").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        kind = data.get("kind") if isinstance(data, dict) else None
        if kind not in RESULT_FILES:
            continue
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        recorded = data.get("provenance") or {}
        commit = recorded.get("commit")
        if not commit:
            out.append((name, "stale", "it records no commit (made before results files recorded theirs)"))
            continue
        module, code = result_code(kind, data.get("config"))
        paths = recorded.get("code") or [*code, *imported_benchmark_files(module, ROOT)]
        if machine.git("cat-file", "-e", f"{commit}^{{commit}}", cwd=ROOT) is None:
            out.append((name, "stale", f"commit {commit[:7]} is not in this clone"))
            continue
        changed = (machine.git("diff", "--name-only", commit, "--", *paths, cwd=ROOT) or "").split()
        if changed or recorded.get("dirty"):
            shown_files = ", ".join(changed[:4]) + (", ..." if len(changed) > 4 else "")
            why = f"{len(changed)} file(s) changed since {commit[:7]}" + (f": {shown_files}" if changed else "")
            out.append((name, "stale", why + (" (it ran with uncommitted changes)" if recorded.get("dirty") else "")))
        else:
            out.append((name, "current", f"code {commit[:7]}"))
    return out


def listing(text: str | None, stale_only: bool = False) -> list[str]:
    """``--list`` (every entry: its expected minutes on 2 idle cores, its last run's as the report says, whether that
    run is current, and its command) or ``--stale`` (only the entries whose section is missing or older than their
    code, with the files changed since). A last run that reused cached runs (``--resume``, ``--runs``) took less than
    the whole would."""
    out, stale = [], 0
    sections = earlier_report(text)[0] if text else {}  # parsed once for every entry
    for entry in ENTRIES:
        run = measured(entry, sections)
        state, why = currency(entry, run)
        stale += state != "current"
        if stale_only and state == "current":
            continue
        last = f"last {int(run['seconds']) / 60:.0f} min" if run else "never run"
        out.append(f"{entry.name:<18} ~{entry.minutes:>4.0f} min  {last:<14} {state:<8} {why}".rstrip())
        if not stale_only:
            out.append(f"{'':<18} {shown(entry)}")
    results = result_files_currency()
    for name, state, why in results:
        if not (stale_only and state == "current"):
            out.append(f"{name:<44} {state:<8} {why}")
    if stale_only:
        out.append(f"{stale} of {len(ENTRIES)} section(s) to re-run" if stale else "every section is current")
        old_files = sum(state != "current" for _, state, _ in results)
        if results:
            out.append(f"{old_files} of {len(results)} results file(s) older than their code")
    else:
        total = sum(e.minutes for e in ENTRIES)
        out.append(f"{'total':<18} ~{total:>4.0f} min on 2 idle cores, one entry after another")
    return out


def report(entries: list[Entry], earlier: str | None = None) -> str:
    """The markdown report from the logs of ``entries``. An entry without a log keeps its section (and its verdict
    rows) from ``earlier``, the report being replaced, marked as such; otherwise it is listed as not run."""
    sections, glance = earlier_report(earlier) if earlier else ({}, {})
    out = [
        "# Benchmarks",
        "",
        "Written by `python -m benchmarks.run_all` (`make benchmarks`) from the logs in `runs/benchmarks/`; every "
        "table below is the benchmark script's own output, every target line its own verdict. Sizes are chosen so the "
        "whole report fits a 2-core CPU machine; each method's docs page has the larger runs. Each section's Run "
        "line names the commit of the code it ran; `python -m benchmarks.run_all --stale` lists the sections whose "
        "code changed since (and the heads protocol's results files, which record their commit, code and settings), "
        "`--list` every entry with its minutes.",
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
            lines = [line for line in sections.pop(earlier_title) if not line.startswith((KEPT, CARRIED))]
            current = currency(entry, _run_of(lines))[0] == "current"
            body = "\n".join(lines).strip("\n")
            out += [f"## {entry.title}", "", CARRIED_NOTE if current else KEPT_NOTE, "", body, ""]
            summary += [f"| {entry.name}{'' if current else ' (kept)'} | {v} |" for v in glance.get(entry.name, [])]
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
    parser.add_argument(
        "--list", action="store_true", help="print the entries, their minutes and the code each measured, and exit"
    )
    parser.add_argument(
        "--stale", action="store_true", help="print the sections missing or older than the code they measure, and exit"
    )
    parser.add_argument("--out", type=Path, default=None, help="the report (default docs/benchmarks.md)")
    args = parser.parse_args(argv)
    global QUICK, LOGS
    if args.quick:
        QUICK, LOGS = True, ROOT / "runs" / "benchmarks-quick"
    if args.out is None:
        args.out = LOGS / "report.md" if args.quick else REPORT
    selected = [e for e in ENTRIES if not args.only or e.name in args.only]
    if args.list or args.stale:
        print("\n".join(listing(args.out.read_text() if args.out.is_file() else None, stale_only=args.stale)))
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
        if figures.main([]) != 0:  # the pages' figures follow the report they quote
            failed.append("figures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
