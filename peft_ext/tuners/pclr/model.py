"""The PCLR tuner: wraps target linears in :class:`~.layer.Linear`, groups them by block and computes the query."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from peft.tuners.tuners_utils import BaseTuner
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from .._common import forward_adapter_names, require_linear_target
from .config import PCLRConfig
from .layer import Linear, PCLRLayer
from .router import QueryFn, RoutingState, find_input_embeddings

__all__ = ["PCLRModel"]


class _QueryHook:
    """Forward pre-hook on the wrapped model: computes the routing query once per forward pass.

    A small object rather than a closure so that ``copy.deepcopy`` of the model re-points it at the copied state.
    """

    def __init__(self, state: RoutingState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.state.begin(module, args, kwargs)


class PCLRModel(BaseTuner):
    """PCLR adapters (a capped, keyed LoRA rank pool; METHODS.md section 3) on a model's linear layers.

    Use it through PEFT: ``get_peft_model(model, PCLRConfig(target_modules=[...]))``. Each forward pass computes one
    query per sample (by default the normalized masked mean of the input token embeddings) in a pre-hook on the
    wrapped model; every layer group then routes each sample to its own top-K ranks. Train the current task's ranks
    with any optimizer, adding :func:`peft_ext.tuners.pclr.query_loss` to the loss so the keys learn; run the task
    cycle with :mod:`peft_ext.tuners.pclr.cycle`.

    Merging is exact only while routing is static (``top_k`` covers every active rank and prototypes exclude none);
    otherwise ``merge`` raises ``ValueError``. Several adapters, disabling, deleting, mixed-adapter batches and
    bitsandbytes 8-bit / 4-bit bases work like PEFT's LoRA.

    Args:
        model: The model to adapt.
        config: The adapter configuration.
        adapter_name: Name of the first adapter.
        low_cpu_mem_usage: Accepted for PEFT's signature; the pools are always materialized.
    """

    prefix: str = "pclr_"
    tuner_layer_cls = PCLRLayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    def _routing_state(self) -> RoutingState:
        state = self.__dict__.get("_pclr_routing")
        if state is None:
            state = RoutingState()
            self.__dict__["_pclr_routing"] = state
            self.model.register_forward_pre_hook(_QueryHook(state), with_kwargs=True)
        return state

    @property
    def routing_state(self) -> RoutingState:
        """The routing state shared by this model's PCLR layers (query, selections, query losses)."""
        return self._routing_state()

    def set_query_fn(self, query_fn: QueryFn) -> None:
        """Replace the default query (normalized mean input embedding) with ``query_fn(model, args, kwargs)``.

        Args:
            query_fn: Returns the (batch, query_dim) query for a forward call of the wrapped model.
        """
        if not callable(query_fn):
            raise TypeError(f"`query_fn` must be callable, got {type(query_fn).__name__}")
        self._routing_state().query_fn = query_fn

    def _query_dim(self, config: PCLRConfig) -> int:
        if config.query_dim is not None:
            return config.query_dim
        embedding = find_input_embeddings(self.model)
        if embedding is None:
            raise ValueError(
                f"cannot infer PCLR's `query_dim`: {type(self.model).__name__} has no input embedding; set "
                "PCLRConfig(query_dim=...) and, if its inputs are not features of that width, a query_fn"
            )
        return embedding.embedding_dim

    def _create_and_replace(
        self,
        peft_config: PCLRConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        *,
        parameter_name: Optional[str] = None,
    ) -> None:
        if parameter_name is not None:
            raise ValueError(
                f"PCLR adapts whole linear layers, not parameters; got target_parameters {parameter_name!r}"
            )
        query_dim = self._query_dim(peft_config)
        if isinstance(target, PCLRLayer):
            target.update_layer(adapter_name, peft_config, query_dim, inference_mode=peft_config.inference_mode)
            return
        require_linear_target(target, current_key, "PCLR")
        match = re.match(peft_config.group_pattern, current_key)
        group = match.group(1) if match else current_key
        new_module = Linear(target, adapter_name, peft_config, query_dim, group, self._routing_state())
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        # Mixed-adapter batches: PeftModel.forward routes `adapter_names` here; every layer receives it as a kwarg.
        names = kwargs.pop("adapter_names", None)
        with forward_adapter_names(
            self,
            names,
            lambda: set().union(*(m.pclr_A.keys() for m in self.modules() if isinstance(m, PCLRLayer))),
            (PCLRLayer,),
        ):
            yield

    def query_loss(self) -> Optional[torch.Tensor]:
        """The weighted query-key loss of the last forward pass (``None`` if no trainable key was routed)."""
        loss = self._routing_state().pop_loss()
        if loss is None:
            return None
        return self.peft_config[self.active_adapters[0]].query_loss_weight * loss
