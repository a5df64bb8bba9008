"""Continual learning: task sequences, method plugins, the runner, metrics and reports."""

from __future__ import annotations

from ..data.tasks import Example, Task, TaskSequence
from .context import RunContext, TrainConfig
from .engine import ContinualEngine, MethodResult, Phase, RunRecord, TaskTrainer
from .evaluation import evaluate
from .generation import evaluate_generation, next_token_loss, prompt_query
from .methods import CONTINUAL_METHODS, ContinualMethod, MethodOptions, get_continual_method, register_continual_method
from .metrics import average_incremental_accuracy, backward_transfer, final_average_accuracy, forgetting, summarize
from .runner import run_sequence

__all__ = [
    "CONTINUAL_METHODS",
    "ContinualEngine",
    "ContinualMethod",
    "Example",
    "MethodOptions",
    "MethodResult",
    "Phase",
    "RunContext",
    "RunRecord",
    "Task",
    "TaskSequence",
    "TaskTrainer",
    "TrainConfig",
    "average_incremental_accuracy",
    "backward_transfer",
    "evaluate",
    "evaluate_generation",
    "final_average_accuracy",
    "forgetting",
    "get_continual_method",
    "next_token_loss",
    "prompt_query",
    "register_continual_method",
    "run_sequence",
    "summarize",
]
