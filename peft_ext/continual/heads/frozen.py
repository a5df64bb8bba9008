"""Features of a frozen backbone, computed once and shared by the methods that train nothing.

``ncm``, ``slda`` and ``ranpac`` read the same features of the same frozen backbone, and every evaluation row of a
continual run scores the earlier tasks' test sets again. Their forwards give the same features each time, so a job
keeps them: :class:`FrozenFeatures` holds one tensor per batch of examples, keyed by the examples themselves, and a
later pass over the same batch reads it instead of running the backbone. The batches are the ones the passes cut
anyway (shortest first, ``eval_batch_size``), so what a head learns and scores is bit for bit what it was without the
cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from ...data.tasks import Example
from .base import forward_with_features

__all__ = ["FrozenFeatures", "backbone_signature"]


def backbone_signature(model: nn.Module) -> torch.Tensor:
    """One sum per parameter of ``model`` outside its classifier, in float64: two backbones with equal signatures are
    taken as the same (the features are the classifier's input, so the classifier does not change them)."""
    sums = [p.detach().double().sum() for name, p in model.named_parameters() if "classifier" not in name]
    return torch.stack(sums).cpu() if sums else torch.zeros(0, dtype=torch.float64)


class FrozenFeatures:
    """The features a frozen backbone gave each batch of examples, so the next pass over that batch reads them.

    One instance serves one backbone: the first model it sees fixes its signature (:func:`backbone_signature`), and a
    model whose backbone differs is refused. Features are kept until ``max_bytes`` are held; later batches are run
    through the backbone every time (the result is the same, only slower).

    Args:
        max_bytes: The most feature memory kept (default 1 GiB).
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        #: Batches run through the backbone, and batches read from the cache instead.
        self.computed = 0
        self.reused = 0
        self._signature: Optional[torch.Tensor] = None
        self._kept: dict[tuple[int, ...], tuple[list[Example], torch.Tensor]] = {}

    def check(self, model: nn.Module) -> None:
        """Take ``model``'s backbone as the cache's (the first call), or refuse one that differs from it.

        Raises:
            ValueError: ``model``'s backbone is not the one the kept features came from.
        """
        signature = backbone_signature(model)
        if self._signature is None:
            self._signature = signature
        elif signature.shape != self._signature.shape or not torch.equal(signature, self._signature):
            raise ValueError(
                "FrozenFeatures serves one frozen backbone, and this model's parameters differ from the one its "
                "features came from: give each backbone its own FrozenFeatures"
            )

    def features(self, model: nn.Module, chunk: Sequence[Example], batch: dict[str, Any]) -> torch.Tensor:
        """The features of ``chunk`` (a batch of examples, in the order the pass cut it): kept ones, or one forward
        of ``model`` on ``batch`` (the collated chunk), kept while there is room."""
        key = tuple(map(id, chunk))
        kept = self._kept.get(key)
        if kept is not None:
            self.reused += 1
            return kept[1]
        _, features = forward_with_features(model, batch)
        self.computed += 1
        size = features.numel() * features.element_size()
        if self.bytes + size <= self.max_bytes:
            # the examples are kept with their features, so no other object can take their ids while the key lives
            self._kept[key] = (list(chunk), features)
            self.bytes += size
        return features
