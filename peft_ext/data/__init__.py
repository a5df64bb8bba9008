"""Data sets shipped with peft-ext: WordNet 3.0 glosses labelled with their supersense (see ``files/README.md``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "LEXNAMES",
    "SPLITS",
    "TEST_PERCENT",
    "GlossExample",
    "build_wordnet_glosses",
    "class_counts",
    "load_wordnet_glosses",
    "parse_data_line",
    "parse_data_lines",
    "split_of",
    "wordnet_task_sequence",
]

if TYPE_CHECKING:
    from .wordnet import (
        LEXNAMES,
        SPLITS,
        TEST_PERCENT,
        GlossExample,
        build_wordnet_glosses,
        class_counts,
        load_wordnet_glosses,
        parse_data_line,
        parse_data_lines,
        split_of,
        wordnet_task_sequence,
    )


def __getattr__(name: str) -> Any:
    # Imported on first use rather than here, so `python -m peft_ext.data.wordnet` does not find its own module
    # already imported by the package (runpy warns about that and the CLI would run a second copy of it).
    if name in __all__:
        from . import wordnet

        return getattr(wordnet, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
