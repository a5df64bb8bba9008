"""Building the rows of the packaged WordNet gloss file from the WordNet 3.0 data files
(``python -m peft_ext.data build wordnet`` runs :func:`gloss_rows`).

:func:`parse_data_line` reads one line of WordNet's ``data.*`` files (wndb(5WN)); :func:`gloss_rows` turns the four
files into the rows :mod:`peft_ext.data.wordnet` loads, sorted by synset id.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from .registry import WORDNET
from .wordnet import EXAMPLE_SEP, LEXNAMES, GlossExample, split_of

__all__ = ["gloss_rows", "parse_data_line", "parse_data_lines"]

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


def gloss_rows(folder: Path) -> list[tuple[str, ...]]:
    """The rows of the gloss file (its columns: :attr:`WORDNET.columns <peft_ext.data.registry.WORDNET>`), sorted by
    synset id, from the WordNet 3.0 data files in ``folder`` (Debian's ``wordnet-base`` installs them in
    ``/usr/share/wordnet``); a malformed line raises ``ValueError`` naming its file and line.

    Args:
        folder: The folder holding ``data.adj``, ``data.adv``, ``data.noun`` and ``data.verb``.
    """
    records: list[GlossExample] = []
    for name in WORDNET.source.files:
        # WordNet 3.0 is pure ASCII; latin-1 cannot fail on other bytes, and the parser rejects anything malformed.
        with open(folder / name, encoding="latin-1") as fh:
            for lineno, line in enumerate(fh, start=1):
                try:
                    record = parse_data_line(line)
                except ValueError as err:
                    raise ValueError(f"{folder / name}:{lineno}: {err}") from err
                if record is not None:
                    records.append(record)
    ids = Counter(r.synset for r in records)
    dupes = sorted(s for s, n in ids.items() if n > 1)
    if dupes:
        raise ValueError(f"Synset ids repeated in {folder}: {dupes[:5]}")
    return [
        tuple(
            _clean(f) for f in (r.synset, r.supersense, " ".join(r.lemmas), r.definition, EXAMPLE_SEP.join(r.examples))
        )
        for r in sorted(records, key=lambda r: r.synset)
    ]
