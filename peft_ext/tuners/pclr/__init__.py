"""PCLR: a capped LoRA rank pool with keyed per-sample routing and the compress - integrate - learn cycle
(METHODS.md section 3), registered with PEFT as ``"pclr"``.

Example::

    from peft import get_peft_model
    from peft_ext import PCLRConfig
    from peft_ext.tuners.pclr import begin_task, end_task, query_loss, query_prototype

    model = get_peft_model(base, PCLRConfig(target_modules=["query", "value"], pool_size=64, top_k=16,
                                            ranks_schedule=[16], compress_schedule=[0.0, 0.25]))
    for t, batches in enumerate(tasks):
        proto = query_prototype(model, batches)
        begin_task(model, t, proto)
        for batch in batches:                       # any optimizer over the trainable parameters
            loss = task_loss(model(**batch), batch) + query_loss(model)
            ...
        end_task(model, t, proto, batches)          # store prototype, compress, integrate, freeze
"""

from __future__ import annotations

from ...registry import register_peft_type
from .config import PCLRConfig
from .cycle import (
    INTEGRATE_ROUTING,
    IntegrateResult,
    PoolSnapshot,
    begin_task,
    compress,
    contribution_scores,
    distill_loss,
    end_task,
    group_layers,
    importance_scores,
    integrate,
    integrate_over_tasks,
    pool_in_use,
    pull_keys_to_prototypes,
    query_loss,
    query_prototype,
    routed_as,
    stored_adapter_parameters,
    stored_prototypes,
    teacher_outputs,
)
from .layer import Linear, PCLRLayer
from .model import PCLRModel
from .router import (
    RoutingState,
    allowed_by_prototype,
    default_query,
    find_input_embeddings,
    query_key_loss,
    select_top_k,
)

__all__ = [
    "INTEGRATE_ROUTING",
    "PCLR",
    "IntegrateResult",
    "Linear",
    "PCLRConfig",
    "PCLRLayer",
    "PCLRModel",
    "PoolSnapshot",
    "RoutingState",
    "allowed_by_prototype",
    "begin_task",
    "compress",
    "contribution_scores",
    "default_query",
    "distill_loss",
    "end_task",
    "find_input_embeddings",
    "group_layers",
    "importance_scores",
    "integrate",
    "integrate_over_tasks",
    "pool_in_use",
    "pull_keys_to_prototypes",
    "query_key_loss",
    "query_loss",
    "query_prototype",
    "routed_as",
    "select_top_k",
    "stored_adapter_parameters",
    "stored_prototypes",
    "teacher_outputs",
]

PCLR = register_peft_type("pclr", config_cls=PCLRConfig, model_cls=PCLRModel)
