"""FSDP2 for the continual loop: the model's parameters sharded over the processes while a method trains.

``train.sharding: fsdp2`` (or ``accelerate launch`` with an FSDP config of ``fsdp_version: 2``) shards each method's
model with ``torch.distributed.fsdp.fully_shard`` before its first training step: every block of the model's layer
stacks is one unit (the classes its transformers model lists in ``_no_split_modules``, as accelerate's transformer
auto-wrap picks them, or ``FSDP_TRANSFORMER_CLS_TO_WRAP`` from an accelerate config), a head that PEFT trains whole
another, the whole model the root. From then on each process holds 1/N of every parameter, its gradient and its
optimizer state; the forward and backward gather and reduce-scatter them. The task cycles read and write whole
tensors from the shards (:mod:`peft_ext.distributed`), the evaluation and ``generate()`` run through the root's
hooks, and every end-of-task snapshot is gathered whole first (:func:`whole_state_dict`), so a snapshot (and
``--resume``) is the same as without sharding.

Each process still builds the whole model first (the job copies the base per method, as without sharding): sharding
lowers the memory of training, not the peak of loading. A method that cannot train on shards
(``ContinualMethod.needs_whole_parameters``) runs data-parallel with whole parameters instead, and the job says so:
one that re-wraps its model every task (it merges the finished adapter and inserts a new one: InfLoRA-style, O-LoRA,
OSF), as fully_shard cannot take modules inserted into a sharded model, and LoRA with PEFT's Riemannian
preconditioner, which computes with whole factors.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..distributed import full_tensor, world_size

__all__ = [
    "fsdp2_units",
    "is_sharded",
    "shard_model",
    "sharding_from_launcher",
    "transformer_blocks",
    "whole_state_dict",
]


def sharding_from_launcher() -> str | None:
    """``"fsdp2"`` when ``accelerate launch`` runs the process with an FSDP2 config, ``None`` without one.

    accelerate's launcher exports a config file's FSDP settings: ``ACCELERATE_USE_FSDP=true`` and ``FSDP_VERSION``.

    Raises:
        ValueError: An FSDP config of another version (FSDP1 wraps the model in a class of its own, which the
            method hooks do not see through).
    """
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() not in ("true", "1"):
        return None
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ValueError(
            f"the accelerate config asks for FSDP version {version}; the job shards with FSDP2 only: set "
            "`fsdp_version: 2` in its fsdp_config (or use a config without FSDP for plain data parallelism)"
        )
    return "fsdp2"


def _unit_classes(model: nn.Module) -> set[str]:
    named = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    if named.strip():
        return {name.strip() for name in named.split(",") if name.strip()}
    found: set[str] = set()
    for m in model.modules():
        found.update(getattr(m, "_no_split_modules", None) or ())
    return found


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP2 units of their own: the blocks of the model's layer stacks.

    A block is an entry of an ``nn.ModuleList`` whose class is named by ``FSDP_TRANSFORMER_CLS_TO_WRAP``
    (accelerate's ``fsdp_transformer_layer_cls_to_wrap``) or, without it, listed in ``_no_split_modules`` by a
    transformers model inside ``model`` (a decoder or encoder layer); a model that names none: every entry of its
    stacks. Everything else (embeddings, final norm, head, adapters outside the blocks) belongs to the root unit, so
    a method that calls the input embedding alone (PCLR's routing query) finds it gathered by the root's forward. A
    block inside another block is not a unit of its own.

    Raises:
        ValueError: ``FSDP_TRANSFORMER_CLS_TO_WRAP`` names a class the model does not have.
    """
    classes = _unit_classes(model)
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted(c for c in classes if c not in present)
    if missing and os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").strip():
        raise ValueError(
            f"the accelerate config's fsdp_transformer_layer_cls_to_wrap names {missing}, which this model does not "
            f"have; its layer classes include {sorted(c for c in present if 'Layer' in c or 'Block' in c)[:8]}"
        )
    stacked = [m for stack in model.modules() if isinstance(stack, nn.ModuleList) for m in stack]
    picked = [m for m in stacked if type(m).__name__ in classes] or stacked
    inner = {id(sub) for m in picked for sub in m.modules() if sub is not m}
    return [m for m in picked if id(m) not in inner]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` (its root)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Apply FSDP2 to ``model`` in place: each of :func:`transformer_blocks` a unit, each head that PEFT trains
    whole (``modules_to_save``) a unit, ``model`` the root.

    Scalar parameters (which ``fully_shard`` refuses, e.g. CLIP's ``logit_scale``) stay whole on every process.
    ``generate`` (when the model has it) is registered as a forward method, so generation gathers the root's
    parameters as a forward does.

    Args:
        model: The model, on ``device``, identical on every process.
        device: The processes' device type (one device per process: the GPU of its ``LOCAL_RANK``, or the CPU).

    Returns:
        ``model`` itself.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (world_size(),))
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    # a head PEFT trains whole (`modules_to_save`) is a unit too: method passes that call the model below the root
    # (PCLR's distillation) run its hooks, and `gathered_parameters` only gathers frozen parameters
    inside = {id(sub) for block in blocks for sub in block.modules()}
    for m in model.modules():
        if type(m).__name__ == "ModulesToSaveWrapper" and id(m) not in inside:
            fully_shard(m, mesh=mesh)
    scalars = {p for p in model.parameters() if p.dim() == 0}
    fully_shard(model, mesh=mesh, ignored_params=scalars or None)
    if callable(getattr(model, "generate", None)):
        register_fsdp_forward_method(model, "generate")
    return model


def fsdp2_units(model: nn.Module) -> int:
    """How many FSDP2 units ``model`` holds (the root included; 0 for a model that is not sharded)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def whole_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model``'s state dict with every tensor whole and on the CPU: FSDP2 shards are gathered (collective: every
    process calls it), plain tensors are copied."""
    return {k: full_tensor(v).detach().cpu() for k, v in model.state_dict().items()}
