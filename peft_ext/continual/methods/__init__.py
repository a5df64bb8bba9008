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

A new method subclasses :class:`ContinualMethod`, declares its capabilities and registers with
:func:`register_continual_method` (docs/continual_methods.md, "Adding a continual method").
"""

from __future__ import annotations

from . import (  # noqa: F401  (each module registers its method)
    frozen_linear,
    full_ft,
    inflora,
    joint,
    lora_opt,
    ncm,
    olora,
    osf,
    pclr,
    ranpac,
    replay,
    riemannion,
    seq_lora,
    slda,
    splitlora,
    zero_shot,
)
from .base import (
    CONTINUAL_METHODS,
    PEFT_BOOKKEEPING,
    AdapterOptions,
    ContinualMethod,
    LoraOptions,
    MethodOptions,
    get_continual_method,
    head_module_name,
    method_capability,
    nest_into_section,
    register_continual_method,
    saved_head,
)

__all__ = [
    "CONTINUAL_METHODS",
    "PEFT_BOOKKEEPING",
    "AdapterOptions",
    "ContinualMethod",
    "LoraOptions",
    "MethodOptions",
    "get_continual_method",
    "head_module_name",
    "method_capability",
    "nest_into_section",
    "register_continual_method",
    "saved_head",
]
