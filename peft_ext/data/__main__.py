"""``python -m peft_ext.data build|export|stats``: rebuild, export as CSV or summarize the WordNet gloss file."""

import sys

from .wordnet_build import main

sys.exit(main())
