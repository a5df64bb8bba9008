"""Building the packaged fortunes file from Debian's ``fortunes`` package: ``python -m peft_ext.data.fortunes_build``.

:func:`parse_fortune_file` splits one fortune(6) data file into its entries, :func:`clean_entry` turns an entry into
the one-line text a classifier sees (or refuses it), and :func:`build_fortunes` writes the reproducible xz-compressed
TSV that :mod:`peft_ext.data.fortunes` loads. The filtering, in order, for every entry of the twelve
:data:`~peft_ext.data.fortunes.CATEGORIES` files:

1. overstrike is undone (``X<BS>Y`` prints ``Y``: the underlined and bold words of a few entries);
2. entries still holding a control character (a terminal bell) or any non-ASCII character (a few carry mojibake
   such as ``donÃ¢Â€Â™t``) are dropped;
3. a trailing attribution is dropped: the last line that is indented and starts with ``--`` (``\\t\\t-- Mark
   Twain``), with the indented lines that continue it, when it is not the entry's first line. An attribution often
   names the class outright (``-- Captain Kirk, "The Menagerie", stardate 3012.4``), as a WordNet lemma would;
4. whitespace runs (line breaks and paragraph breaks included) become one space, and the ends are stripped;
5. texts shorter than :data:`MIN_CHARS` or longer than :data:`MAX_CHARS` characters are dropped (long stories,
   tables, poems; and near-empty entries);
6. duplicates are dropped: a text that occurs in two categories is dropped from both (its label is ambiguous), and
   within a category only its first occurrence is kept.

The id of a row is ``<category>/<n>``, ``n`` being the entry's 0-based position in its source file (4 digits).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from .fortunes import (
    CATEGORIES,
    COLUMNS,
    DEFAULT_PATH,
    FORTUNES,
    FortuneExample,
    read_fortune_file,
    split_of,
)
from .shipped import source_folder, write_xz

__all__ = ["DEFAULT_FORTUNE_DIR", "build_fortunes", "clean_entry", "parse_fortune_file"]

DEFAULT_FORTUNE_DIR = "/usr/share/games/fortunes"
#: The Debian package (and version) the committed file was built from.
SOURCE_PACKAGE = "fortunes"
SOURCE_VERSION = "1:1.99.1-7.3"
MIN_CHARS = 20
MAX_CHARS = 300

_OVERSTRIKE = re.compile(r"[^\n]\x08")
_ATTRIBUTION = re.compile(r"^\s+--\s*\S")
_PRINTABLE = re.compile(r"[\t\n\x20-\x7e]*")


def parse_fortune_file(text: str) -> list[str]:
    """The entries of a fortune(6) data file: the blocks between lines that are exactly ``%``.

    Args:
        text: The file's content.
    """
    entries, current = [], []
    for line in text.split("\n"):
        if line == "%":
            entries.append("\n".join(current))
            current = []
        else:
            current.append(line)
    if any(line.strip() for line in current):
        entries.append("\n".join(current))
    return entries


def clean_entry(entry: str) -> str | None:
    """The text of one fortune entry as the classifier sees it, or ``None`` when the filter drops it (steps 1-5 of
    the module docstring; duplicates are :func:`build_fortunes`' business).

    Args:
        entry: One entry, its lines joined with ``"\\n"``.
    """
    while _OVERSTRIKE.search(entry):
        entry = _OVERSTRIKE.sub("", entry)
    if not _PRINTABLE.fullmatch(entry):
        return None
    lines = entry.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    end = len(lines)
    for k in range(len(lines) - 1, 0, -1):
        if _ATTRIBUTION.match(lines[k]):
            end = k
            break
        if not lines[k][:1].isspace():  # an attribution is followed by indented continuation lines only
            break
    text = " ".join(" ".join(lines[:end]).split())
    return text if MIN_CHARS <= len(text) <= MAX_CHARS else None


def _records(fortune_dir: Path) -> list[FortuneExample]:
    candidates: list[tuple[str, str, str]] = []  # (id, category, text)
    for category in CATEGORIES:
        path = fortune_dir / category
        text = path.read_bytes().decode("utf-8")  # strict: an undecodable file is not the one documented
        seen: set[str] = set()
        for n, entry in enumerate(parse_fortune_file(text)):
            cleaned = clean_entry(entry)
            if cleaned is not None and cleaned not in seen:
                seen.add(cleaned)
                candidates.append((f"{category}/{n:04d}", category, cleaned))
    categories_of = Counter(text for _, _, text in candidates)
    return [
        FortuneExample(id_, category, text, split_of(text))
        for id_, category, text in sorted(candidates)
        if categories_of[text] == 1
    ]


def _encode_tsv(records: Sequence[FortuneExample]) -> bytes:
    rows = ["\t".join(COLUMNS)]
    rows += ["\t".join((r.id, r.category, r.text)) for r in records]
    return ("\n".join(rows) + "\n").encode("ascii")


def build_fortunes(
    fortune_dir: str | os.PathLike[str] = DEFAULT_FORTUNE_DIR, out_path: str | os.PathLike[str] | None = None
) -> Path:
    """Read the fortune files of :data:`~peft_ext.data.fortunes.CATEGORIES`, filter them and write the
    xz-compressed TSV that :mod:`peft_ext.data.fortunes` loads.

    The output is byte-for-byte reproducible: rows are sorted by id and the xz container holds no timestamp or file
    name.

    Args:
        fortune_dir: Directory holding the fortune files (Debian's ``fortunes`` installs them in
            ``/usr/share/games/fortunes``).
        out_path: Where to write; defaults to the package's ``files/fortunes.tsv.xz``.

    Returns:
        The path written.
    """
    fortune_dir = source_folder(fortune_dir, CATEGORIES, "fortune files", "--fortune-dir", "fortunes")
    return write_xz(Path(out_path or DEFAULT_PATH), _encode_tsv(_records(fortune_dir)))


def installed_version(package: str = SOURCE_PACKAGE) -> str | None:
    """The installed version of a Debian package (``dpkg-query``), or ``None`` when it (or dpkg) is absent."""
    try:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Status} ${Version}", package], capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    status, _, version = result.stdout.rpartition(" ")
    return version if result.returncode == 0 and status.endswith("installed") else None


def stats_markdown(path: str | os.PathLike[str] | None = None) -> str:
    """The per-category train/test counts of the fortunes file as a Markdown table."""
    return FORTUNES.stats_markdown("category", path)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: rebuild the fortunes file (default), or print its class counts (``--stats``).

    Args:
        argv: Arguments (defaults to ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m peft_ext.data.fortunes_build", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--fortune-dir", default=DEFAULT_FORTUNE_DIR, help="directory of the fortune files")
    parser.add_argument("--out", default=None, help=f"output path (default: {DEFAULT_PATH})")
    parser.add_argument("--stats", action="store_true", help="print the per-category counts of --out instead")
    args = parser.parse_args(argv)
    try:
        if args.stats:
            print(stats_markdown(args.out))
            return 0
        version = installed_version()
        if args.fortune_dir == DEFAULT_FORTUNE_DIR and version not in (None, SOURCE_VERSION):
            print(
                f"note: {SOURCE_PACKAGE} {version} is installed; the committed file was built from {SOURCE_VERSION}",
                file=sys.stderr,
            )
        out = build_fortunes(args.fortune_dir, args.out)
        print(f"wrote {out} ({out.stat().st_size} bytes, {len(read_fortune_file(out))} entries)")
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
