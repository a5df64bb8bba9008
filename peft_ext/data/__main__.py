"""``python -m peft_ext.data``: the shipped data sets by name (:data:`~peft_ext.data.registry.SHIPPED`).

``list`` names them with their source and license, ``build NAME`` rebuilds one's committed file from its source,
``stats NAME`` prints its per-class counts as a Markdown table, ``export NAME`` writes it as a ``text,label`` CSV, and
``export-instructions FOLDER`` writes the shipped instruction tasks (:mod:`.instruct_tasks`) as JSONL files in TRL's
prompt-completion format.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Sequence

from .build import build_shipped, export_csv, installed_version
from .instruct_tasks import shipped_instruction_sequence, write_trl_files
from .registry import SHIPPED, SHIPPED_INSTRUCTIONS, shipped_dataset


def _name(value: str) -> str:
    try:
        return shipped_dataset(value).name
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m peft_ext.data",
        description=f"List, rebuild, count or export the data sets that ship with peft-ext: {', '.join(SHIPPED)}.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the shipped data sets: name, file, source, license")
    names = f"a shipped data set: {', '.join(SHIPPED)}"
    build = sub.add_parser("build", help="rebuild a data set's committed file from its source files")
    build.add_argument("name", type=_name, metavar="NAME", help=names)
    build.add_argument("--source-dir", default=None, help="folder of the source files (default: the package's)")
    build.add_argument("--out", default=None, help="output path (default: the committed file)")
    stats = sub.add_parser("stats", help="print the per-class train/test counts")
    stats.add_argument("name", type=_name, metavar="NAME", help=names)
    stats.add_argument("--path", default=None, help="the data file (default: the committed one)")
    export = sub.add_parser("export", help="write a data set as a CSV (text,label), e.g. to try `dataset: files`")
    export.add_argument("name", type=_name, metavar="NAME", help=names)
    export.add_argument("--out", required=True, help="the CSV file to write (never overwritten)")
    export.add_argument("--split", choices=("train", "test", "all"), default="all", help="which split (default all)")
    export.add_argument("--classes", nargs="+", default=None, help="only these classes (default: all)")
    export.add_argument("--per-class", type=int, default=None, help="at most this many rows per class and split")
    export.add_argument("--seed", type=int, default=0, help="picks the capped subset")
    instructions = sub.add_parser(
        "export-instructions",
        help="write the shipped instruction tasks as JSONL in TRL's prompt-completion format, <task>.<split>.jsonl",
    )
    instructions.add_argument("folder", metavar="FOLDER", help="where to write (files of the same names are replaced)")
    instructions.add_argument("--tasks", nargs="+", default=None, help="the task families in order (default: all)")
    instructions.add_argument("--seed", type=int, default=0, help="picks the examples")
    sizes = inspect.signature(shipped_instruction_sequence).parameters  # one default per size: the API's
    for split, key in (("train", "train_per_task"), ("test", "test_per_task"), ("validation", "val_per_task")):
        option, default = "--" + key.replace("_", "-"), sizes[key].default
        instructions.add_argument(option, type=int, help=f"{split} examples per task (default {default})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns 0, or 1 when a build, stats or export fails (a bad argument or an unknown name
    exits with 2, as argparse does).

    Args:
        argv: Arguments (defaults to ``sys.argv[1:]``).
    """
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            for data in SHIPPED.values():
                src = data.source
                print(f"{data.name}: {data.describe}; files/{data.file}, {data.license}")
                print(f"  source: Debian {src.package} {src.version} ({src.folder}), {src.upstream}")
            for instruct in SHIPPED_INSTRUCTIONS.values():
                print(f"{instruct.name}: {instruct.describe}")
                print(f"  built from: {', '.join(data.name for data in instruct.sources)}")
        elif args.command == "build":
            data = SHIPPED[args.name]
            version = installed_version(data.source.package) if args.source_dir is None else None
            if version not in (None, data.source.version):
                print(
                    f"note: {data.source.package} {version} is installed; the committed file was built from "
                    f"{data.source.version}",
                    file=sys.stderr,
                )
            out = build_shipped(args.name, args.source_dir, args.out)
            print(f"wrote {out} ({out.stat().st_size} bytes, {len(data.read(out))} {data.item_word})")
        elif args.command == "stats":
            print(SHIPPED[args.name].stats_markdown(args.path))
        elif args.command == "export-instructions":
            sizes = {k: getattr(args, k) for k in ("train_per_task", "test_per_task", "val_per_task")}
            given = {k: v for k, v in sizes.items() if v is not None}
            sequence = shipped_instruction_sequence(args.tasks, seed=args.seed, **given)
            for path in write_trl_files(sequence, args.folder):
                print(f"wrote {path}")
        else:
            split = None if args.split == "all" else args.split
            rows = export_csv(args.name, args.out, split, args.classes, args.per_class, args.seed)
            print(f"wrote {args.out} ({rows} rows: text,label)")
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
