"""peft-ext: Hugging Face PEFT extended with 2025-26 parameter-efficient fine-tuning methods.

Importing this package registers every adapter type it ships with PEFT, so ``get_peft_model(model, XConfig(...))``
and ``PeftModel.from_pretrained`` work for them like for PEFT's own types.
"""

from __future__ import annotations

from .registry import register_peft_type, registered_peft_types

__version__ = "0.1.0"

__all__ = ["__version__", "register_peft_type", "registered_peft_types"]
