"""The ``peft-ext`` command line, kept apart from the ``peft_ext`` package so that ``--help`` answers at once.

Importing ``peft_ext`` registers its adapter types with PEFT, which imports torch, transformers and bitsandbytes
(seconds to tens of seconds on a small machine). This module uses the standard library only: it builds the parser,
answers ``--help`` and ``peft-ext configs`` itself, and imports ``peft_ext.cli`` only once a command needs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

DESCRIPTION = """\
Run and check peft-ext jobs from YAML configs.

A config's top-level "job" key picks the job: "continual" (the default) or "missing_modality"
(the MoRA dual-encoder job, e.g. the shipped config mora_emoji). CONFIG is a YAML file path or the name
of a config shipped with peft-ext:

  peft-ext configs                             list the shipped configs
  peft-ext run quickstart --set train.epochs=1 run one, with an override
  peft-ext configs --copy quickstart my.yaml   write a copy to edit"""

CONFIG_HELP = "YAML config file, or the name of a shipped config (see: peft-ext configs), e.g. quickstart"


def configs_dir() -> Path:
    """The directory of the example configs shipped with peft-ext, found without importing the package.

    Installed from a wheel they live in ``peft_ext/configs``; in a source checkout (or an editable install) in the
    repository's ``configs/``, next to ``pyproject.toml``.
    """
    spec = importlib.util.find_spec("peft_ext")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the peft_ext package is not importable, so its shipped configs cannot be found")
    package = Path(next(iter(spec.submodule_search_locations)))
    if (package / "configs").is_dir():
        return package / "configs"
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "configs").is_dir():
        return checkout / "configs"
    raise FileNotFoundError(f"no shipped configs next to {package} (expected {package / 'configs'})")


def shipped_configs() -> dict[str, Path]:
    """The shipped example configs by name (file name without ``.yaml``), sorted by name."""
    return {path.stem: path for path in sorted(configs_dir().glob("*.yaml"))}


def resolve_config(value: str) -> str:
    """``value`` unchanged when it names an existing path; else the shipped config it names (``quickstart`` or
    ``quickstart.yaml``); else ``value`` unchanged, so the job's loader reports the missing file.

    Args:
        value: the CONFIG argument as typed.
    """
    if Path(value).exists() or Path(value).name != value:
        return value
    name = value.removesuffix(".yaml").removesuffix(".yml")
    try:
        shipped = shipped_configs()
    except FileNotFoundError:
        return value
    return str(shipped[name]) if name in shipped else value


def _summary(path: Path, width: int = 96) -> str:
    """The first line of a config's leading comment, cut to ``width`` characters."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip()
            return text if len(text) <= width else text[: width - 3].rstrip() + "..."
        if line.strip():
            break
    return ""


def _cmd_configs(args: argparse.Namespace) -> int:
    shipped = shipped_configs()
    if args.copy is None:
        print(f"shipped configs ({configs_dir()}); run one with: peft-ext run NAME")
        for name, path in shipped.items():
            print(f"  {name:<20} {_summary(path)}")
        return 0
    name = args.copy[0].removesuffix(".yaml")
    if name not in shipped:
        print(f"peft-ext: no shipped config {name!r}; shipped: {', '.join(shipped)}", file=sys.stderr)
        return 2
    dest = Path(args.copy[1] if len(args.copy) > 1 else f"{name}.yaml")
    if dest.is_dir():
        dest = dest / f"{name}.yaml"
    if dest.exists():
        print(f"peft-ext: {dest} already exists; not overwriting it (give another destination)", file=sys.stderr)
        return 2
    data = _data_files(shipped[name])
    clash = [rel for rel, _ in data if (dest.parent / rel).exists()]
    if clash:
        print(
            f"peft-ext: {dest.parent / clash[0]} already exists (a data file {name} names); not overwriting it "
            "(give another destination folder)",
            file=sys.stderr,
        )
        return 2
    shutil.copyfile(shipped[name], dest)
    for rel, source in data:  # relative data paths are read from the config's folder: the files go beside it
        (dest.parent / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest.parent / rel)
    print(f"wrote {dest}" + (f" and the {len(data)} data file(s) it names" if data else ""))
    print(f"run it with: peft-ext run {dest}")
    return 0


def _data_files(config: Path) -> list[tuple[Path, Path]]:
    """``(relative path, shipped file)`` of every local data file a shipped config names under ``data`` (``train``,
    ``test``, ``validation``, ``tasks``: a path or a list of them, relative to the config's folder)."""
    import yaml

    section = (yaml.safe_load(config.read_text()) or {}).get("data") or {}
    found = []
    for key in ("train", "test", "validation", "tasks"):
        values = section.get(key)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, str) and not Path(value).is_absolute() and (config.parent / value).is_file():
                found.append((Path(value), config.parent / value))
    return found


def build_parser() -> argparse.ArgumentParser:
    """The ``peft-ext`` argument parser; building it imports nothing beyond the standard library."""
    parser = argparse.ArgumentParser(
        prog="peft-ext", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("run", "run a job (continual learning, or job: missing_modality)"),
        ("check", "validate a config and exit"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help=CONFIG_HELP)
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value (dotted path; under methods use the method name or index)",
        )
        p.add_argument(
            "--only",
            metavar="METHODS",
            help="run only these of the config's methods, comma-separated labels or names (each keeps its settings), "
            "e.g. --only seq_lora,splitlora",
        )
        p.add_argument(
            "--tune",
            action="store_true",
            help="choose each method's learning rate on the validation split first (the config's tune section)",
        )
        if name == "run":
            p.add_argument("--no-progress", action="store_true", help="no progress bars")
            p.add_argument(
                "--resume",
                action="store_true",
                help="continue an interrupted run of the same config from its last finished task",
            )
            p.add_argument(
                "--overwrite",
                action="store_true",
                help="start over in an output dir that holds an earlier run (its files are moved aside, not deleted)",
            )
        p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub.add_parser("list", help="list registered adapter types, optimizers and continual methods")
    p = sub.add_parser("verify", help="check a saved adapter checkpoint directory and say how to load it")
    p.add_argument("checkpoint", help="the directory save_pretrained wrote")
    p.add_argument(
        "--base",
        metavar="MODEL",
        help="base model folder or cached hub id to check tensor shapes against (default: the one the adapter "
        "config names, when it is available here)",
    )
    p = sub.add_parser(
        "table",
        help="print the table a continual job's results.json publishes, or rewrite the generated tables of markdown "
        "files from their results files",
    )
    p.add_argument("results", nargs="?", help="a continual job's results.json to print as a table")
    p.add_argument(
        "--into",
        nargs="+",
        metavar="MARKDOWN",
        help="rewrite every generated table in these files (each names its results file) instead",
    )
    p = sub.add_parser(
        "predict",
        help="classify new texts with a method a continual job trained (its output.dir/adapters/<label>)",
    )
    p.add_argument(
        "source",
        metavar="CONFIG_OR_FOLDER",
        help="a method's folder (output.dir/adapters/<label>), a job's output folder, or the job's config (path or "
        "shipped name)",
    )
    p.add_argument(
        "file",
        help="the texts: a .txt file (one per line), or a .csv / .jsonl file with a text column (--column)",
    )
    p.add_argument(
        "--method",
        metavar="LABEL",
        help="which saved method, with a job folder or config (default: the best final accuracy of the continual "
        "methods saved, the upper bound joint left out)",
    )
    p.add_argument("--column", default="text", help="the text column of a .csv / .jsonl file (default: text)")
    p = sub.add_parser("configs", help="list the shipped example configs, or copy one out to edit")
    p.add_argument(
        "--copy",
        nargs="+",
        metavar=("NAME", "DEST"),
        help="write shipped config NAME to DEST (default ./NAME.yaml); never overwrites a file",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``peft-ext``: parse ``argv`` (default ``sys.argv[1:]``) and run the command; returns the exit
    status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "configs":
        if args.copy is not None and len(args.copy) > 2:
            parser.error("configs --copy takes NAME and at most one DEST")
        return _cmd_configs(args)
    if args.command == "table" and (args.results is None) == (args.into is None):
        parser.error("table takes a results.json to print, or --into MARKDOWN... to rewrite (one of the two)")
    if hasattr(args, "config"):
        args.config = resolve_config(args.config)
    if args.command == "predict":
        args.source = resolve_config(args.source)
    # Only now the heavy part: peft_ext (torch, peft, transformers) and the commands that need it.
    from peft_ext.cli import run_command

    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
