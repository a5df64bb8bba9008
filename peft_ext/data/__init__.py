"""Data sets shipped with peft-ext: WordNet 3.0 glosses labelled with their supersense (see ``files/README.md``).

Rebuild the committed file with ``python -m peft_ext.data build`` (needs Debian's ``wordnet-base``).
"""

from __future__ import annotations

from . import wordnet
from .wordnet import *  # noqa: F403  (the public names are listed once, in wordnet.__all__)

__all__ = list(wordnet.__all__)
