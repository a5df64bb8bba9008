"""Where a shipped data set comes from and how it splits: its source, its license and its train/test rule (the parts
of a :class:`~.shipped.ShippedDataset` declaration)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["DebianSource", "HashSplit", "License", "hash_split"]


def hash_split(key: str, test_percent: int) -> str:
    """``"test"`` for about ``test_percent`` percent of keys, else ``"train"``: a fixed function of the key.

    SHA-1 of the key rather than Python's ``hash()``, which is salted per process for strings.

    Args:
        key: The record's key (a WordNet synset id, a fortune's text).
        test_percent: Share of keys in the test split, in percent.
    """
    digest = hashlib.sha1(key.encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % 100 < test_percent else "train"


@dataclass(frozen=True)
class HashSplit:
    """The train/test rule of a shipped data set: ``"test"`` for about ``test_percent`` percent of records, by the
    SHA-1 of their ``column`` (:func:`hash_split`), so a record's split never depends on caps, seeds or classes.

    Args:
        column: The column whose value decides.
        test_percent: The share of the test split, in percent.
    """

    column: str
    test_percent: int

    def of(self, key: str) -> str:
        """The split of the record whose ``column`` is ``key``: ``"train"`` or ``"test"``."""
        return hash_split(key, self.test_percent)


@dataclass(frozen=True)
class License:
    """The license a shipped file is redistributed under.

    Args:
        name: Its name (``"WordNet 3.0 license"``).
        file: Its full text, a file next to the data (``peft_ext/data/files/WORDNET_LICENSE``); the licenses ask
            for the notice to travel with every copy.
    """

    name: str
    file: str

    def __str__(self) -> str:
        return f"{self.name} (peft_ext/data/files/{self.file})"


@dataclass(frozen=True)
class DebianSource:
    """Where a shipped file is rebuilt from: data files of a Debian package.

    Args:
        package: The Debian / Ubuntu package that installs them (``apt-get install PACKAGE``).
        version: The package version the committed file was built from (a rebuild from another one may differ).
        folder: Where the package installs them.
        files: The names of the files the build reads there.
        upstream: What they are upstream, with its home page.
    """

    package: str
    version: str
    folder: str
    files: tuple[str, ...]
    upstream: str
