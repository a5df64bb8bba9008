"""Continual-learning methods, one module each, and the registry configs name them from.

Importing this package registers every method it ships:

- references a continual method must beat: ``frozen_linear`` (frozen backbone, linear head), the training-free
  ``ncm`` (SimpleCIL), ``slda`` and ``ranpac``, and ``joint`` (LoRA on the union of all tasks, the upper bound);
- ``seq_lora`` (LoRA task after task, nothing protected), ``full_ft`` (full fine-tuning with a choice of
  optimizer), ``lora_opt`` (LoRA with other optimizers and inits);
- for instruction sequences: ``replay`` (LoRA with a small memory of earlier tasks' examples) and ``zero_shot`` (the
  pretrained model untouched);
- the methods of this package: ``splitlora``, ``pclr``, ``riemannion``;
- the subspace baselines SplitLoRA is compared with: ``inflora``, ``olora``, ``osf``.

A new method is one module here (every public module of this folder is imported, :mod:`peft_ext.plugins`) or in
another package, declared as a ``peft_ext.continual_methods`` entry point: it subclasses :class:`ContinualMethod`,
declares its capabilities and registers with :func:`register_continual_method` (docs/adding_a_continual_method.md).
"""

from __future__ import annotations

from ...plugins import load_plugins
from .base import (
    CONTINUAL_METHODS,
    PEFT_BOOKKEEPING,
    AdapterOptions,
    ContinualMethod,
    HeadRateOptions,
    LoraOptions,
    MethodOptions,
    get_continual_method,
    head_module_name,
    method_capability,
    nest_into_section,
    register_continual_method,
    saved_head,
)

# every method module of this folder registers its method; then the ones other packages declare
load_plugins(__name__, __path__, "continual_methods")

__all__ = [
    "CONTINUAL_METHODS",
    "PEFT_BOOKKEEPING",
    "AdapterOptions",
    "ContinualMethod",
    "HeadRateOptions",
    "LoraOptions",
    "MethodOptions",
    "get_continual_method",
    "head_module_name",
    "method_capability",
    "nest_into_section",
    "register_continual_method",
    "saved_head",
]
