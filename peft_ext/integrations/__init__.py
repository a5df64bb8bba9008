"""Integrations with other libraries' training loops: ``transformers.Trainer`` (optimizers, continual driver)."""

from __future__ import annotations

from .trainer import optimizer_for_trainer, optimizer_from_args, parse_optim_args

__all__ = ["optimizer_for_trainer", "optimizer_from_args", "parse_optim_args"]
