"""peft-ext: Hugging Face PEFT extended with 2025-26 parameter-efficient fine-tuning methods.

Importing this package registers every adapter type it ships with PEFT, so ``get_peft_model(model, XConfig(...))``
and ``PeftModel.from_pretrained`` work for them like for PEFT's own types.
"""

from __future__ import annotations

import logging


class _DropOptionalKernelNotice(logging.Filter):
    """On CPUs with AVX512-BF16, importing bitsandbytes looks for an optional 4-bit kernel on the Hugging Face Hub
    (through the ``kernels`` package, which recent transformers install). Offline or without that package it logs
    why it could not load it (and ``kernels`` logs that it skipped the publisher check). Neither is actionable for
    peft-ext users (CPU 4-bit layers work without it), so those messages are dropped; every other one passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


# Installed before anything imports peft (and with it bitsandbytes, which imports kernels).
for _name in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):
    logging.getLogger(_name).addFilter(_DropOptionalKernelNotice())
del _name

from .checkpoint import save_pretrained_atomic, verify_checkpoint  # noqa: E402
from .continual.trained import load_trained  # noqa: E402
from .optim import DCTAdamW, Riemannion, SubspaceAdamW  # noqa: E402
from .quantization import disable_bnb_cpu_repacking  # noqa: E402
from .registry import register_peft_type, registered_peft_types  # noqa: E402
from .tuners.mora import MoRAConfig  # noqa: E402
from .tuners.pclr import PCLRConfig  # noqa: E402
from .tuners.riemannion import RiemannionConfig, initialize_loi  # noqa: E402
from .tuners.splitlora import SplitLoRAConfig  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DCTAdamW",
    "MoRAConfig",
    "PCLRConfig",
    "Riemannion",
    "RiemannionConfig",
    "SplitLoRAConfig",
    "SubspaceAdamW",
    "__version__",
    "disable_bnb_cpu_repacking",
    "initialize_loi",
    "load_trained",
    "register_peft_type",
    "registered_peft_types",
    "save_pretrained_atomic",
    "verify_checkpoint",
]
