"""Data sets shipped with peft-ext: WordNet 3.0 glosses labelled with their supersense (see ``files/README.md``),
and the task-sequence types (:mod:`.tasks`) every continual-learning run is built from.

Rebuild the committed file with ``python -m peft_ext.data build`` (needs Debian's ``wordnet-base``).
"""

from __future__ import annotations

from . import wordnet, wordnet_build
from .wordnet import *  # noqa: F403  (the public names are listed once, in each module's __all__)
from .wordnet_build import *  # noqa: F403

__all__ = [*wordnet.__all__, *wordnet_build.__all__]
