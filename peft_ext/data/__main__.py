"""``python -m peft_ext.data build|stats``: rebuild or summarize the committed WordNet gloss file."""

import sys

from .wordnet_build import main

sys.exit(main())
