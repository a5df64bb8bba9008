"""Command line: ``peft-ext run CONFIG.yaml [--set key=value ...]``, ``peft-ext check CONFIG``, ``peft-ext list``.

A config's top-level ``job`` key picks the job: ``continual`` (the default) or ``missing_modality``
(:mod:`peft_ext.jobs.multimodal`, e.g. ``configs/mora_emoji.yaml``)."""

from __future__ import annotations

import argparse
import sys


def _cmd_list(args: argparse.Namespace) -> int:
    import peft_ext
    from peft_ext.continual.methods import CONTINUAL_METHODS
    from peft_ext.optim import OPTIMIZERS

    peft_types = peft_ext.registered_peft_types()
    print("adapter types (PEFT peft_type):")
    for name, member in sorted(peft_types.items()):
        print(f"  {name:<14} {member.value}")
    if not peft_types:
        print("  (none registered yet)")
    print("optimizers:")
    for name, cls in sorted(OPTIMIZERS.items()):
        print(f"  {name:<14} {cls.__module__}.{cls.__qualname__}")
    if not OPTIMIZERS:
        print("  (none registered yet)")
    print("continual methods (for configs):")
    for name, cls in sorted(CONTINUAL_METHODS.items()):
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"  {name:<14} {doc}")
    return 0


def _load(args: argparse.Namespace):
    from peft_ext.jobs import load_job_config

    return load_job_config(args.config, args.set)


def _method_names(config) -> list[str]:
    return [m if isinstance(m, str) else m.name for m in config.methods]


def _cmd_check(args: argparse.Namespace) -> int:
    config = _load(args)
    names = _method_names(config)
    print(f"{args.config}: valid ({len(names)} methods: {', '.join(names)})")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from peft_ext.jobs import run_job_config

    run_job_config(_load(args), progress=not args.no_progress)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from peft_ext.checkpoint import loading_hint, verify_checkpoint

    try:
        found = verify_checkpoint(args.checkpoint)
    except ValueError as err:
        print(f"peft-ext: checkpoint error: {err}", file=sys.stderr)
        return 2
    for folder, peft_type in found.items():
        print(f"{folder}: {peft_type} adapter, complete and consistent with its config")
    hint = loading_hint(found.values())
    if hint:
        print(f"to load: {hint}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peft-ext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("run", "run a job (continual learning, or `job: missing_modality`)"),
        ("check", "validate a config and exit"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="YAML run config, e.g. configs/quickstart.yaml")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value (dotted path; in `methods` use the method name or index)",
        )
        if name == "run":
            p.add_argument("--no-progress", action="store_true", help="no progress bars")
    sub.add_parser("list", help="list registered adapter types, optimizers and continual methods")
    verify = sub.add_parser("verify", help="check a saved adapter checkpoint directory and say how to load it")
    verify.add_argument("checkpoint", help="the directory save_pretrained wrote")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from peft_ext.continual.config import ConfigError

    try:
        return {"run": _cmd_run, "check": _cmd_check, "list": _cmd_list, "verify": _cmd_verify}[args.command](args)
    except ConfigError as err:
        print(f"peft-ext: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
