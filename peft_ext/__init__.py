"""peft-ext: Hugging Face PEFT extended with 2025-26 parameter-efficient fine-tuning methods.

Importing this package registers every adapter type it ships with PEFT, so ``get_peft_model(model, XConfig(...))``
and ``PeftModel.from_pretrained`` work for them like for PEFT's own types.
"""

from __future__ import annotations

from peft_ext_autoload import quiet_kernel_notices

quiet_kernel_notices()  # before anything imports peft (and with it bitsandbytes)

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
