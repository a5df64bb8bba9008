"""Building the rows of the packaged fortunes file from Debian's ``fortunes`` package
(``python -m peft_ext.data build fortunes`` runs :func:`fortune_rows`).

:func:`parse_fortune_file` splits one fortune(6) data file into its entries, :func:`clean_entry` turns an entry into
the one-line text a classifier sees (or refuses it), and :func:`fortune_rows` gives the rows that
:mod:`peft_ext.data.fortunes` loads. The filtering, in order, for every entry of the twelve
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

import re
from collections import Counter
from pathlib import Path

from .fortunes import CATEGORIES

__all__ = ["MAX_CHARS", "MIN_CHARS", "clean_entry", "fortune_rows", "parse_fortune_file"]

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


def fortune_rows(folder: Path) -> list[tuple[str, str, str]]:
    """The rows of the fortunes file (``id``, ``category``, ``text``), sorted by id, from the fortune files of
    :data:`~peft_ext.data.fortunes.CATEGORIES` in ``folder`` (Debian's ``fortunes`` installs them in
    ``/usr/share/games/fortunes``): every entry :func:`clean_entry` keeps, less duplicates (step 6 of the module
    docstring).

    Args:
        folder: The folder holding the fortune files.
    """
    candidates: list[tuple[str, str, str]] = []  # (id, category, text)
    for category in CATEGORIES:
        text = (
            (folder / category).read_bytes().decode("utf-8")
        )  # strict: an undecodable file is not the one documented
        seen: set[str] = set()
        for n, entry in enumerate(parse_fortune_file(text)):
            cleaned = clean_entry(entry)
            if cleaned is not None and cleaned not in seen:
                seen.add(cleaned)
                candidates.append((f"{category}/{n:04d}", category, cleaned))
    categories_of = Counter(text for _, _, text in candidates)
    return [row for row in sorted(candidates) if categories_of[row[2]] == 1]
