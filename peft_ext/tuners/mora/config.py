"""Configuration of the MoRA adapter (modality-common + modality-specific low-rank adaptation; docs/methods.md
(MoRA))."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

from peft.config import PeftConfig
from peft.utils import PeftType

from .._common import require_positive_int, validate_target_selection
from ..adapter_config import loading_note_field

# transformers' CLIPModel: text_model.encoder.layers.<i>.self_attn.{q,k,v,out}_proj and the same under vision_model.
CLIP_TEXT_PATTERN = r"(?:^|\.)text_model\.encoder\.layers\.(\d+)\."
CLIP_VISION_PATTERN = r"(?:^|\.)vision_model\.encoder\.layers\.(\d+)\."
CLIP_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


@dataclass
class MoRAConfig(PeftConfig):
    """Config of a MoRA adapter on a dual encoder (a text tower and a vision tower of possibly different widths).

    For every adapted square projection ``W`` (``d x d``, ``d`` the tower's width) of layer pair ``l``:

    - modality-common factors, one pair per layer pair and shared by all projections of both towers in it:
      ``S_A`` (``d_text x r``) and ``S_B`` (``d_vision x r``); text delta ``S_A (S_B^T S_B) S_A^T``, vision delta
      ``S_B (S_A^T S_A) S_B^T``, so each tower's gradient reaches the other tower's factor through the Gram matrix;
    - modality-specific LoRA factors per module: ``M_B M_A`` with ``M_B = 0`` at init;
    - the two-magnitude composition ``W' = m_sh * rownorm(W + a dW_sh) + m_sp * rownorm(W + a dW_sp)`` with
      ``a = alpha / r`` and ``rownorm`` normalizing each output unit's weight vector (DoRA's "column" norm in the
      paper's ``d x k`` layout; PEFT's DoRA uses the same per-output norm).

    Identity at init (``init_weights=True``): ``m_sh = 0`` and ``m_sp = ||W||`` (the magnitudes sum to ``||W||``,
    all of it on the specific branch, whose delta is zero), so ``W' = W`` exactly. The public code starts both
    magnitudes at ``||W||`` (``W' = 2W``); peft-ext starts at an exact identity instead. The shared factors receive
    gradient once ``m_sh`` leaves zero, which the first optimizer step does (like LoRA's ``B = 0``).

    Args:
        r: Rank of the shared and the specific factors.
        alpha: Scale numerator; the deltas are multiplied by ``alpha / r``.
        target_modules: Module-name suffixes (or one regex, matched against the full name) of the square linear
            projections to adapt inside the selected layers. Default: CLIP's attention projections.
        text_pattern: Regex whose first group is the layer index of a text-tower module (searched in the name).
        vision_pattern: Regex whose first group is the layer index of a vision-tower module.
        layers: Layer indices adapted in both towers; text layer ``i`` pairs with vision layer ``i``. ``None``: the
            top ``top_layers`` layers of each tower, paired from the top (so towers of different depth still pair).
        top_layers: How many top layers per tower to adapt when ``layers`` is ``None`` (the public code adapts the
            top 2 of 12).
        init_weights: ``True``: identity at init (see above). ``False``: a visible delta for tests (``M_B`` random,
            ``m_sh = m_sp = ||W|| / 2``).
        shared_init_std: Standard deviation of the Gaussian shared factors; default ``1 / sqrt(r)`` (docs/methods.md
            (MoRA)).
        modules_to_save: Modules besides the adapters to train and save (e.g. a classification head).
        loading_note: What loading a saved MoRA adapter needs, kept in ``adapter_config.json``; never read.
    """

    #: (tensor name, dimension, config field): that dimension of every saved tensor so named equals the config value
    #: (checked by :func:`peft_ext.verify_checkpoint` without building a model)
    saved_sizes: ClassVar[tuple[tuple[str, int, str], ...]] = (
        ("mora_spec_A", 0, "r"),
        ("mora_spec_B", 1, "r"),
        ("mora_shared_text", -1, "r"),
        ("mora_shared_vision", -1, "r"),
    )

    r: int = field(default=4, metadata={"help": "Rank of the shared and specific factors (paper default 4)."})
    alpha: float = field(default=4.0, metadata={"help": "Deltas are scaled by alpha / r."})
    target_modules: Optional[Union[list[str], str]] = field(
        default_factory=lambda: list(CLIP_ATTENTION_PROJECTIONS),
        metadata={"help": "Suffixes (or a regex) of the square projections to adapt inside the selected layers."},
    )
    text_pattern: str = field(
        default=CLIP_TEXT_PATTERN, metadata={"help": "Regex; group 1 is the layer index of a text-tower module."}
    )
    vision_pattern: str = field(
        default=CLIP_VISION_PATTERN, metadata={"help": "Regex; group 1 is the layer index of a vision-tower module."}
    )
    layers: Optional[list[int]] = field(
        default=None, metadata={"help": "Layer indices adapted in both towers; None: the top `top_layers` layers."}
    )
    top_layers: int = field(default=2, metadata={"help": "Top layers per tower to adapt when `layers` is None."})
    init_weights: bool = field(
        default=True, metadata={"help": "True: exact identity at init. False: a visible random delta (tests)."}
    )
    shared_init_std: Optional[float] = field(
        default=None, metadata={"help": "Std of the Gaussian shared factors; default 1 / sqrt(r)."}
    )
    modules_to_save: Optional[list[str]] = field(
        default=None, metadata={"help": "Modules besides the adapters to set trainable and save (e.g. a head)."}
    )
    loading_note: str = loading_note_field()

    def __post_init__(self) -> None:
        super().__post_init__()
        # Looked up on the enum, not through a module global: register_peft_type instantiates this class before its
        # return value exists.
        self.peft_type = PeftType.MORA
        validate_target_selection(self)
        require_positive_int(self, "r")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"`alpha` must be a finite number, got {self.alpha!r}")
        if not self.target_modules:
            raise ValueError(f"`target_modules` must name at least one projection, got {self.target_modules!r}")
        for name in ("text_pattern", "vision_pattern"):
            pattern = getattr(self, name)
            if not isinstance(pattern, str):
                raise TypeError(f"`{name}` must be a regex string, got {type(pattern).__name__} {pattern!r}")
            try:
                groups = re.compile(pattern).groups
            except re.error as exc:
                raise ValueError(f"`{name}` is not a valid regex ({exc}): {pattern!r}") from exc
            if groups < 1:
                raise ValueError(f"`{name}` needs a capturing group for the layer index, got {pattern!r}")
        if self.text_pattern == self.vision_pattern:
            raise ValueError(f"`text_pattern` and `vision_pattern` must differ, both are {self.text_pattern!r}")
        if self.layers is not None:
            self.layers = list(self.layers)
            if not self.layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.layers):
                raise ValueError(
                    f"`layers` must be a non-empty list of non-negative ints or None, got {self.layers!r}"
                )
            if len(set(self.layers)) != len(self.layers):
                raise ValueError(f"`layers` must not repeat an index, got {self.layers!r}")
        require_positive_int(self, "top_layers")
        if not isinstance(self.init_weights, bool):
            raise ValueError(f"`init_weights` must be True or False, got {self.init_weights!r}")
        if (
            self.shared_init_std is not None
            and not (isinstance(self.shared_init_std, (int, float)) and math.isfinite(self.shared_init_std))
            or (self.shared_init_std is not None and self.shared_init_std <= 0)
        ):
            raise ValueError(
                f"`shared_init_std` must be a positive finite number or None, got {self.shared_init_std!r}"
            )

    @property
    def scaling(self) -> float:
        """``alpha / r``, the factor on both deltas."""
        return self.alpha / self.r

    @property
    def resolved_shared_init_std(self) -> float:
        """``shared_init_std``, or its default ``1 / sqrt(r)``."""
        return self.shared_init_std if self.shared_init_std is not None else 1.0 / math.sqrt(self.r)
