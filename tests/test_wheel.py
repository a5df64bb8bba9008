"""The wheel a user installs: built from this checkout, installed in a fresh virtual environment, run from a folder
outside the checkout. Nothing is downloaded: the fresh environment sees this interpreter's installed dependencies
through a .pth file, and the wheel goes in with --no-deps --no-index."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What the build reads (pyproject.toml names the rest); copied so the build leaves nothing in the checkout.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "peft_ext_cli.py", "peft_ext_autoload.py")
SOURCES += ("peft_ext_autoload.pth", "peft_ext", "configs")
TINY = [
    "--no-progress",
    "--set", "data.n_tasks=2",
    "--set", "data.classes_per_task=2",
    "--set", "data.train_per_class=4",
    "--set", "data.test_per_class=4",
    "--set", "train.epochs=1",
    "--set", "train.batch_size=8",
    "--set", "methods=[{name: seq_lora, lr: 1.0e-3, adapter: {r: 2, target_modules: [query, value]}}]",
    "--set", "output.dir=out",
]  # fmt: skip


def _run(cmd: list, cwd: Path, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, venv, env, user_dir): the wheel built from a copy of the checkout and installed in a fresh venv."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    pip = [sys.executable, "-m", "pip"]
    build = _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", tmp / "dist", src], tmp, env)
    (tmp / "build.log").write_text(build.stdout + build.stderr)  # setuptools' warnings, read by a test below
    (wheel,) = (tmp / "dist").glob("peft_ext-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, env)
    python = venv / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(_run([python, "-c", code], tmp, env).stdout.strip())
    # The dependencies (torch, peft, transformers, the MiniLM package) as installed for this interpreter, after the
    # venv's own site-packages on sys.path; path lines of a .pth do not run that folder's own .pth files, so an
    # editable install of this checkout there stays invisible.
    ours = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (purelib / "_deps_of_this_interpreter.pth").write_text("\n".join(ours) + "\n")
    _run([*pip, "--python", python, "install", "--no-deps", "--no-index", "-q", wheel], tmp, env)
    user = tmp / "user"  # a folder outside the checkout, with no configs/ in it
    user.mkdir()
    return wheel, venv, env, user


def test_wheel_carries_license_configs_and_every_package(installed):
    wheel, venv, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    license_in_wheel = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert license_in_wheel, "no LICENSE in the wheel's dist-info"
    assert zipfile.ZipFile(wheel).read(license_in_wheel[0]).decode() == (ROOT / "LICENSE").read_text()
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    for config in (ROOT / "configs").glob("*.yaml"):
        assert f"peft_ext/configs/{config.name}" in names, config.name
    for data in [*(ROOT / "configs" / "data").rglob("*.csv"), *(ROOT / "configs" / "data").rglob("*.jsonl")]:
        shipped = f"peft_ext/configs/{data.relative_to(ROOT / 'configs').as_posix()}"
        assert shipped in names, data.name  # the examples' data travels with their configs
    # pyproject.toml lists the packages (configs/ is mapped in): every package of the checkout must be listed.
    for init in (ROOT / "peft_ext").rglob("__init__.py"):
        assert init.relative_to(ROOT).as_posix() in names, f"{init.parent} is missing from pyproject's packages"
    assert "peft_ext_cli.py" in names
    # every folder that ships is a declared package: setuptools warns of (and will refuse) importable data folders
    # absent from `packages` (configs/data and its subfolders were)
    log = (wheel.parent.parent / "build.log").read_text()
    assert "wheel" in log and "absent from the `packages` configuration" not in log, log[-3000:]
    for shipped in (ROOT / "peft_ext" / "data" / "files").iterdir():  # every data file with its license
        assert f"peft_ext/data/files/{shipped.name}" in names, shipped.name


@pytest.mark.slow  # three interpreters that import peft: about 30 s
def test_installed_wheel_registers_the_types_when_peft_is_imported(installed):
    """The wheel's peft_ext_autoload.pth: PEFT alone knows peft-ext's types once peft is imported, peft_ext is not
    imported by an interpreter that never imports peft, and PEFT_EXT_NO_AUTOLOAD turns it off."""
    wheel, venv, env, user = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "peft_ext_autoload.pth" in names and "peft_ext_autoload.py" in names  # at the root of site-packages
    python = venv / "bin" / "python"
    probe = "import sys; print(*(m in sys.modules for m in ('peft', 'peft_ext', 'peft_ext_autoload')))"
    assert _run([python, "-c", probe], user, env).stdout.split() == ["False", "False", "True"]
    check = "import sys; from peft.utils import PeftType as T; "
    check += "print('SPLITLORA' in T.__members__, 'peft_ext' in sys.modules)"
    assert _run([python, "-c", check], user, env).stdout.split()[-2:] == ["True", "True"]
    off = {**env, "PEFT_EXT_NO_AUTOLOAD": "1"}
    assert _run([python, "-c", check], user, off).stdout.split()[-2:] == ["False", "False"]


@pytest.mark.slow  # about 25-55 s on 2 cores: the run imports torch, peft and transformers and loads MiniLM
def test_installed_cli_runs_quickstart_by_name_outside_the_checkout(installed):
    _, venv, env, user = installed
    bin_dir = venv / "bin"
    code = "import importlib.util as u; print(u.find_spec('peft_ext').origin, u.find_spec('peft_ext_cli').origin)"
    where = _run([bin_dir / "python", "-c", code], user, env).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), f"not imported from the wheel: {where}"

    help_text = _run([bin_dir / "peft-ext", "--help"], user, env).stdout
    assert "peft-ext configs" in help_text and "configs/" not in help_text and "``" not in help_text

    listing = _run([bin_dir / "peft-ext", "configs"], user, env).stdout
    assert "quickstart" in listing and "mora_emoji" in listing
    assert str(venv) in listing, "the listed configs must be the installed ones"

    _run([bin_dir / "peft-ext", "configs", "--copy", "quickstart"], user, env)
    assert (user / "quickstart.yaml").read_text() == (ROOT / "configs" / "quickstart.yaml").read_text()
    (user / "quickstart.yaml").unlink()  # so that `run quickstart` below takes the shipped config by name

    proc = _run([bin_dir / "peft-ext", "run", "quickstart", *TINY], user, env)
    results = json.loads((user / "out" / "results.json").read_text())
    assert [r["method"] for r in results["results"]] == ["seq_lora"]
    assert len(results["results"][0]["accuracy_matrix"]) == 2
    assert "| seq_lora |" in proc.stdout
    assert "LOAD REPORT" not in proc.stdout + proc.stderr and "\x1b[" not in proc.stderr
