"""The missing-modality protocol of MMP (Lee et al., CVPR 2023), which MoRA's paper evaluates on (docs/methods.md
(MoRA)).

A split of ``n`` paired examples gets a missing rate ``rate`` and a type: ``"text"`` (``rate * n`` examples lose
their text), ``"image"`` (they lose their image) or ``"both"`` (``rate * n`` examples lose one modality: a share
``text_share`` of them the text, the rest the image; the paper's setting is rate 0.7, share 0.5, i.e. 35% text
missing, 35% image missing, 30% complete). No example loses both. The same spec is applied to train and test, each
split with its own deterministic draw. Missing text becomes the empty string, a missing image a blank (white) image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MISSING_TYPES", "MissingMasks", "MissingSpec", "apply_missing", "blank_image", "missing_masks"]

MISSING_TYPES = ("text", "image", "both")


@dataclass(frozen=True)
class MissingSpec:
    """How modalities go missing.

    Args:
        rate: Fraction of examples with a missing modality, in ``[0, 1]``.
        kind: ``"text"``, ``"image"`` or ``"both"``.
        text_share: With ``kind="both"``, the share of the missing examples that lose their text (default 0.5).
    """

    rate: float
    kind: str = "both"
    text_share: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not 0 <= self.rate <= 1:
            raise ValueError(f"`rate` must be a number in [0, 1], got {self.rate!r}")
        if self.kind not in MISSING_TYPES:
            raise ValueError(f"`kind` must be one of {MISSING_TYPES}, got {self.kind!r}")
        if not isinstance(self.text_share, (int, float)) or not 0 <= self.text_share <= 1:
            raise ValueError(f"`text_share` must be a number in [0, 1], got {self.text_share!r}")

    def counts(self, n: int) -> tuple[int, int]:
        """``(text missing, image missing)`` example counts for a split of ``n`` (rounded half up, exact totals)."""
        missing = math.floor(self.rate * n + 0.5)
        if self.kind == "text":
            return missing, 0
        if self.kind == "image":
            return 0, missing
        text = math.floor(self.text_share * missing + 0.5)
        return text, missing - text


@dataclass(frozen=True)
class MissingMasks:
    """Per-example flags: ``text[i]`` / ``image[i]`` is True when example ``i`` lost that modality (never both).

    Args:
        text: ``bool`` array of length ``n``.
        image: ``bool`` array of length ``n``.
    """

    text: np.ndarray
    image: np.ndarray

    @property
    def complete(self) -> np.ndarray:
        """Examples with both modalities."""
        return ~(self.text | self.image)


def missing_masks(n: int, spec: MissingSpec, seed: int) -> MissingMasks:
    """Draw which examples of a split of ``n`` lose which modality: exactly ``spec.counts(n)``, deterministically.

    Use a different ``seed`` per split (e.g. 0 for train, 1 for test) and the same ``spec`` for both.

    Args:
        n: Number of examples.
        spec: The protocol.
        seed: Seed of the permutation.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"`n` must be a non-negative int, got {n!r}")
    n_text, n_image = spec.counts(int(n))
    order = np.random.default_rng(seed).permutation(n)
    text = np.zeros(n, dtype=bool)
    image = np.zeros(n, dtype=bool)
    text[order[:n_text]] = True
    image[order[n_text : n_text + n_image]] = True
    return MissingMasks(text, image)


def blank_image(shape: Sequence[int], dtype: np.dtype = np.uint8) -> np.ndarray:
    """The placeholder for a missing image: all white (the emoji data's background), ``uint8`` 255."""
    return np.full(tuple(shape), 255, dtype=dtype)


def apply_missing(texts: Sequence[str], images: np.ndarray, masks: MissingMasks) -> tuple[list[str], np.ndarray]:
    """Replace missing texts by ``""`` and missing images by :func:`blank_image`; inputs are not modified.

    Args:
        texts: ``n`` strings.
        images: ``uint8`` array ``(n, H, W, C)``.
        masks: From :func:`missing_masks` with the same ``n``.

    Raises:
        ValueError: If the lengths disagree.
    """
    n = len(texts)
    if len(images) != n or len(masks.text) != n or len(masks.image) != n:
        raise ValueError(
            f"texts ({n}), images ({len(images)}) and masks ({len(masks.text)}) must have the same length"
        )
    out_texts = ["" if missing else text for text, missing in zip(texts, masks.text)]
    out_images = images.copy()
    out_images[masks.image] = blank_image(images.shape[1:], images.dtype)
    return out_texts, out_images
