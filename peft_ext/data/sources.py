"""Reading a user's data source through Hugging Face ``datasets``: a CSV / TSV, JSON / JSONL or Parquet file (or a
list of them), a folder written by ``Dataset.save_to_disk``, an in-memory ``datasets.Dataset`` / ``DatasetDict``, or
a hub id when online. Classification (:mod:`.user_data`) and instruction (:mod:`.user_instructions`) sequences read
their files here; every refusal names the file and what would be valid.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Union

__all__ = ["BUILDERS", "Source", "describe_source", "quiet_progress", "read_source", "require_datasets"]

#: File suffixes and the ``datasets`` builder that reads them.
BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}

Source = Union[str, Path, Sequence[Union[str, Path]], Any]


def require_datasets() -> Any:
    """Hugging Face ``datasets``, or ``ImportError`` saying how to install it."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            "reading your own data needs Hugging Face `datasets`: `pip install 'peft-ext[data]'` (or "
            "`pip install datasets`)"
        ) from err
    return datasets


@contextlib.contextmanager
def quiet_progress(datasets: Any, quiet: bool = True) -> Iterator[None]:
    """``datasets``' progress bars off inside (its per-file "Generating split" bars for a few-second read)."""
    shown = datasets.is_progress_bar_enabled()
    if quiet and shown:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if quiet and shown:
            datasets.enable_progress_bars()


def describe_source(source: Any) -> str:
    """A source as messages name it: its path(s), or the type of an in-memory data set."""
    if isinstance(source, (list, tuple)):
        return ", ".join(map(str, source))
    return str(source) if isinstance(source, (str, Path)) else type(source).__name__


def read_source(source: Source, split: str = "train") -> Any:
    """A ``datasets.Dataset`` from a file, a list of files of one format, a ``save_to_disk`` folder, a hub id, or a
    ``Dataset`` / ``DatasetDict`` (its ``split``).

    Raises:
        FileNotFoundError: A path that does not exist (named).
        ValueError: An unknown file format, a file that is not UTF-8, or a missing split (named, with the valid ones).
    """
    datasets = require_datasets()
    if isinstance(source, datasets.DatasetDict):
        if split not in source:
            raise ValueError(f"the DatasetDict has no split {split!r}; its splits: {sorted(source)}")
        return source[split]
    if isinstance(source, datasets.Dataset):
        return source
    files = [Path(p) for p in source] if isinstance(source, (list, tuple)) else [Path(source)]
    local = [p.expanduser() for p in files]
    if len(local) == 1 and local[0].is_dir():
        with quiet_progress(datasets):
            loaded = datasets.load_from_disk(str(local[0]))
        return read_source(loaded, split)
    looks_like_file = local[0].suffix.lower() in BUILDERS or str(source).startswith((".", "/", "~"))
    if len(files) == 1 and not local[0].exists() and "/" in str(source) and not looks_like_file:
        try:
            with quiet_progress(datasets):
                return datasets.load_dataset(str(source), split=split)  # a hub id (network, or the local cache)
        except Exception as err:  # noqa: BLE001 - offline, unknown id, missing split: one line naming the source
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ValueError(
                f"{str(source)!r} is not a local file or folder, and as a hub data set it cannot be loaded: {first}"
            ) from None
    missing = [str(p) for p in local if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"data file {missing[0]!r} does not exist")
    suffixes = {p.suffix.lower() for p in local}
    builders = {BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) != 1:
        raise ValueError(
            f"cannot read {describe_source(source)}: files must share one of the formats {sorted(BUILDERS)} "
            f"(got suffixes {sorted(suffixes)})"
        )
    for p in local:
        _check_text(p)
    (builder,) = builders
    options = {"delimiter": "\t"} if suffixes == {".tsv"} else {}
    try:
        with quiet_progress(datasets):
            return datasets.load_dataset(builder, data_files=[str(p) for p in local], split="train", **options)
    except Exception as err:  # noqa: BLE001 - the reader's failure, named with the file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"cannot read {describe_source(source)} as {builder}: {first}") from None


def _check_text(path: Path) -> None:
    """One pass over a text data file: every line UTF-8, and at least one row (a CSV / TSV: a header and a row),
    each failure named with the file and the fix (the reader's own errors say neither)."""
    if path.suffix.lower() == ".parquet":
        return
    filled = 0
    with path.open("rb") as fh:
        for number, line in enumerate(fh, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                bad = line[err.start : err.start + 4]
                raise ValueError(
                    f"data file {str(path)!r} is not UTF-8 (line {number}, byte {err.start}: {bad!r}); re-save it "
                    "as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
                ) from None
            filled += bool(line.strip())
    if not filled or (path.suffix.lower() in (".csv", ".tsv") and filled < 2):
        what = "is empty" if not filled else "has a header and no rows"
        raise ValueError(f"data file {str(path)!r} {what}: it needs one example per row (a text and a label column)")
