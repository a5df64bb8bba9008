"""Missing-aware prompts (the MMP baseline; Lee et al., CVPR 2023), the prompt method MoRA's paper compares with.

One set of learnable prompt tokens per missing pattern (complete / text missing / image missing) and per prompted
layer. Each example gets the set of its own pattern, prepended to the input of the prompted layers; the layer's
output at the prompt positions is dropped before the next layer, which gets its own prompts (VPT-deep style). Only
the selected set receives gradient. The extra tokens make every prompted layer slower at inference, unlike merged
adapters.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["COMPLETE", "IMAGE_MISSING", "MISSING_PATTERNS", "TEXT_MISSING", "MissingAwarePrompts", "missing_pattern"]

COMPLETE, TEXT_MISSING, IMAGE_MISSING = 0, 1, 2
MISSING_PATTERNS = ("complete", "text_missing", "image_missing")


def missing_pattern(text_missing: np.ndarray | torch.Tensor, image_missing: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Per-example pattern ids: :data:`COMPLETE`, :data:`TEXT_MISSING` or :data:`IMAGE_MISSING`.

    Args:
        text_missing: ``bool`` flags, one per example (e.g. ``MissingMasks.text``).
        image_missing: ``bool`` flags of the same length.

    Raises:
        ValueError: If the lengths differ or an example misses both modalities (the protocol never does that).
    """
    text = torch.as_tensor(np.asarray(text_missing), dtype=torch.bool)
    image = torch.as_tensor(np.asarray(image_missing), dtype=torch.bool)
    if text.shape != image.shape or text.ndim != 1:
        raise ValueError(f"expected two 1-D flag arrays of equal length, got shapes {text.shape} and {image.shape}")
    if (text & image).any():
        raise ValueError("an example misses both modalities; missing-aware prompts have no pattern for that")
    return text.long() * TEXT_MISSING + image.long() * IMAGE_MISSING


class MissingAwarePrompts(nn.Module):
    """Learnable prompt tokens for one tower, selected per example by its missing pattern.

    Args:
        num_layers: How many layers of the tower get prompts (index ``0..num_layers-1`` in :meth:`prepend`).
        length: Prompt tokens per layer.
        width: The tower's hidden size.
        init_std: Standard deviation of the Gaussian init (MMP/VPT use small values).
        seed: Seed of the init (``None``: torch's global generator).
    """

    def __init__(self, num_layers: int, length: int, width: int, init_std: float = 0.02, seed: int | None = 0):
        super().__init__()
        for name, value in (("num_layers", num_layers), ("length", length), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        shape = (len(MISSING_PATTERNS), num_layers, length, width)
        self.prompts = nn.Parameter(torch.randn(shape, generator=gen) * init_std)
        self.length = length

    @property
    def num_layers(self) -> int:
        return self.prompts.shape[1]

    def forward(self, pattern: torch.Tensor, layer: int) -> torch.Tensor:
        """The prompts of ``layer`` for each example, ``(batch, length, width)``.

        Args:
            pattern: Pattern ids ``(batch,)`` from :func:`missing_pattern`.
            layer: Prompted-layer index in ``[0, num_layers)``.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"`layer` must be in [0, {self.num_layers}), got {layer}")
        return self.prompts[:, layer][pattern]

    def prepend(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, pattern: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden`` ``(batch, seq, width)`` with the prompts in front, and the key mask extended with ones.

        Strip them from the layer's output with ``out[:, prompts.length:]``.
        """
        tokens = self(pattern, layer).to(hidden.dtype)
        hidden = torch.cat([tokens, hidden], dim=1)
        if mask is not None:
            mask = torch.cat([mask.new_ones(mask.shape[0], self.length), mask], dim=1)
        return hidden, mask
