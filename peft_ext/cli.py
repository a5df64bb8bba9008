"""Command line: ``peft-ext run CONFIG [--set key=value ...]``, ``peft-ext check CONFIG``, ``peft-ext list``.

The parser and ``peft-ext configs`` live in the light top-level module :mod:`peft_ext_cli` (``--help`` must not wait
for torch); this module runs the commands that need the package. A config's top-level ``job`` key picks the job:
``continual`` (the default) or ``missing_modality`` (:mod:`peft_ext.jobs.multimodal`, e.g. the config ``mora_emoji``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

__all__ = ["run_command"]


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
    from peft_ext.optim.choices import OPTIMIZER_CHOICES

    print("optimizers of a method's `optimizer:` section (what they step):")
    for name, choice in sorted(OPTIMIZER_CHOICES.items()):
        print(f"  {name:<18} {choice.steps:<20} {choice.summary}")
    print("continual methods (for configs):")
    for name, cls in sorted(CONTINUAL_METHODS.items()):
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"  {name:<14} {doc}")
    return 0


def _load(args: argparse.Namespace):
    from peft_ext.jobs import load_job_config

    only = None if getattr(args, "only", None) is None else args.only.split(",")
    overrides = [*args.set, *(["tune.enabled=true"] if getattr(args, "tune", False) else [])]
    return load_job_config(args.config, overrides, only)


def _method_names(config) -> list[str]:
    return [m if isinstance(m, str) else m.name for m in config.methods]


def _load_and_preflight(args: argparse.Namespace):
    from peft_ext.jobs.preflight import preflight

    config = _load(args)
    preflight(config)
    return config


def _cmd_check(args: argparse.Namespace) -> int:
    from peft_ext.jobs.preflight import preflight
    from peft_ext.jobs.sequence import sequence_summary

    config = _load(args)
    sequence = preflight(config)
    names = _method_names(config)
    print(f"{args.config}: valid ({len(names)} method{'s' * (len(names) != 1)}: {', '.join(names)})")
    if sequence is not None:
        print("\n".join(sequence_summary("would run", sequence)))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from peft_ext.jobs.launch import job_processes

    config = _load_and_preflight(args)
    with job_processes(config):
        return _run_job(args, config)


def _run_job(args: argparse.Namespace, config) -> int:
    """``peft-ext run`` once the processes (one, or those torchrun started) are joined; only rank 0 explains a
    failure, the others exit with the same status."""
    from peft_ext.continual.config import ConfigError
    from peft_ext.distributed import on_rank_zero, rank, world_size
    from peft_ext.jobs import JobFailed, run_job_config
    from peft_ext.jobs.resume import claim_output_dir

    try:
        if world_size() > 1:
            # rank 0 alone moves an earlier run aside (--overwrite); every process then finds output.dir claimed, and
            # run_job waits for all of them before rank 0 writes into it
            on_rank_zero(lambda: claim_output_dir(config.output.dir, args.resume, args.overwrite))
        run_job_config(
            config, progress=not args.no_progress, debug=args.debug, resume=args.resume, overwrite=args.overwrite
        )
    except (ConfigError, JobFailed) as err:
        if rank() == 0:
            raise
        return 2 if isinstance(err, ConfigError) else 1
    except KeyboardInterrupt:
        if rank() != 0:
            return 130
        launch = (
            ["peft-ext"] if world_size() == 1 else ["torchrun", f"--nproc_per_node={world_size()}", "-m", "peft_ext"]
        )
        command = [*launch, "run", args.config, *(f"--set={s}" for s in args.set)]
        if args.only is not None:
            command.append(f"--only={args.only}")
        if getattr(args, "tune", False):
            command.append("--tune")
        if (Path(config.output.dir) / "results.json").is_file():
            command.append("--resume")
            said = f"the work that finished is in {config.output.dir}. Resume with:"
        else:
            said = "nothing had finished yet. Start again with:"
        print(f"\npeft-ext: interrupted; {said}\n  {shlex.join(command)}", file=sys.stderr)
        return 130
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from peft_ext.checkpoint import loading_hint, verify_checkpoint

    base, note = args.base, None
    if base is None:  # the base the adapter config names, when it can be read here (offline, no download)
        base, note = _named_base(args.checkpoint)
    try:
        found = verify_checkpoint(args.checkpoint, base_model=base)
    except ValueError as err:
        print(f"peft-ext: checkpoint error: {err}", file=sys.stderr)
        return 2
    against = f" and with base model {base}" if base else ""
    for folder, peft_type in found.items():
        print(f"{folder}: {peft_type} adapter, complete and consistent with its config{against}")
    if note:
        print(note)
    hint = loading_hint(found.values())
    if hint:
        print(f"to load: {hint}")
    return 0


def _named_base(checkpoint: str) -> tuple[str | None, str | None]:
    """``(base, None)`` if the adapter config's ``base_model_name_or_path`` is readable here, else ``(None, why)``."""
    import json

    from peft_ext.checkpoint import meta_base_models

    try:
        config = json.loads((Path(checkpoint) / "adapter_config.json").read_text())
        name = config.get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None, None  # verify_checkpoint reports what is wrong with the config
    if not name:
        return None, "shapes the base model fixes: not checked (the config names no base model; pass --base)"
    try:
        meta_base_models(name, config.get("task_type"))
    except ValueError:
        return None, f"shapes the base model fixes: not checked ({name!r} is not available here; pass --base)"
    return name, None


def _cmd_table(args: argparse.Namespace) -> int:
    from peft_ext.continual.published import published_table, write_generated_tables

    try:
        if args.results is not None:
            print(published_table(args.results), end="")
            return 0
        for markdown in args.into:
            sources = write_generated_tables(markdown)
            written = ", ".join(sources) or "nothing"
            print(f"{markdown}: generated tables and claims written from {written}")
    except (OSError, ValueError) as err:
        print(f"peft-ext: table error: {err}", file=sys.stderr)
        return 2
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from peft_ext.continual.trained import load_trained, read_texts
    from peft_ext.jobs.saved import trained_folder

    try:
        folder, why = trained_folder(args.source, args.method)
        texts = read_texts(args.file, args.column)
    except (OSError, ValueError) as err:
        print(f"peft-ext: predict error: {err}", file=sys.stderr)
        return 2
    if why:
        print(f"peft-ext: {why}", file=sys.stderr)
    try:
        model = load_trained(folder)
        predictions = model.predict(texts)
    except ValueError as err:  # e.g. a prompt longer than the model takes, with its length and the limit
        print(f"peft-ext: predict error: {err}", file=sys.stderr)
        return 2
    for text, label in zip(texts, predictions):
        print(f"{' '.join(label.split())}\t{text}")  # an answer on one line, whatever it holds
    return 0


def run_command(args: argparse.Namespace) -> int:
    """Run a ``run``, ``check``, ``list``, ``verify``, ``table`` or ``predict`` command parsed by
    :func:`peft_ext_cli.build_parser` (a
    shipped config's name already resolved to its path); returns the exit status.

    Args:
        args: the parsed command line.
    """
    from peft_ext.continual.config import ConfigError

    try:
        commands = {"run": _cmd_run, "check": _cmd_check, "list": _cmd_list, "verify": _cmd_verify}
        return {**commands, "table": _cmd_table, "predict": _cmd_predict}[args.command](args)
    except ConfigError as err:
        print(f"peft-ext: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("peft-ext: interrupted; the results of the methods that finished are on disk", file=sys.stderr)
        return 130
    except Exception as err:
        from peft_ext.jobs.errors import JobFailed, one_line

        if isinstance(err, JobFailed):
            for line in str(err).splitlines():
                print(f"peft-ext: {line}", file=sys.stderr)
            print(f"peft-ext: the other methods' results are in {err.out_dir}", file=sys.stderr)
            return 1
        if getattr(args, "debug", False):
            raise
        print(f"peft-ext: error: {one_line(err)} (run with --debug for the traceback)", file=sys.stderr)
        return 1
