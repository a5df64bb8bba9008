"""Optimizers shipped by peft-ext. ``OPTIMIZERS`` maps a config name to the optimizer class."""

from __future__ import annotations

from torch.optim import Optimizer

OPTIMIZERS: dict[str, type[Optimizer]] = {}
