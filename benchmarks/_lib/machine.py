"""The machine a benchmark measured on: one record for its JSON, and the lines its report prints."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

__all__ = ["cpu_name", "git", "load_average", "provenance", "record", "summary", "torch_platform"]

#: The repository's root (the checkout the benchmarks run from).
ROOT = Path(__file__).resolve().parents[2]


def git(*args: str, cwd: str | os.PathLike[str] | None = None) -> str | None:
    """``git ARGS`` in ``cwd`` (default: this checkout), its output stripped; ``None`` outside a git checkout or when
    it fails."""
    import subprocess

    try:
        done = subprocess.run(["git", *args], cwd=cwd or ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def load_average() -> float:
    """The load average over the last minute (``nan`` where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _gpu() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


def torch_platform() -> str:
    """``torch <version>, <machine>``: the short form the scripts' last lines print."""
    import torch

    return f"torch {torch.__version__}, {platform.machine()}"


def wall_line(start: float, threads: int, *extra: str) -> str:
    """The scripts' closing line: wall time since ``start`` (``time.perf_counter()``), threads, torch and machine,
    then ``extra`` parts, comma-separated."""
    import time

    minutes = (time.perf_counter() - start) / 60
    return "\n" + ", ".join([f"wall time {minutes:.1f} min", f"{threads} thread(s)", torch_platform(), *extra])


def summary() -> str:
    """One line: cores, CPU, GPU, Python, torch and the system (the report's machine line)."""
    import torch

    return (
        f"{os.cpu_count()} CPU cores ({cpu_name()}), {_gpu()}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, {platform.system()} {platform.machine()}"
    )


def record(**extra: Any) -> dict[str, Any]:
    """The machine as a JSON-able record (``extra`` added, e.g. the command), for a benchmark's results file."""
    import torch

    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "gpu": _gpu(),
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        "commit": git("rev-parse", "HEAD"),
        **extra,
    }


def provenance(code: list[str], **settings: Any) -> dict[str, Any]:
    """What made a results file, for ``python -m benchmarks.run_all --stale``: the commit of this checkout, whether
    ``code`` (paths) had uncommitted changes, the paths themselves and the run's ``settings`` (its command, config).

    Args:
        code: The files and folders whose change makes the results older than their code.
        settings: The settings to record beside them (JSON-able).
    """
    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--", *code)) if commit else None
    return {"commit": commit, "dirty": dirty, "code": list(code), "settings": settings}
