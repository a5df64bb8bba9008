"""Multimodal data and the missing-modality protocol for dual-encoder adapters (MoRA, docs/methods.md (MoRA)).

- :mod:`.emoji`: the committed emoji image + name pairs (Unicode emoji list x Noto Color Emoji), and its builder;
- :mod:`.missing`: missing rate / type masks and placeholders (empty text, blank image);
- :mod:`.metrics`: accuracy, F1-macro, AUROC;
- :mod:`.prompts`: missing-aware prompts (the MMP baseline);
- :mod:`.dual_encoder`: MiniLM-L6 + small ViT dual encoder, LiT pretraining (imported on use: needs transformers);
- :mod:`.methods`: the registry of the experiment's methods (MoRA, LoRA, linear probe, prompts);
- :mod:`.preparation`: the pretrained backbone, tokenized splits and cached lower layers every method starts from;
- :mod:`.experiment`: the missing-modality fine-tuning grid (its job: :mod:`peft_ext.jobs.multimodal`).

Rebuild the data file with ``python -m peft_ext.multimodal build`` (needs Debian's unicode-data and
fonts-noto-color-emoji).
"""

from __future__ import annotations

from .emoji import EmojiPairs, build_emoji_pairs, load_emoji_pairs, split_of, validation_of
from .metrics import accuracy, auroc, f1_macro
from .missing import MISSING_TYPES, MissingMasks, MissingSpec, apply_missing, blank_image, missing_masks
from .prompts import MissingAwarePrompts, missing_pattern

__all__ = [
    "MISSING_TYPES",
    "EmojiPairs",
    "MissingAwarePrompts",
    "MissingMasks",
    "MissingSpec",
    "accuracy",
    "apply_missing",
    "auroc",
    "blank_image",
    "build_emoji_pairs",
    "f1_macro",
    "load_emoji_pairs",
    "missing_masks",
    "missing_pattern",
    "split_of",
    "validation_of",
]
