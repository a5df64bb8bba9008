"""Configuration of the Riemannion adapter (LoRA on the fixed-rank manifold, docs/methods.md (Riemannion))."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from peft.utils import PeftType

from .._common import require_positive_int
from ..adapter_config import AdapterConfig


@dataclass
class RiemannionConfig(AdapterConfig):
    """Config of a Riemannion adapter: the weight delta ``X - X0`` with ``X = A B^T`` a point of rank exactly ``r``.

    ``A`` (out x r) has orthonormal columns and ``B`` (in x r) is free; ``X0`` is the initial point, kept inside the
    adapter (two buffers) so that the model's output is unchanged at initialization without touching the base weight.
    Train it with :class:`peft_ext.optim.Riemannion` (or its SGD variant :class:`peft_ext.optim.RiemannLoRA`), which
    moves ``X`` on the manifold; ordinary optimizers would break ``A``'s orthonormality.

    The target-selection fields (``target_modules``, ``exclude_modules``, ``modules_to_save``,
    ``layers_to_transform``, ``layers_pattern``) are :class:`~peft_ext.tuners.AdapterConfig`'s.

    Args:
        r: Rank of the adapter; must be at most ``min(in_features, out_features)`` of every target layer.
        init_weights: ``True`` (default): start from a random point and store it as ``X0``, so the delta is zero at
            initialization; call :func:`peft_ext.tuners.riemannion.initialize_loi` afterwards for the
            gradient-informed LOI point. ``False``: ``X0 = 0``, the delta is the random point itself (for tests).
        init_scale: Every singular value of the initial point (random or LOI). Default ``1e-2 / sqrt(r)``, the order
            of magnitude docs/methods.md (Riemannion) gives for the paper's LOI scale.
        riemannion_dropout: Dropout on the adapter's input.
    """

    #: (tensor name, dimension, config field): that dimension of every saved tensor so named equals the config value
    #: (checked by :func:`peft_ext.verify_checkpoint` without building a model)
    saved_sizes: ClassVar[tuple[tuple[str, int, str], ...]] = tuple(
        (f"riemannion_{n}", -1, "r") for n in ("A", "B", "X0_A", "X0_B", "Z")
    )

    r: int = field(default=16, metadata={"help": "Rank of the adapter (exact rank of X)."})
    init_weights: bool = field(
        default=True,
        metadata={"help": "True: delta is zero at init (X0 = X). False: X0 = 0, a non-identity adapter (tests)."},
    )
    init_scale: Optional[float] = field(
        default=None, metadata={"help": "Singular values of the initial point; default 1e-2 / sqrt(r)."}
    )
    riemannion_dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapter input."})

    def __post_init__(self) -> None:
        super().__post_init__()
        # Looked up on the enum (not a module global): register_peft_type instantiates this class to check it before
        # the registration's return value exists.
        self.peft_type = PeftType.RIEMANNION
        require_positive_int(self, "r")
        if not isinstance(self.init_weights, bool):
            raise ValueError(f"`init_weights` must be True or False, got {self.init_weights!r}")
        if self.init_scale is not None and not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"`init_scale` must be a positive finite number or None, got {self.init_scale!r}")
        if not 0 <= self.riemannion_dropout < 1:
            raise ValueError(f"`riemannion_dropout` must be in [0, 1), got {self.riemannion_dropout!r}")

    @property
    def resolved_init_scale(self) -> float:
        """``init_scale``, or its default ``1e-2 / sqrt(r)``."""
        return self.init_scale if self.init_scale is not None else 1e-2 / math.sqrt(self.r)
