"""Figures quoted outside docs/benchmarks.md, generated from it: one figure per quantity, so no page can disagree.

docs/benchmarks.md is the results file of record for every benchmark (``python -m benchmarks.run_all`` writes it from
the benchmark scripts' own tables). A page that quotes one of its figures marks the quote::

    Riemannion <!-- figure vs riemannion 1 riemannion_loi -->ties LoRA + AdamW (...)<!-- /figure -->

and this module writes the text between the markers from the report. The kinds of figure (``KIND SECTION ...``,
SECTION being an entry's name in ``benchmarks/sections.py``, tables numbered from 1 in the order the section prints
them):

- ``vs SECTION TABLE ROW``: the row's paired difference in the table's ``vs X (95 % CI)`` column, as a verdict
  ("beats X" / "ties X" / "trails X", by whether the interval clears 0) with the difference, its interval, the data
  set and the number of seeds;
- ``target SECTION N OBJECT``: the same from the section's N-th target line (a paired difference printed only
  there), against OBJECT (free text, e.g. ``APOLLO at rank 8``); a target line that gives a ratio with its interval
  reads ``1.108x OBJECT [1.053, 1.165] (data set, seeds)``;
- ``ratio SECTION TABLE ROW COLUMN OBJECT``: a ``0.27 [0.18, 0.36]`` cell as ``0.27x OBJECT [0.18, 0.36] (data set,
  seeds)``;
- ``lr_step SECTION ROW``: a method's validation accuracy at its chosen learning rate and at the next point of its
  grid, from the section's first table (grid, chosen lr) and the table of every grid point;
- ``range SECTION TABLE COLUMN ROW...``: the smallest and largest cell of a column over rows (``8-58x``);
- ``ratio_vs SECTION N OBJECT``: a target line's ratio with its interval as a verdict on 1: ``ties OBJECT (0.995x
  [0.961, 1.031], data set, seeds)`` when the interval holds 1, ``is above OBJECT (...)`` / ``is below OBJECT (...)``
  when it clears it (which side is better is the sentence's to say: a perplexity's ratio above 1 is worse);
- ``met SECTION N``: the verdict a target line ends with (``met``, ``NOT met``, ``NOT met (met on the mean only)``);
- ``measured SECTION N``: the ratio a target line measured (``... = 58x (>= 50x): met`` gives ``58x``);
- ``speedup SECTION N OBJECT``: the same ratio as a speed-up in words, ``58x faster than OBJECT`` (a ratio below 1:
  ``2.5x slower than OBJECT``);
- ``cell SECTION TABLE ROW COLUMN``: one cell as printed;
- ``targets SECTION``: the section's target lines, as its list prints them;
- ``command SECTION``: the command that produced the section, less the options that only name output files
  (```python -m benchmarks.pclr --step --widths 256 1024 2048 --rounds 20 12 8```);
- ``table SECTION TABLE``: a whole table, as printed, between blank lines (so the markers sit on lines of their
  own and the table renders).

ROW is a row's first cell; COLUMN a column's 1-based index. Arguments after the first `` | `` are separated by
`` | `` (for rows whose name holds a space): ``<!-- figure range dct 1 | 7 | 1024 x 256 (rectangular) | 4096 x 1024
(rectangular) -->``; inside a markdown table cell write them ``\\|``, as the table needs.

Usage, from the repository root::

    python -m benchmarks.figures            # rewrite every figure of README.md and docs/*.md from docs/benchmarks.md
    python -m benchmarks.figures --check    # exit 1 and name each figure that differs (what the tests run)

``python -m benchmarks.run_all`` runs the first after writing the report.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.sections import ENTRIES
from peft_ext.continual.metrics import verdict

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "docs" / "benchmarks.md"

FIGURE = re.compile(r"<!-- figure (?P<key>[^>]*?) -->(?P<body>.*?)<!-- /figure -->", re.S)

#: The data set each section measured on, as a figure names it.
DATA_SET = {
    "continual": "WordNet",
    "continual_fortunes": "fortunes",
    "riemannion": "WordNet",
    "dct": "WordNet",
    "mora": "emoji pairs",
    "pretrain_llama": "WordNet bytes",
    "llm_finetune": "SmolLM2-135M-Instruct, 6 instruction tasks",
}
#: How a figure names a method the report calls by its code name.
NAMES = {
    "lora_adamw": "LoRA + AdamW",
    "lora": "LoRA",
    "inflora": "InfLoRA-style",
    "seq_lora": "sequential LoRA",
    "riemannion_loi": "Riemannion + LOI",
    "galore": "GaLore",
}


@dataclass
class Table:
    """One markdown table of a report section: its header and its rows (cells stripped)."""

    header: list[str]
    rows: list[list[str]]
    lines: list[str]

    def row(self, first: str) -> list[str]:
        for row in self.rows:
            if row[0] == first:
                return row
        raise KeyError(f"no row {first!r}; rows: {[r[0] for r in self.rows]}")

    def column(self, index: int) -> int:
        if not 1 <= index <= len(self.header):
            raise KeyError(f"no column {index}; columns 1-{len(self.header)}: {self.header}")
        return index - 1


@dataclass
class Section:
    """A ``## `` section of the report: its tables in order and its target lines."""

    title: str
    tables: list[Table] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    text: str = ""

    def table(self, number: int) -> Table:
        if not 1 <= number <= len(self.tables):
            raise KeyError(f"no table {number} in {self.title!r}; it has {len(self.tables)}")
        return self.tables[number - 1]

    def seeds(self) -> int:
        """How many test seeds the section's comparisons pair (its target lines' "over N seeds", else the first
        ``seeds [..]`` list it prints)."""
        found = re.search(r"over (\d+) seeds", "\n".join(self.targets))
        if found:
            return int(found[1])
        listed = re.search(r"seeds \[([\d, ]+)\]", self.text)
        if listed:
            return len(listed[1].split(","))
        raise KeyError(f"{self.title!r} names no number of seeds")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def parse_report(text: str) -> dict[str, Section]:
    """The report's sections by title."""
    sections: dict[str, Section] = {}
    current: Section | None = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), Section(line[3:].strip()))
        elif current is not None and line.startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            current.tables.append(Table(_cells(block[0]), [_cells(b) for b in block[2:]], block))
            continue
        elif current is not None and line.startswith("- target:"):
            current.targets.append(line[2:])
        if current is not None:
            current.text += line + "\n"
        i += 1
    return sections


#: The report's entries by name.
BY_NAME = {entry.name: entry for entry in ENTRIES}


_INTERVAL = re.compile(r"(?P<d>[+-]?\d+(?:\.\d+)?) \[(?P<lo>[+-]?\d+(?:\.\d+)?), (?P<hi>[+-]?\d+(?:\.\d+)?)\]")


def _paired(d: str, lo: str, hi: str, obj: str, where: str) -> str:
    return f"{verdict(float(lo), float(hi))} {obj} ({d} points [{lo}, {hi}], {where})"


def _grid_next(grid: str, chosen: str) -> str:
    points = [p.strip() for p in grid.split("/")]
    values = [float(p) for p in points]
    index = min(range(len(values)), key=lambda k: abs(values[k] - float(chosen)))
    if index + 1 >= len(points):
        raise KeyError(f"the chosen lr {chosen} is the top of its grid {grid}: no point above it")
    return points[index + 1]


#: Options of a benchmark command that only say where its files go (each takes one value) or reuse earlier runs.
_OUTPUT_OPTIONS = {"--json", "--runs", "--png", "--out"}


def command_line(args: tuple[str, ...]) -> str:
    """A section's command as a reader re-runs it: the module and its options, less those that name output files."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in _OUTPUT_OPTIONS:
            skip = True
        elif arg != "--resume":
            kept.append(arg)
    return " ".join(kept)


def render(key: str, sections: dict[str, Section], titles: dict[str, str] | None = None) -> str:
    """The text of the figure ``key`` (see the module docstring) from the parsed report."""
    head, *rest = key.replace("\\|", "|").split(" | ")  # a key inside a table cell escapes its pipes: \|
    parts = head.split() + [p.strip() for p in rest]
    kind, args = parts[0], parts[1:]
    kinds = (
        "vs",
        "target",
        "ratio_vs",
        "met",
        "measured",
        "speedup",
        "ratio",
        "lr_step",
        "range",
        "cell",
        "table",
        "targets",
        "command",
    )
    if kind not in kinds:
        raise ValueError(f"figure {key!r}: unknown kind {kind!r}; one of {kinds}")
    if not args:
        raise ValueError(f"figure {key!r}: no section named")
    titles = {n: entry.title for n, entry in BY_NAME.items()} if titles is None else titles
    name = args[0]
    if name not in titles or titles[name] not in sections:
        raise ValueError(f"figure {key!r}: no section {name!r} in the report; sections: {sorted(titles)}")
    section = sections[titles[name]]

    def where() -> str:  # only the kinds that state an interval name the data set and seeds
        return f"{DATA_SET[name]}, {section.seeds()} seeds" if name in DATA_SET else ""

    try:
        if kind == "command":
            return f"`python -m {command_line(BY_NAME[name].args)}`"
        if kind in ("measured", "speedup"):
            line = section.targets[int(args[1]) - 1]
            found = re.search(r" = (\S+?x)\b", line)
            if found is None:
                raise KeyError(f"target {args[1]} measures no ratio 'N.NNx': {line!r}")
            if kind == "measured":
                return found[1]
            obj, ratio = " ".join(args[2:]), float(found[1][:-1])
            return f"{found[1]} faster than {obj}" if ratio >= 1 else f"{1 / ratio:.2g}x slower than {obj}"
        if kind == "met":
            line = section.targets[int(args[1]) - 1]
            found = re.search(r": ((?:NOT )?met(?: \([^)]*\))?)$", line)
            if found is None:
                raise KeyError(f"target {args[1]} ends with no verdict: {line!r}")
            return found[1]
        if kind == "targets":
            if not section.targets:
                raise KeyError("it prints no target line")
            return "\n\n" + "\n".join(f"- {line}" for line in section.targets) + "\n\n"
        if kind == "table":
            return "\n\n" + "\n".join(section.table(int(args[1])).lines) + "\n\n"
        if kind == "cell":
            table = section.table(int(args[1]))
            return table.row(args[2])[table.column(int(args[3]))]
        if kind == "range":
            table = section.table(int(args[1]))
            column = table.column(int(args[2]))
            cells = [table.row(r)[column] for r in args[3:]]
            unit = re.sub(r"^[\d.]+", "", cells[0])
            values = sorted(float(re.match(r"[\d.]+", c)[0]) for c in cells)
            low, high = (f"{v:g}" for v in (values[0], values[-1]))
            return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"
        if kind == "vs":
            table = section.table(int(args[1]))
            column = next(k for k, h in enumerate(table.header) if h.startswith("vs "))
            other = re.sub(r"^vs (.*?) \(95 % CI\)$", r"\1", table.header[column])
            found = _INTERVAL.fullmatch(table.row(args[2])[column])
            if found is None:
                raise KeyError(f"row {args[2]!r} has no paired interval: {table.row(args[2])[column]!r}")
            return _paired(found["d"], found["lo"], found["hi"], NAMES.get(other, other), where())
        if kind == "target":
            line = section.targets[int(args[1]) - 1]
            obj = " ".join(args[2:])
            found = re.search(r"(?P<d>[+-]\d+\.\d) points, 95 % CI \[(?P<lo>\S+), (?P<hi>\S+)\] over \d+ seeds", line)
            if found is not None:
                return _paired(found["d"], found["lo"], found["hi"], obj, where())
            found = re.search(r"ratio (?P<r>\d+\.\d+), 95 % CI \[(?P<lo>\S+), (?P<hi>\S+)\]", line)
            if found is None:
                raise KeyError(f"target {args[1]} is neither a paired difference nor a ratio: {line!r}")
            return f"{found['r']}x {obj} [{found['lo']}, {found['hi']}] ({where()})"
        if kind == "ratio_vs":
            line = section.targets[int(args[1]) - 1]
            found = re.search(r"ratio (?P<r>\d+\.\d+), 95 % CI \[(?P<lo>\S+), (?P<hi>\S+)\]", line)
            if found is None:
                raise KeyError(f"target {args[1]} gives no ratio with an interval: {line!r}")
            low, high = float(found["lo"]), float(found["hi"])
            word = "ties" if low <= 1 <= high else "is above" if low > 1 else "is below"
            obj = " ".join(args[2:])
            return f"{word} {obj} ({found['r']}x [{found['lo']}, {found['hi']}], {where()})"
        if kind == "ratio":
            table = section.table(int(args[1]))
            found = re.fullmatch(r"(\S+) \[(\S+), (\S+)\]", table.row(args[2])[table.column(int(args[3]))])
            if found is None:
                raise KeyError(f"row {args[2]!r} column {args[3]} is not 'ratio [low, high]'")
            return f"{found[1]}x {' '.join(args[4:])} [{found[2]}, {found[3]}] ({where()})"
        if kind == "lr_step":
            first = section.tables[0]
            row = first.row(args[1])
            grid, chosen = row[first.header.index("lr grid")], row[first.header.index("chosen lr")]
            above = _grid_next(grid, chosen)
            wanted = {f"{args[1]} lr {chosen}", f"{args[1]} lr {above}"}
            every = next(t for t in section.tables if wanted <= {r[0] for r in t.rows})
            at = {r[0]: r[-1] for r in every.rows}
            return (
                f"from {at[f'{args[1]} lr {chosen}']} at its best learning rate ({chosen}) to "
                f"{at[f'{args[1]} lr {above}']} half a decade above it ({above})"
            )
    except (KeyError, IndexError, ValueError, StopIteration) as err:
        raise ValueError(f"figure {key!r} in section {name!r}: {err}") from None
    raise AssertionError(kind)


def figures(text: str) -> list[tuple[str, str]]:
    """``(key, body)`` of every figure in a markdown text."""
    return [(m["key"], m["body"]) for m in FIGURE.finditer(text)]


def rewrite(text: str, sections: dict[str, Section], titles: dict[str, str] | None = None) -> str:
    """``text`` with every figure written from the report (``titles``: section titles by entry name, default
    those of :data:`benchmarks.sections.ENTRIES`)."""
    return FIGURE.sub(
        lambda m: f"<!-- figure {m['key']} -->{render(m['key'], sections, titles)}<!-- /figure -->",
        text,
    )


def pages(root: Path = ROOT) -> list[Path]:
    """Every markdown page that may quote the report: README.md and docs/*.md but the report itself."""
    return [root / "README.md", *sorted(p for p in (root / "docs").glob("*.md") if p.name != "benchmarks.md")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="pages to rewrite (default: README.md and docs/*.md)")
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a figure differs")
    parser.add_argument("--report", type=Path, default=REPORT, help="the report (default docs/benchmarks.md)")
    args = parser.parse_args(argv)
    sections = parse_report(args.report.read_text())
    stale = []
    for page in args.files or pages():
        text = page.read_text()
        try:
            new = rewrite(text, sections)
        except ValueError as err:
            print(f"{page}: {err}", file=sys.stderr)
            return 2
        if new == text:
            continue
        if args.check:
            old = dict(figures(text))
            stale += [f"{page}: {key}" for key, body in figures(new) if old.get(key) != body]
            continue
        tmp = page.with_suffix(".md.tmp")
        tmp.write_text(new)
        os.replace(tmp, page)
        print(f"[figures] rewrote {page}")
    if stale:
        print("figures that differ from docs/benchmarks.md (run python -m benchmarks.figures):", file=sys.stderr)
        print("\n".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
