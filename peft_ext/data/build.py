"""Writing the files of the shipped data sets: :func:`build_shipped` rebuilds one from its declared source (``python
-m peft_ext.data build NAME``), :func:`export_csv` writes one as a ``text,label`` CSV for ``dataset: files``.

A rebuild is byte-for-byte reproducible: the data set's build function gives its rows in file order, written under
the declared header as UTF-8 TSV and xz-compressed with no timestamp or file name in the container.
"""

from __future__ import annotations

import csv
import lzma
import os
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..fileperm import atomic_write
from .provenance import DebianSource
from .registry import shipped_dataset
from .shipped import resolve

__all__ = ["build_shipped", "export_csv", "installed_version", "source_folder", "write_xz"]


def write_xz(out: Path, data: bytes) -> Path:
    """Write ``data`` to ``out`` xz-compressed, reproducibly (no timestamp or file name in the container; preset 6,
    xz's default, within 0.3 % of preset 9 at a fraction of its memory) and atomically (a temporary file, then a
    rename: :func:`~peft_ext.fileperm.atomic_write`); returns ``out``."""
    payload = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=6)
    atomic_write(out, lambda tmp: Path(tmp).write_bytes(payload))
    return out


def encode_tsv(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> bytes:
    """The TSV of ``rows`` under the header ``columns``, UTF-8, one ``\\n`` after every line; a row whose fields
    would break the format (a tab or a line break inside, a wrong number of fields) raises ``ValueError``."""
    lines = ["\t".join(columns)]
    for row in rows:
        if len(row) != len(columns) or any(("\t" in f or "\n" in f) for f in row):
            raise ValueError(f"row {row!r:.120} does not fit the columns {list(columns)} (one field each, no tabs)")
        lines.append("\t".join(row))
    return ("\n".join(lines) + "\n").encode("utf-8")


def source_folder(source: DebianSource, folder: str | os.PathLike[str] | None = None) -> Path:
    """``folder`` (default: where ``source``'s package installs its files) once every file ``source`` names is in it;
    otherwise ``FileNotFoundError`` naming the missing files, ``--source-dir`` and the package that installs them."""
    where = Path(folder if folder is not None else source.folder)
    missing = [str(where / name) for name in source.files if not (where / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"source files not found: {', '.join(missing)}. Pass --source-dir pointing at the folder that holds them, "
            f"or on Debian/Ubuntu run `apt-get install {source.package}` (it installs them in {source.folder})."
        )
    return where


def installed_version(package: str) -> str | None:
    """The installed version of a Debian package (``dpkg-query``), or ``None`` when it (or dpkg) is absent."""
    try:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Status} ${Version}", package], capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    status, _, version = result.stdout.rpartition(" ")
    return version if result.returncode == 0 and status.endswith("installed") else None


def build_shipped(
    name: str, source_dir: str | os.PathLike[str] | None = None, out: str | os.PathLike[str] | None = None
) -> Path:
    """Rebuild the file of the shipped data set ``name`` from its source files; returns the path written.

    Args:
        name: A name of :data:`~peft_ext.data.registry.SHIPPED`.
        source_dir: The folder of the source files (default: where the declared Debian package installs them).
        out: Where to write (default: the committed file in ``peft_ext/data/files``).
    """
    data = shipped_dataset(name)
    rows = resolve(data.build)(source_folder(data.source, source_dir))
    return write_xz(Path(out) if out is not None else data.path, encode_tsv(data.columns, rows))


def export_csv(
    name: str,
    out: str | os.PathLike[str],
    split: str | None = None,
    classes: Sequence[str] | None = None,
    per_class: int | None = None,
    seed: int = 0,
) -> int:
    """Write the shipped data set ``name`` as a UTF-8 CSV with columns ``text`` (what a classifier sees) and
    ``label`` (the class), in file order; returns the number of rows. Refuses to overwrite ``out``.

    Args:
        name: A name of :data:`~peft_ext.data.registry.SHIPPED`.
        out: The CSV file.
        split: ``"train"``, ``"test"`` or ``None`` (both).
        classes: Only these classes (``None``: all).
        per_class: At most this many per class and split (the seeded caps of ``ShippedDataset.load``).
        seed: Picks the capped subset.
    """
    data = shipped_dataset(name)
    path = Path(out)
    if path.exists():
        raise ValueError(f"{str(path)!r} exists; choose another --out (nothing is overwritten)")
    kept = {
        data.key_of(r)
        for s in ([split] if split else ["train", "test"])
        for r in data.load(s, classes, max_per_class=per_class, seed=seed)
    }
    records = [r for r in data.read() if data.key_of(r) in kept]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "label"])
        writer.writerows([data.text_of(r), data.label_of(r)] for r in records)
    return len(records)
