"""Continual learning: task sequences, method plugins, the runner, metrics and reports."""

from __future__ import annotations

from . import methods_optim  # noqa: F401  (registers the `full_ft` method)
from . import methods_pclr  # noqa: F401  (registers `pclr`)
from . import methods_riemannion  # noqa: F401  (registers `riemannion` and its peers `lora_opt`)
from . import methods_splitlora  # noqa: F401  (registers `splitlora`, `inflora`, `olora`, `osf`)
from .methods import CONTINUAL_METHODS, ContinualMethod, MethodOptions, get_continual_method, register_continual_method
from .metrics import average_incremental_accuracy, backward_transfer, final_average_accuracy, forgetting, summarize
from .runner import MethodResult, RunContext, TrainConfig, evaluate, run_sequence
from .tasks import Example, Task, TaskSequence

__all__ = [
    "CONTINUAL_METHODS",
    "ContinualMethod",
    "Example",
    "MethodOptions",
    "MethodResult",
    "RunContext",
    "Task",
    "TaskSequence",
    "TrainConfig",
    "average_incremental_accuracy",
    "backward_transfer",
    "evaluate",
    "final_average_accuracy",
    "forgetting",
    "get_continual_method",
    "register_continual_method",
    "run_sequence",
    "summarize",
]
