"""benchmarks/run_all.py: runs each entry into its log, extracts the tables and target verdicts, writes the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import mora_missing_modality
from benchmarks import run_all as real_run_all

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def run_all(tmp_path, monkeypatch):
    """run_all with three fake entries: one module, ``python -m fake_bench EXIT`` from ``tmp_path``."""
    module = real_run_all
    monkeypatch.setattr(module, "ROOT", tmp_path)  # the entries run from here, as the real ones from the checkout
    monkeypatch.setattr(module, "LOGS", tmp_path / "logs")
    monkeypatch.setattr(module, "QUICK", False)
    monkeypatch.setattr(module, "TIMEOUT", 120)  # a hung entry is stopped: its exit status fails the test
    script = tmp_path / "fake_bench.py"
    script.write_text(
        "import sys\n"
        "print('progress 10%\\rprogress 100%')\n"
        "print('### Accuracy')\n"
        "print('| method | acc |')\n"
        "print('|---|---:|')\n"
        "print('| ours | 51.0 |')\n"
        "print('target: ours - theirs = +2.0 points (>= +1.0): met')\n"
        "print('target: step time 1.3x (<= 1.15x): NOT met')\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    entries = (
        module.Entry("good", "A good benchmark", ("fake_bench", "0"), 1, "What it compares.", "figures/good.png"),
        module.Entry("broken", "A failing benchmark", ("fake_bench", "3"), 1, "Fails on purpose."),
        module.Entry("missing", "Never run", ("fake_bench", "0"), 1, "Not selected."),
    )
    monkeypatch.setattr(module, "ENTRIES", entries)
    return module


def test_extract_finds_tables_with_captions_targets_and_the_footer(run_all):
    text = "noise\n### Title\n\n| a | b |\n|---|---|\n| 1 | 2 |\nCHECK PASS: speedup: 3.1\ntarget: x (>= 1): NOT met\n"
    text += "[run_all] exit 0, 12 s wall\n"
    blocks, targets, footer = run_all.extract(text)
    assert blocks == ["### Title\n\n| a | b |\n|---|---|\n| 1 | 2 |"]
    assert targets == ["CHECK PASS: speedup: 3.1", "target: x (>= 1): NOT met"]
    assert footer == "exit 0, 12 s wall"


@pytest.mark.slow  # runs the fake entries in subprocesses (a few seconds), each stopped after TIMEOUT
def test_main_runs_the_selected_entries_keeps_logs_and_writes_the_report(run_all, tmp_path, capsys):
    report = tmp_path / "benchmarks.md"
    code = run_all.main(["--only", "good", "broken", "--out", str(report)])
    assert code == 1, "a failing entry makes the whole run fail"
    assert "failed: broken" in capsys.readouterr().out
    assert (run_all.LOGS / "good.log").is_file() and not (run_all.LOGS / "good.log.tmp").exists()
    text = report.read_text()
    assert "## A good benchmark" in text and "| ours | 51.0 |" in text
    assert "![A good benchmark](figures/good.png)" in text and text.count("![") == 1  # only the entry with a figure
    assert "- target: ours - theirs = +2.0 points (>= +1.0): met" in text
    assert "| good | target: step time 1.3x (<= 1.15x): NOT met |" in text  # the summary table
    assert "Run: exit 3" in text  # the failing entry's exit status is in its section
    assert "s wall, code unknown." in text  # the code it ran (no git checkout here)
    assert "python -m fake_bench 0" in text  # the command as it ran
    missing = text.split("## Never run", 1)[1]
    assert "Not run yet." in missing
    # --reuse keeps the existing logs; --report-only rebuilds the report without running anything
    before = (run_all.LOGS / "good.log").stat().st_mtime_ns
    assert run_all.main(["--only", "good", "--reuse", "--out", str(report)]) == 0
    assert (run_all.LOGS / "good.log").stat().st_mtime_ns == before
    assert run_all.main(["--report-only", "--out", str(report)]) == 0


@pytest.mark.slow  # runs a fake entry in a subprocess, stopped after TIMEOUT
def test_an_entry_not_re_run_keeps_its_earlier_section_and_verdicts(run_all, tmp_path):
    report = tmp_path / "benchmarks.md"
    report.write_text(
        "# Benchmarks\n\n## Targets at a glance\n\n| benchmark | verdict |\n|---|---|\n"
        "| missing | target: old thing (>= 1): met |\n| gone | target: retired: met |\n\n"
        "## Never run\n\nAn earlier run's text.\n\n| x | y |\n|---|---|\n| 1 | 2 |\n\n## Retired entry\n\nold\n"
    )
    assert run_all.main(["--only", "good", "--out", str(report)]) == 0
    text = report.read_text()
    kept = text.split("## Never run", 1)[1]
    assert "_Kept from the previous report" in kept and "An earlier run's text." in kept and "| 1 | 2 |" in kept
    assert "| missing (kept) | target: old thing (>= 1): met |" in text
    assert "| good | target: ours - theirs = +2.0 points (>= +1.0): met |" in text  # the re-run's own verdicts
    assert "Retired entry" not in text and "| gone" not in text  # sections of no current entry are dropped
    # a second rebuild keeps it once, not twice
    assert run_all.main(["--report-only", "--out", str(report)]) == 0
    again = report.read_text()
    assert again.count("_Kept from the previous report") == 1 and again.count("| missing (kept) |") == 1


def test_mora_benchmark_prints_its_targets_verdicts():
    """Met only when the paired (same seed) 95 % interval against the best other method clears 0."""
    module = mora_missing_modality
    accs = {
        ("both", "mora"): (0.80, 0.70),  # +5 points on average, but the seeds disagree: not met
        ("both", "lora"): (0.70, 0.70),
        ("both", "prompts"): (0.60, 0.60),
        ("text", "mora"): (0.80, 0.82),  # +20 and +22 over the best other method (lora): met
        ("text", "lora"): (0.60, 0.60),
        ("text", "lora_matched"): (0.50, 0.55),
    }
    rows = [
        {"rate": 0.7, "kind": kind, "method": method, "seed": seed, "acc": acc}
        for (kind, method), values in accs.items()
        for seed, acc in enumerate(values)
    ]
    rows.append({"rate": 0.0, "kind": "both", "method": "mora", "seed": 0, "acc": 0.10})
    # half widths t(1) x sd / sqrt(2) = 12.706 x |d1 - d2| / 2: 63.5, 12.7 and 19.1 points
    lines = module.verdicts(rows, {"mora": 9.0, "prompts": 10.0})
    assert lines[0] == (
        "target: MoRA best at missing rate 0.7 both: MoRA vs the best other method (lora) 75.0 ± 7.1 vs 70.0 ± 0.0: "
        "+5.0 points, 95 % CI [-58.5, +68.5] over 2 seeds (lower end > 0): NOT met"
    )
    assert lines[1] == (
        "target: MoRA best at missing rate 0.7 text: MoRA vs the best other method (lora) 81.0 ± 1.4 vs 60.0 ± 0.0: "
        "+21.0 points, 95 % CI [+8.3, +33.7] over 2 seeds (lower end > 0): met"
    )
    assert lines[2] == (
        "equal parameters, missing rate 0.7 text: MoRA vs LoRA at MoRA's parameter count (lora_matched) "
        "81.0 ± 1.4 vs 52.5 ± 3.5: +28.5 points, 95 % CI [+9.4, +47.6] over 2 seeds"
    )
    assert lines[3:] == ["target: MoRA inference time / prompt baseline = 0.90x (<= 1.00x): met"]


def test_an_earlier_section_is_found_by_its_command_in_either_form(run_all):
    entry = run_all.Entry("x", "New title", ("benchmarks.x", "--a"), 1, "About.")
    for command in ("python -m benchmarks.x --b", "python benchmarks/x.py --b"):  # reports before the package
        sections = {"Old title": ["", "```bash", command, "```", "| t |"]}
        assert run_all._earlier_section(entry, sections) == "Old title", command
    assert run_all._earlier_section(entry, {"Old": ["python -m benchmarks.xy --b"]}) is None


def test_quick_mode_runs_each_scripts_smoke_run_and_keeps_docs(monkeypatch, tmp_path):
    module = real_run_all
    entries = {e.name: e for e in module.ENTRIES}
    monkeypatch.setattr(module, "QUICK", True)
    assert module.arguments(entries["riemannion"]) == ("benchmarks.riemannion", "--quick")
    assert module.command(entries["riemannion"])[1:] == ["-m", "benchmarks.riemannion", "--quick"]
    assert module.arguments(entries["kernels"]) == entries["kernels"].args  # no --quick there: its own small run
    monkeypatch.setattr(module, "ENTRIES", ())
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "LOGS", module.LOGS)  # main(--quick) moves it: restored after the test
    monkeypatch.setattr(module, "QUICK", False)
    assert module.main(["--quick"]) == 0  # nothing selected: only the report, and not into docs/
    assert (tmp_path / "runs" / "benchmarks-quick" / "report.md").is_file()


def test_every_entry_runs_a_benchmark_module_whose_quick_flag_is_right():
    """Each entry names a module of benchmarks/, and ``quick`` says whether that script has ``--quick``."""
    for entry in real_run_all.ENTRIES:
        module, *_ = entry.args
        assert module.startswith("benchmarks."), entry.name
        path = ROOT / (module.replace(".", "/") + ".py")
        assert path.is_file(), entry.name
        assert ("quick=" in path.read_text() or "--quick" in path.read_text()) == entry.quick, entry.name


def _git(root: Path, *args: str) -> str:
    import subprocess

    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_each_run_records_its_commit_and_stale_names_the_sections_whose_code_changed_since(
    run_all, tmp_path, monkeypatch
):
    """A section is current while nothing under its entry's code paths (its package paths, its script and the
    benchmark modules it imports) changed since the commit its run recorded; ``--stale`` lists the others with the
    files that changed."""
    (tmp_path / "peft_ext").mkdir()
    (tmp_path / "peft_ext" / "core.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("readme\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    good, broken, _ = run_all.ENTRIES
    missing = run_all.Entry("missing", "Never run", ("fake_bench", "9"), 1, "Its own command, never run.")
    monkeypatch.setattr(run_all, "ENTRIES", (good, broken, missing))
    first = _git(tmp_path, "rev-parse", "--short=7", "HEAD")
    assert run_all.provenance(good).startswith(f"code {first} (") and "uncommitted" not in run_all.provenance(good)
    (tmp_path / "peft_ext" / "core.py").write_text("x = 2\n")
    assert run_all.provenance(good).endswith(" + uncommitted changes")  # measured with code no commit holds
    _git(tmp_path, "commit", "-q", "-am", "second")
    report = (
        "# Benchmarks\n\n"
        "## A good benchmark\n\n```bash\npython -m fake_bench 0\n```\n\n"
        f"Run: exit 0, 120 s wall, code {first} (2026-12-03).\n\n"
        "## A failing benchmark\n\n```bash\npython -m fake_bench 3\n```\n\nRun: exit 3, 60 s wall.\n"
    )
    run = run_all.measured(good, run_all.earlier_report(report)[0])
    assert run == {"seconds": 120, "commit": first, "dirty": False, "kept": False}
    lines = run_all.listing(report, stale_only=True)
    assert lines[0].startswith("good") and "stale" in lines[0]
    assert f"1 file(s) changed since {first}: peft_ext/core.py" in lines[0]
    assert "run before reports recorded their commit" in lines[1]  # no commit: cannot be shown current
    assert lines[2].startswith("missing") and "not run" in lines[2]
    assert lines[-1] == "3 of 3 section(s) to re-run"
    # a run at the current commit is current; a change outside its code paths leaves it current
    second = _git(tmp_path, "rev-parse", "--short=7", "HEAD")
    (tmp_path / "README.md").write_text("changed\n")
    _git(tmp_path, "commit", "-q", "-am", "docs")
    current = report.replace(f"code {first}", f"code {second}")
    listed = run_all.listing(current)
    assert listed[0].startswith("good") and "last 2 min" in listed[0] and f"current  code {second}" in listed[0]
    assert listed[1].strip() == "python -m fake_bench 0"
    assert "good" not in "\n".join(run_all.listing(current, stale_only=True))
    assert listed[-1].startswith("total") and "~   3 min" in listed[-1]  # the entries' expected minutes
    # a commit this clone does not have cannot vouch for the section either
    unknown = report.replace(f"code {first}", "code abcdef1")
    assert "commit abcdef1 is not in this clone" in run_all.listing(unknown, stale_only=True)[0]


def test_stale_lists_the_results_files_whose_code_changed_since_the_commit_they_record(run_all, tmp_path):
    """A heads-protocol results file records its commit, code paths and settings (``provenance``); ``--stale`` names
    it once one of those paths changes, and a file that records no commit is never shown current."""
    (tmp_path / "peft_ext" / "continual").mkdir(parents=True)
    (tmp_path / "peft_ext" / "continual" / "engine.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("readme\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    first = _git(tmp_path, "rev-parse", "HEAD")
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    recorded = {"commit": first, "dirty": False, "code": ["peft_ext/continual"], "settings": {"command": "x"}}
    (results / "heads_new.json").write_text(json.dumps({"kind": "continual_heads", "provenance": recorded}))
    (results / "heads_old.json").write_text(json.dumps({"kind": "continual_heads"}))
    (results / "other.json").write_text(json.dumps({"kind": "something_else"}))
    (tmp_path / "README.md").write_text("changed\n")  # outside the recorded code: still current
    _git(tmp_path, "commit", "-q", "-am", "docs")
    states = {name.split("/")[-1]: (state, why) for name, state, why in run_all.result_files_currency()}
    assert states["heads_new.json"] == ("current", f"code {first[:7]}")
    assert states["heads_old.json"][0] == "stale" and "records no commit" in states["heads_old.json"][1]
    assert "other.json" not in states
    (tmp_path / "peft_ext" / "continual" / "engine.py").write_text("x = 2\n")
    _git(tmp_path, "commit", "-q", "-am", "engine")
    lines = run_all.listing(None, stale_only=True)
    assert any(
        "heads_new.json" in line and "1 file(s) changed since" in line and "engine.py" in line for line in lines
    )
    assert lines[-1] == "2 of 2 results file(s) older than their code"


def test_the_heads_protocol_records_what_made_its_results_file():
    from benchmarks._lib import machine

    made = machine.provenance(["peft_ext/continual"], command="python -m benchmarks.continual_heads", config="x")
    assert made["commit"] and len(made["commit"]) == 40 and isinstance(made["dirty"], bool)
    assert made["code"] == ["peft_ext/continual"] and made["settings"]["config"] == "x"
    source = (ROOT / "benchmarks" / "continual_heads.py").read_text()
    assert 'summary["provenance"] = machine.provenance(' in source  # what main writes into the results file


def test_a_section_follows_the_benchmark_modules_its_script_imports_and_says_when_it_is_carried_current(
    run_all, tmp_path, monkeypatch
):
    """The benchmark modules a script imports, transitively (relative imports and packages too), are its code; a
    module it does not import is not. A section carried from the previous report (no log here) says whether its code
    is unchanged since its run: carried when it is (its verdicts as they were), kept when not (verdicts marked)."""
    lib = tmp_path / "benchmarks" / "_lib"
    lib.mkdir(parents=True)
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (lib / "__init__.py").write_text("")
    (lib / "shared.py").write_text("from .deep import helper\n")
    (lib / "deep.py").write_text("import json\n\n\ndef helper():\n    return json\n")
    (lib / "other.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "bench.py").write_text("import torch\nfrom benchmarks._lib import shared\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    first = _git(tmp_path, "rev-parse", "--short=7", "HEAD")
    entry = run_all.Entry("bench", "A bench", ("benchmarks.bench",), 1, "About.", code=())
    monkeypatch.setattr(run_all, "ENTRIES", (entry,))
    assert sorted(run_all.code_paths(entry)) == [
        "benchmarks/__init__.py",
        "benchmarks/_lib/__init__.py",
        "benchmarks/_lib/deep.py",
        "benchmarks/_lib/shared.py",
        "benchmarks/bench.py",
    ]
    report = tmp_path / "benchmarks.md"
    report.write_text(
        "# Benchmarks\n\n## Targets at a glance\n\n| benchmark | verdict |\n|---|---|\n"
        "| bench | target: speed (>= 1): met |\n\n## A bench\n\n```bash\npython -m benchmarks.bench\n```\n\n"
        f"Run: exit 0, 60 s wall, code {first} (2026-12-04).\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    )
    (lib / "other.py").write_text("x = 2\n")  # not imported by the script: the section stays current
    _git(tmp_path, "commit", "-q", "-am", "other")
    assert run_all.main(["--report-only", "--out", str(report)]) == 0
    text = report.read_text()
    assert run_all.CARRIED_NOTE in text and run_all.KEPT not in text and "| 1 | 2 |" in text
    assert "| bench | target: speed (>= 1): met |" in text
    assert run_all.listing(text, stale_only=True)[-1] == "every section is current"
    (lib / "deep.py").write_text("def helper():\n    return 2\n")  # imported through shared.py: now stale
    _git(tmp_path, "commit", "-q", "-am", "deep")
    assert run_all.main(["--report-only", "--out", str(report)]) == 0
    text = report.read_text()
    assert text.count(run_all.KEPT) == 1 and run_all.CARRIED not in text
    assert "| bench (kept) | target: speed (>= 1): met |" in text
    assert "benchmarks/_lib/deep.py" in run_all.listing(text, stale_only=True)[0]
