"""Loading a transformers model without its console output (shared by the text, SmolLM2 and dual-encoder loaders)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from torch import nn
from transformers.utils import logging as hf_logging

__all__ = ["load_pretrained_quietly"]


class _DropLoadReport(logging.Filter):
    """Drops transformers' per-load "LOAD REPORT" table (ANSI-coloured, several lines); other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def load_pretrained_quietly(auto_class: Any, path: str, **kwargs: Any) -> nn.Module:
    """``auto_class.from_pretrained(path, **kwargs)`` without transformers' console output for the load: no
    "Loading weights" progress bar and no "LOAD REPORT" table. Our jobs have their own progress, and the report's
    usual content is expected (e.g. the unused ``pooler.*`` weights when the pooler is left out).

    What the report would say that matters is kept: weights missing from the checkpoint (newly initialized) give one
    warning naming them; size mismatches and other load errors still raise as transformers raises them.

    Args:
        auto_class: A transformers class with ``from_pretrained`` (``AutoModel``, ``BertModel``, ...).
        path: A local model directory or a hub id.
        **kwargs: Passed to ``from_pretrained``.
    """
    report_logger = logging.getLogger("transformers.modeling_utils")
    drop = _DropLoadReport()
    bar_was_on = hf_logging.is_progress_bar_enabled()
    report_logger.addFilter(drop)
    hf_logging.disable_progress_bar()
    try:
        model, info = auto_class.from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        report_logger.removeFilter(drop)
        if bar_was_on:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
        warnings.warn(
            f"{path}: {len(missing)} weights of {type(model).__name__} are not in the checkpoint and were newly "
            f"initialized: {shown}",
            UserWarning,
            stacklevel=2,
        )
    return model
