"""Data sets shipped with peft-ext: WordNet 3.0 glosses labelled with their supersense and short Debian fortunes
labelled with their topic file (see ``files/README.md``), instruction tasks built from both (:mod:`.instruct_tasks`),
and the task-sequence types (:mod:`.tasks`) every continual-learning run is built from.

:mod:`.registry` declares every data set a job's ``data.dataset`` names (:data:`SHIPPED`: source, license, columns,
split rule; the shipped instruction tasks; and the kinds that read the user's own files); :mod:`.shipped` holds what
the shipped sets share (hash splits, seeded caps and class picks, validation carve). ``python -m peft_ext.data build
NAME`` rebuilds a shipped file from its Debian source.
"""

from __future__ import annotations

from . import fortunes, instruct_tasks, registry, wordnet, wordnet_build
from .fortunes import *  # noqa: F403
from .instruct_tasks import *  # noqa: F403
from .registry import *  # noqa: F403
from .wordnet import *  # noqa: F403  (the public names are listed once, in each module's __all__)
from .wordnet_build import *  # noqa: F403

__all__ = [
    *registry.__all__,
    *wordnet.__all__,
    *wordnet_build.__all__,
    *fortunes.__all__,
    *instruct_tasks.__all__,
]
