"""Building the packaged WordNet gloss file from the WordNet 3.0 data files, and the ``python -m peft_ext.data`` CLI.

:func:`parse_data_line` reads one line of WordNet's ``data.*`` files (wndb(5WN)); :func:`build_wordnet_glosses`
writes the reproducible xz-compressed TSV that :mod:`peft_ext.data.wordnet` loads.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from .shipped import source_folder, write_xz
from .wordnet import (
    COLUMNS,
    DEFAULT_PATH,
    EXAMPLE_SEP,
    LEXNAMES,
    WORDNET,
    GlossExample,
    read_gloss_file,
    split_of,
)

__all__ = ["DEFAULT_WORDNET_DIR", "build_wordnet_glosses", "main", "parse_data_line", "parse_data_lines"]

DEFAULT_WORDNET_DIR = "/usr/share/wordnet"
DATA_FILES = ("data.adj", "data.adv", "data.noun", "data.verb")

# ss_type -> (synset id prefix, lexname prefix). Satellites ("s") live in data.adj next to head adjectives and share
# its offset space, so they get the "a" prefix of the file they come from.
_SS_TYPES = {
    "n": ("n", "noun."),
    "v": ("v", "verb."),
    "a": ("a", "adj."),
    "s": ("a", "adj."),
    "r": ("r", "adv."),
}
# Syntactic markers WordNet appends to some adjective lemmas ("galore(ip)"); they are not part of the word.
_ADJ_MARKER = re.compile(r"\((?:a|p|ip)\)$")
# Examples start at the first quote after a ";". A handful of glosses omit the space (`responsive;"an alert mind"`).
_EXAMPLES_START = re.compile(r';\s*"')
_EXAMPLE_SPLIT = re.compile(r';\s*(?=")')
_QUOTED = re.compile(r'"(.*)"\s*(.*)', re.DOTALL)
_WHITESPACE = re.compile(r"[\t\r\n]+")


def _clean(text: str) -> str:
    return _WHITESPACE.sub(" ", text).strip()


def _split_gloss(gloss: str) -> tuple[str, tuple[str, ...]]:
    match = _EXAMPLES_START.search(gloss)
    if match is None:
        return _clean(gloss), ()
    definition = _clean(gloss[: match.start()])
    examples = []
    for segment in _EXAMPLE_SPLIT.split(gloss[match.start() + 1 :]):
        segment = _clean(segment).rstrip(";").strip()
        quoted = _QUOTED.fullmatch(segment)
        if quoted is not None:
            # `"text"- Author` -> `text - Author`; the greedy group keeps inner quotes of odd glosses intact.
            segment = " ".join(part for part in (quoted[1].strip(), quoted[2].strip()) if part)
        if segment:
            examples.append(segment.replace("|", "/"))
    return definition, tuple(examples)


def _fields_add_up(fields: list[str], n_words: int, is_verb: bool) -> bool:
    # A misread w_cnt shifts every later field, so checking that the pointers (and verb frames) consume exactly the
    # rest of the line catches it even when the misplaced fields happen to look like numbers.
    p_at = 4 + 2 * n_words
    if len(fields) <= p_at or not fields[p_at].isdigit():
        return False
    n_ptrs = int(fields[p_at])
    ptrs, rest = fields[p_at + 1 : p_at + 1 + 4 * n_ptrs], fields[p_at + 1 + 4 * n_ptrs :]
    if len(ptrs) != 4 * n_ptrs:
        return False
    for i in range(0, len(ptrs), 4):
        offset, pos, source_target = ptrs[i + 1 : i + 4]
        if not (len(offset) == 8 and offset.isdigit() and pos in _SS_TYPES and len(source_target) == 4):
            return False
    if not is_verb:
        return not rest
    return bool(rest) and rest[0].isdigit() and len(rest) == 1 + 3 * int(rest[0])


def parse_data_line(line: str) -> GlossExample | None:
    """Parse one line of a WordNet 3.0 ``data.*`` file.

    Args:
        line: ``synset_offset lex_filenum ss_type w_cnt word lex_id [word lex_id ...] p_cnt [ptr ...] [frames ...]
            | gloss``, where ``w_cnt`` is two hexadecimal digits. License header lines (two leading spaces) and
            blank lines give ``None``.

    Returns:
        The synset, or ``None`` for a header or blank line.
    """
    if not line.strip() or line.startswith("  "):
        return None
    head, sep, gloss = line.partition("|")
    fields = head.split()
    if not sep or len(fields) < 6:
        raise ValueError(
            f"Not a WordNet data line (expected `offset lex_filenum ss_type w_cnt words ... | gloss`): {line[:80]!r}"
        )
    offset, lex_filenum, ss_type, w_cnt = fields[:4]
    if ss_type not in _SS_TYPES:
        raise ValueError(f"Unknown ss_type {ss_type!r} (valid: {sorted(_SS_TYPES)}) in line {line[:80]!r}")
    if not (len(offset) == 8 and offset.isdigit()):
        raise ValueError(f"Synset offset {offset!r} is not 8 decimal digits in line {line[:80]!r}")
    lexnum = int(lex_filenum) if lex_filenum.isdigit() else -1
    if not 0 <= lexnum < len(LEXNAMES):
        raise ValueError(f"lex_filenum {lex_filenum!r} is outside 0..{len(LEXNAMES) - 1} in line {line[:80]!r}")
    prefix, lex_prefix = _SS_TYPES[ss_type]
    supersense = LEXNAMES[lexnum]
    # A mismatch means the fields were misread (or the file is not WordNet 3.0), so refuse rather than mislabel.
    if not supersense.startswith(lex_prefix):
        raise ValueError(f"lex_filenum {lexnum} ({supersense}) does not fit ss_type {ss_type!r} in {line[:80]!r}")
    n_words = int(w_cnt, 16) if re.fullmatch(r"[0-9a-fA-F]{2}", w_cnt) else 0
    if n_words == 0 or not _fields_add_up(fields, n_words, ss_type == "v"):
        raise ValueError(f"w_cnt {w_cnt!r} does not match the words and pointers of line {line[:80]!r}")
    words = fields[4 : 4 + 2 * n_words : 2]
    if prefix == "a":
        words = [_ADJ_MARKER.sub("", word) for word in words]
    synset = f"{prefix}{offset}"
    definition, examples = _split_gloss(gloss)
    return GlossExample(synset, supersense, tuple(words), definition, examples, split_of(synset))


def parse_data_lines(lines: Iterable[str]) -> list[GlossExample]:
    """Parse the lines of a WordNet data file, skipping the license header.

    Args:
        lines: The file's lines (with or without line endings).
    """
    return [record for record in map(parse_data_line, lines) if record is not None]


def _encode_tsv(records: Iterable[GlossExample]) -> bytes:
    rows = ["\t".join(COLUMNS)]
    for r in sorted(records, key=lambda r: r.synset):
        fields = (r.synset, r.supersense, " ".join(r.lemmas), r.definition, EXAMPLE_SEP.join(r.examples))
        rows.append("\t".join(_clean(f) for f in fields))
    return ("\n".join(rows) + "\n").encode("utf-8")


def build_wordnet_glosses(
    wordnet_dir: str | os.PathLike[str] = DEFAULT_WORDNET_DIR, out_path: str | os.PathLike[str] | None = None
) -> Path:
    """Parse the WordNet 3.0 data files and write the xz-compressed TSV this module loads.

    The output is byte-for-byte reproducible: rows are sorted by synset id and the xz container holds no timestamp
    or file name (xz rather than gzip because it keeps the file near 3.4 MB instead of 4.5 MB).

    Args:
        wordnet_dir: Directory holding ``data.noun``, ``data.verb``, ``data.adj`` and ``data.adv`` (Debian's
            ``wordnet-base`` installs them in ``/usr/share/wordnet``).
        out_path: Where to write; defaults to the package's ``files/wordnet_glosses.tsv.xz``.

    Returns:
        The path written.
    """
    wordnet_dir = source_folder(wordnet_dir, DATA_FILES, "WordNet 3.0 data files", "--wordnet-dir", "wordnet-base")
    records: list[GlossExample] = []
    for name in DATA_FILES:
        # WordNet 3.0 is pure ASCII; latin-1 cannot fail on other bytes, and the parser rejects anything malformed.
        with open(wordnet_dir / name, encoding="latin-1") as fh:
            for lineno, line in enumerate(fh, start=1):
                try:
                    record = parse_data_line(line)
                except ValueError as err:
                    raise ValueError(f"{wordnet_dir / name}:{lineno}: {err}") from err
                if record is not None:
                    records.append(record)
    ids = Counter(r.synset for r in records)
    dupes = sorted(s for s, n in ids.items() if n > 1)
    if dupes:
        raise ValueError(f"Synset ids repeated in {wordnet_dir}: {dupes[:5]}")
    return write_xz(Path(out_path or DEFAULT_PATH), _encode_tsv(records))


def export_csv(
    out: str | Path,
    split: str | None = None,
    classes: Sequence[str] | None = None,
    per_class: int | None = None,
    seed: int = 0,
) -> int:
    """Write glosses as a UTF-8 CSV with columns ``text`` (the definition) and ``label`` (the supersense), in synset
    order; returns the number of rows. Refuses to overwrite ``out``.

    Args:
        out: The CSV file.
        split: ``"train"``, ``"test"`` or ``None`` (both).
        classes: Only these supersenses (``None``: all).
        per_class: At most this many per class and split (the seeded subset of :func:`load_wordnet_glosses`).
        seed: Picks the capped subset.
    """
    import csv

    from .wordnet import load_wordnet_glosses

    path = Path(out)
    if path.exists():
        raise ValueError(f"{str(path)!r} exists; choose another --out (nothing is overwritten)")
    splits = [split] if split else ["train", "test"]
    records = [r for s in splits for r in load_wordnet_glosses(s, classes, per_class, seed)]
    records.sort(key=lambda r: r.synset)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "label"])
        writer.writerows([r.text, r.supersense] for r in records)
    return len(records)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``build`` rebuilds the gloss file, ``export`` writes glosses as a CSV, ``stats`` prints the class
    counts as a Markdown table.

    Args:
        argv: Arguments (defaults to ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(prog="python -m peft_ext.data", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="rebuild the gloss file from the WordNet 3.0 data files")
    build.add_argument("--wordnet-dir", default=DEFAULT_WORDNET_DIR, help="directory with data.noun etc.")
    build.add_argument("--out", default=None, help=f"output path (default: {DEFAULT_PATH})")
    export = sub.add_parser(
        "export", help="write WordNet glosses as a CSV (text,label), e.g. to try the job on files of your own"
    )
    export.add_argument("--out", required=True, help="the CSV file to write (never overwritten)")
    export.add_argument("--split", choices=("train", "test", "all"), default="all", help="which split (default all)")
    export.add_argument("--classes", nargs="+", default=None, help="only these supersenses (default: all)")
    export.add_argument("--per-class", type=int, default=None, help="at most this many glosses per class")
    export.add_argument("--seed", type=int, default=0, help="picks the capped subset")
    stats = sub.add_parser("stats", help="print per-supersense train/test counts")
    stats.add_argument("--path", default=None, help="gloss file (default: the packaged one)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            out = build_wordnet_glosses(args.wordnet_dir, args.out)
            print(f"wrote {out} ({out.stat().st_size} bytes, {len(read_gloss_file(out))} synsets)")
        elif args.command == "export":
            rows = export_csv(
                args.out, None if args.split == "all" else args.split, args.classes, args.per_class, args.seed
            )
            print(f"wrote {args.out} ({rows} rows: text,label)")
        else:
            print(WORDNET.stats_markdown("supersense", args.path))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
