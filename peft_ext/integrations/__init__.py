"""Integrations with other libraries' training loops: ``transformers.Trainer`` (optimizers, continual driver)."""

from __future__ import annotations

from .continual_trainer import ContinualTrainer, run_continual_with_trainer
from .pclr_loss import pclr_loss_func
from .trainer import optimizer_for_trainer, optimizer_from_args, parse_optim_args

__all__ = [
    "ContinualTrainer",
    "optimizer_for_trainer",
    "optimizer_from_args",
    "parse_optim_args",
    "pclr_loss_func",
    "run_continual_with_trainer",
]
