"""Step 1 of docs/adding_an_adapter.md: the config dataclass of the test-only "scaledlr" adapter."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from peft.utils import PeftType

from peft_ext.tuners import AdapterConfig, require_positive_int


@dataclass
class ScaledLowRankConfig(AdapterConfig):
    """Config of a scaled low-rank adapter: the weight delta ``(alpha / r) B A`` (LoRA without its extras).

    The target-selection fields (``target_modules``, ``exclude_modules``, ``modules_to_save``,
    ``layers_to_transform``, ``layers_pattern``) are :class:`~peft_ext.tuners.AdapterConfig`'s.

    Args:
        r: Rank of the delta.
        alpha: Scale numerator; the delta is multiplied by ``alpha / r``.
        init_weights: ``True``: ``B = 0``, the adapter starts as the identity. ``False``: a visible random delta.
    """

    r: int = field(default=4, metadata={"help": "Rank of the delta."})
    alpha: float = field(default=8.0, metadata={"help": "The delta is scaled by alpha / r."})
    init_weights: bool = field(default=True, metadata={"help": "B = 0 (identity at init) or random (tests)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        # On the enum, not a module global: register_peft_type instantiates this class before its return value exists.
        self.peft_type = PeftType.SCALEDLR
        require_positive_int(self, "r")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"`alpha` must be a finite number, got {self.alpha!r}")
        if not isinstance(self.init_weights, bool):
            raise ValueError(f"`init_weights` must be True or False, got {self.init_weights!r}")

    @property
    def scaling(self) -> float:
        """``alpha / r``."""
        return self.alpha / self.r
