"""Plain English text no shipped task trains on, for measuring what continual tuning costs a language model's general
ability: its per-token perplexity before and after a sequence (TRACE's question, on text of our own).

Fortunes and WordNet usage examples from the shipped files' test splits (split by a hash of the text / synset, so a
training split never holds them), chosen by a fixed hash order: the same texts on every machine.
"""

from __future__ import annotations

import functools

from .shipped import seeded_rank

__all__ = ["held_out_text"]


@functools.lru_cache(maxsize=4)
def held_out_text(per_source: int = 100, max_words: int = 40) -> tuple[str, ...]:
    """``per_source`` fortunes and ``per_source`` WordNet example sentences of the test splits (each at most
    ``max_words`` words, at least 4), fortunes first.

    Args:
        per_source: Texts taken from each of the two sources.
        max_words: Longest text kept, in whitespace words (the model sees each text whole).
    """
    from .fortunes import read_fortune_file
    from .wordnet import read_gloss_file

    if per_source < 1 or max_words < 4:
        raise ValueError(f"need per_source >= 1 and max_words >= 4, got {per_source} and {max_words}")

    def fits(text: str) -> bool:
        return 4 <= len(text.split()) <= max_words

    fortunes = {f.text for f in read_fortune_file() if f.split == "test" and fits(f.text)}
    examples = {e for g in read_gloss_file() if g.split == "test" for e in g.examples if fits(e) and " - " not in e}
    chosen: list[str] = []
    for pool in (fortunes, examples):
        ranked = sorted(pool, key=lambda text: seeded_rank(0, text))
        if len(ranked) < per_source:
            raise ValueError(f"only {len(ranked)} held-out texts of at most {max_words} words; ask for fewer")
        chosen.extend(ranked[:per_source])
    return tuple(chosen)
