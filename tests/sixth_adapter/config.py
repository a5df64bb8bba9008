"""Step 1 of docs/adding_an_adapter.md: the config dataclass of the test-only "scaledlr" adapter."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from peft.config import PeftConfig
from peft.utils import PeftType

from peft_ext.tuners import require_positive_int, validate_target_selection


@dataclass
class ScaledLowRankConfig(PeftConfig):
    """Config of a scaled low-rank adapter: the weight delta ``(alpha / r) B A`` (LoRA without its extras).

    Args:
        r: Rank of the delta.
        alpha: Scale numerator; the delta is multiplied by ``alpha / r``.
        target_modules: Names (or a regex) of the linear layers to adapt.
        exclude_modules: Names (or a regex) of modules not to adapt.
        init_weights: ``True``: ``B = 0``, the adapter starts as the identity. ``False``: a visible random delta.
        modules_to_save: Modules besides the adapters to train and save.
        layers_to_transform: Layer indices to adapt (with ``layers_pattern``).
        layers_pattern: Name of the ``nn.ModuleList`` that ``layers_to_transform`` indexes.
    """

    r: int = field(default=4, metadata={"help": "Rank of the delta."})
    alpha: float = field(default=8.0, metadata={"help": "The delta is scaled by alpha / r."})
    target_modules: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Module names or a regex of the linear layers to adapt."}
    )
    exclude_modules: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Module names or a regex of modules not to adapt."}
    )
    init_weights: bool = field(default=True, metadata={"help": "B = 0 (identity at init) or random (tests)."})
    modules_to_save: Optional[list[str]] = field(
        default=None, metadata={"help": "Modules besides the adapters to set trainable and save."}
    )
    layers_to_transform: Optional[Union[list[int], int]] = field(
        default=None, metadata={"help": "Layer indices to adapt."}
    )
    layers_pattern: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Name of the nn.ModuleList that layers_to_transform indexes."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        # On the enum, not a module global: register_peft_type instantiates this class before its return value exists.
        self.peft_type = PeftType.SCALEDLR
        validate_target_selection(self)
        require_positive_int(self, "r")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"`alpha` must be a finite number, got {self.alpha!r}")
        if not isinstance(self.init_weights, bool):
            raise ValueError(f"`init_weights` must be True or False, got {self.init_weights!r}")

    @property
    def scaling(self) -> float:
        """``alpha / r``."""
        return self.alpha / self.r
