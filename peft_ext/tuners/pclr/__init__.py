"""PCLR: a capped LoRA rank pool with keyed per-sample routing and the compress - integrate - learn cycle
(docs/methods.md (PCLR)), registered with PEFT as ``"pclr"``.

Modules: ``config`` (:class:`PCLRConfig`, :class:`PCLRCycleConfig`), ``layer`` (the layer and its pool API),
``query`` (the routing query by architecture), ``router`` (the routing state a model's layers share), ``hooks`` (the
forward hooks that drive it), ``selection`` (per-sample top-K selection, query-key loss), ``pool`` (layer groups,
folding, snapshots), ``keys`` (prototypes, routing as a task, key pulling), ``scoring`` (rank scores, compression),
``distill`` (integration), ``model`` (the tuner and the task cycle). The task cycle is the same for
every adapter type that has one: docs/task_cycle.md.

Example::

    from peft import get_peft_model
    from peft_ext import PCLRConfig

    model = get_peft_model(base, PCLRConfig(target_modules=["query", "value"], pool_size=64, top_k=16,
                                            ranks_schedule=[16], compress_schedule=[0.0, 0.25]))
    for t, batches in enumerate(tasks):
        proto = model.query_prototype(batches)
        model.begin_task(t, proto)
        for batch in batches:                       # any optimizer over the trainable parameters
            loss = task_loss(model(**batch), batch) + model.query_loss()
            ...
        model.end_task(t, proto, batches)           # store prototype, compress, integrate, freeze
"""

from __future__ import annotations

from ...registry import register_peft_type
from .._architecture import encoder_decoder_stacks, find_input_embeddings, find_patch_embeddings
from .config import INTEGRATE_ROUTING, PCLRConfig, PCLRCycleConfig
from .distill import IntegrateOptions, IntegrateResult, distill_loss, integrate, integrate_over_tasks, teacher_outputs
from .keys import pull_keys_to_prototypes, query_loss, query_prototype, routed_as, task_route
from .layer import Linear, PCLRLayer
from .model import PCLRModel
from .pool import PoolSnapshot, fold_new_ranks, group_layers, pool_in_use, stored_adapter_parameters, stored_prototypes
from .query import QuerySource, default_query, pooled_query, query_source
from .router import RoutingState, forward_arguments
from .scoring import compress, contribution_scores, importance_scores
from .selection import allowed_by_prototype, per_sample, query_key_loss, route, select_top_k

__all__ = [
    "INTEGRATE_ROUTING",
    "PCLR",
    "IntegrateOptions",
    "IntegrateResult",
    "Linear",
    "PCLRConfig",
    "PCLRCycleConfig",
    "PCLRLayer",
    "PCLRModel",
    "PoolSnapshot",
    "QuerySource",
    "RoutingState",
    "allowed_by_prototype",
    "compress",
    "contribution_scores",
    "default_query",
    "distill_loss",
    "encoder_decoder_stacks",
    "find_input_embeddings",
    "find_patch_embeddings",
    "fold_new_ranks",
    "forward_arguments",
    "group_layers",
    "importance_scores",
    "integrate",
    "integrate_over_tasks",
    "per_sample",
    "pool_in_use",
    "pooled_query",
    "pull_keys_to_prototypes",
    "query_key_loss",
    "query_loss",
    "query_prototype",
    "query_source",
    "route",
    "routed_as",
    "task_route",
    "select_top_k",
    "stored_adapter_parameters",
    "stored_prototypes",
    "teacher_outputs",
]

PCLR = register_peft_type("pclr", config_cls=PCLRConfig, model_cls=PCLRModel)
