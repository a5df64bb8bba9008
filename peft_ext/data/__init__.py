"""Data sets shipped with peft-ext: WordNet 3.0 glosses labelled with their supersense and short Debian fortunes
labelled with their topic file (see ``files/README.md``), and the task-sequence types (:mod:`.tasks`) every
continual-learning run is built from. :mod:`.shipped` holds what the shipped sets share (hash splits, seeded caps and
class picks, validation carve); :data:`SHIPPED` is the registry the job's ``data.dataset`` looks them up in.

Rebuild the committed files with ``python -m peft_ext.data build`` (needs Debian's ``wordnet-base``) and
``python -m peft_ext.data.fortunes_build`` (needs Debian's ``fortunes``).
"""

from __future__ import annotations

from . import fortunes, wordnet, wordnet_build
from .fortunes import *  # noqa: F403
from .shipped import ShippedTexts
from .wordnet import *  # noqa: F403  (the public names are listed once, in each module's __all__)
from .wordnet_build import *  # noqa: F403

#: The data sets that ship with the package, by their ``data.dataset`` name.
SHIPPED: dict[str, ShippedTexts] = {"wordnet": wordnet.WORDNET, "fortunes": fortunes.FORTUNES}

__all__ = ["SHIPPED", *wordnet.__all__, *wordnet_build.__all__, *fortunes.__all__]
