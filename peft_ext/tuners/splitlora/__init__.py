"""SplitLoRA (docs/methods.md (SplitLoRA)): continual learning with LoRA in the minor subspace of old tasks' inputs.

Importing this package registers the adapter type ``splitlora`` (``PeftType.SPLITLORA``) with PEFT.
"""

from __future__ import annotations

from ...registry import register_peft_type
from .config import SplitLoRAConfig
from .layer import Linear, SplitLoRALayer
from .model import SplitLoRAModel, TaskSplit

__all__ = ["SPLITLORA", "Linear", "SplitLoRAConfig", "SplitLoRALayer", "SplitLoRAModel", "TaskSplit"]

SPLITLORA = register_peft_type("splitlora", config_cls=SplitLoRAConfig, model_cls=SplitLoRAModel)
