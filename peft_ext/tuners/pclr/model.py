"""The PCLR tuner: wraps target linears in :class:`~.layer.Linear`, groups them by block, computes the query, and
runs the task cycle (``begin_task`` / ``end_task``; docs/task_cycle.md).

The task cycle (docs/methods.md (PCLR)) for task ``t``:

1. :meth:`PCLRModel.begin_task`: make room (the pool never exceeds ``pool_size``), add ``ranks_for_task(t)``
   trainable ranks (``a_i`` optionally copied from the static ranks whose keys best match the task's prototype;
   ``b_i = 0`` so the model's function is unchanged when training starts) and set their keys to the task's query
   prototype (:meth:`PCLRModel.query_prototype`).
2. Train (task loss + :meth:`PCLRModel.query_loss`).
3. :meth:`PCLRModel.end_task`: store the task's prototype; if the schedule (or the next task's room) asks for it,
   record the uncompressed pool's outputs on the task's data (teacher), compress the pool (:mod:`.scoring`),
   integrate (distill teacher -> compressed pool + shared LoRA; :mod:`.distill`); fold the new ranks into the
   static pool; pull keys toward the prototypes of similar tasks (:mod:`.keys`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import _get_in_out_features
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from ...distributed import broadcast_, gathered_parameters, reject_zero3
from .._architecture import encoder_decoder_stacks
from .._cycle import resolve_cycle_adapter
from ..adapter_tuner import AdapterTuner
from .config import MEASURED_RULES, PCLRConfig, PCLRCycleConfig
from .distill import IntegrateOptions, IntegrateResult, KeptOutputs, integrate, integrate_over_tasks, teacher_outputs
from .keys import pull_keys_to_prototypes, query_prototype
from .layer import N_NEW, N_STATIC, TASK, Linear, PCLRLayer
from .pool import PoolSnapshot, fold_new_ranks, group_layers, stored_prototypes
from .query import query_source
from .router import QueryFn, RoutingState
from .scoring import compress, contribution_scores, drop_count

Batch = dict[str, Any]

__all__ = ["PCLRModel"]


class PCLRModel(AdapterTuner):
    """PCLR adapters (a capped, keyed LoRA rank pool; docs/methods.md (PCLR)) on a model's linear layers.

    Use it through PEFT: ``get_peft_model(model, PCLRConfig(target_modules=[...]))``. Each forward pass computes one
    query per sample (by default the normalized masked mean of the input token embeddings; for image and feature
    models see :mod:`.query`) in a pre-hook on the wrapped model; every layer group then routes each sample to its own
    top-K ranks. In generation the query of the prompt is kept for the decoding steps (:class:`~.router.RoutingState`;
    docs/pclr.md). Train the current task's ranks with any optimizer, adding :meth:`query_loss` to the loss so the
    keys learn; run the task cycle with :meth:`begin_task` / :meth:`end_task` (docs/task_cycle.md).

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
            stacks = encoder_decoder_stacks(self.model)
            state.attach(self.model, None if stacks is None else stacks[0])
        return state

    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        # PeftModel.forward and PeftModel.generate both run inside this context: one routing session per call, so
        # every forward pass of one generate call routes by the prompt's query (with or without the KV cache).
        with self._routing_state().session(), super()._enable_peft_forward_hooks(*args, **kwargs):
            yield

    @property
    def routing_state(self) -> RoutingState:
        """The routing state shared by this model's PCLR layers (query, selections, query losses)."""
        return self._routing_state()

    def set_query_fn(self, query_fn: QueryFn) -> None:
        """Replace the default query (:func:`~.query.default_query`) with ``query_fn(model, args, kwargs)``.

        Args:
            query_fn: Returns the (batch, query_dim) query for a forward call of the wrapped model, or ``None``: the
                pooled input of the first adapted layer, for a model without token or patch inputs.
        """
        if not callable(query_fn):
            raise TypeError(f"`query_fn` must be callable, got {type(query_fn).__name__}")
        self._routing_state().query_fn = query_fn

    def _query_dim(self, config: PCLRConfig, target: nn.Module) -> int:
        if config.query_dim is not None:
            return config.query_dim
        source = query_source(self.model)
        if source is not None:
            return source.dim
        state = self._routing_state()
        if state.query_layer is not None:
            return state.query_layer.in_features
        # neither token nor patch inputs: this target, the first adapted layer, will give the query
        return target.in_features if isinstance(target, PCLRLayer) else _get_in_out_features(target)[0]

    def _designate_query_layer(self, layer: PCLRLayer, current_key: str) -> None:
        # A model without token or patch inputs routes by the pooled input of its first adapted layer (module order,
        # the order PEFT creates the layers in): docs/pclr.md, "Routing query by architecture".
        state = self._routing_state()
        if state.query_layer is not None or query_source(self.model) is not None:
            return
        state.attach_query_layer(layer, current_key)

    def _update_target(self, target: PCLRLayer, peft_config: PCLRConfig, adapter_name: str, current_key: str) -> None:
        query_dim = self._query_dim(peft_config, target)
        target.update_layer(adapter_name, peft_config, query_dim, inference_mode=peft_config.inference_mode)
        self._designate_query_layer(target, current_key)

    def _new_layer(self, peft_config: PCLRConfig, adapter_name: str, target: nn.Module, current_key: str) -> Linear:
        query_dim = self._query_dim(peft_config, target)
        match = re.match(peft_config.group_pattern, current_key)
        group = match.group(1) if match else current_key
        layer = Linear(target, adapter_name, peft_config, query_dim, group, self._routing_state(), name=current_key)
        self._designate_query_layer(layer, current_key)
        return layer

    def query_loss(self) -> Optional[torch.Tensor]:
        """The weighted query-key loss of the last forward pass (``None`` if no trainable key was routed)."""
        loss = self._routing_state().pop_loss()
        if loss is None:
            return None
        return self.peft_config[self.active_adapters[0]].query_loss_weight * loss

    # --- the task cycle (docs/task_cycle.md) ------------------------------------------------------------------------

    def _resolve_adapter(self, adapter_name: Optional[str]) -> str:
        return resolve_cycle_adapter(self, adapter_name, PCLRConfig, "PCLR")

    def finished_tasks(self, adapter_name: Optional[str] = None) -> int:
        """Number of tasks finished with ``end_task`` (the 0-based index of the task in progress).

        Args:
            adapter_name: The PCLR adapter (default: the single active one).
        """
        name = self._resolve_adapter(adapter_name)
        tasks = {layer.counts(name)[TASK] for layers in group_layers(self, name).values() for layer in layers}
        if len(tasks) != 1:
            raise ValueError(f"adapter {name!r}: layers disagree on the number of finished tasks ({sorted(tasks)})")
        return tasks.pop()

    def task_state(self, adapter_name: Optional[str] = None) -> dict[str, dict[str, int]]:
        """Per layer group: static and new ranks, stored prototypes and the task in progress.

        Args:
            adapter_name: The PCLR adapter (default: the single active one).
        """
        name = self._resolve_adapter(adapter_name)
        return {
            group: dict(zip(("static", "new", "prototypes", "task"), layers[0].counts(name)))
            for group, layers in group_layers(self, name).items()
        }

    def query_prototype(self, batches: Sequence[Batch]) -> torch.Tensor:
        """The task's prototype: the normalized mean routing query over ``batches`` (all-reduced under DDP).

        Args:
            batches: The task's input batches (as passed to the model; a ``labels`` entry is ignored).
        """
        return query_prototype(self, batches)

    def _reject_zero3(self, adapter: str, method: str) -> None:
        # the cycle writes rows of the pool's parameters (new ranks, keys) and reads them whole: a ZeRO-3 partition is
        # neither (FSDP2 shards are gathered and written back instead)
        names = ("pclr_A", "pclr_B", "pclr_keys", "pclr_shared_A", "pclr_shared_B")
        named = (
            (f"{key}.{name}.{adapter}", getattr(layer, name)[adapter])
            for key, layer in self.model.named_modules()
            if isinstance(layer, PCLRLayer)
            for name in names
            if adapter in getattr(layer, name)
        )
        reject_zero3(named, f"PCLR {method}")

    @staticmethod
    def _cycle(cycle: Optional[PCLRCycleConfig], overrides: dict[str, Any]) -> PCLRCycleConfig:
        cycle = cycle if cycle is not None else PCLRCycleConfig()
        if not isinstance(cycle, PCLRCycleConfig):
            raise TypeError(f"`cycle` must be a PCLRCycleConfig or None, got {type(cycle).__name__}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(PCLRCycleConfig)})
        if unknown:
            raise TypeError(
                f"unknown task-cycle setting(s) {unknown}; valid: {[f.name for f in dataclasses.fields(cycle)]}"
            )
        return dataclasses.replace(cycle, **overrides) if overrides else cycle

    @torch.no_grad()
    def begin_task(
        self,
        task_id: int,
        prototype: torch.Tensor,
        adapter_name: Optional[str] = None,
        *,
        cycle: Optional[PCLRCycleConfig] = None,
        **overrides: Any,
    ) -> int:
        """Start learning task ``task_id``: make room, add its trainable ranks, initialize them and their keys.

        A fresh adapter is already learning task 0 (random keys); calling this for task 0 re-initializes those ranks
        from the prototype. For later tasks the previous one must have ended (:meth:`end_task`).

        Under ``torch.distributed`` the new ranks and keys (drawn from each process's random generator) are broadcast
        from rank 0, so the processes start the task identical even when their generators differ.

        Args:
            task_id: The task, counted from 0 (tasks run in order: it must equal :meth:`finished_tasks`).
            prototype: (query_dim,) the task's query prototype (:meth:`query_prototype`).
            adapter_name: The PCLR adapter (default: the single active one).
            cycle: The cycle's settings (only ``key_noise`` is used here); default :class:`PCLRCycleConfig`.
            **overrides: Single :class:`PCLRCycleConfig` fields, e.g. ``key_noise=0.1``.

        Returns:
            The number of new ranks.
        """
        adapter = self._resolve_adapter(adapter_name)
        self._reject_zero3(adapter, "begin_task")
        key_noise = self._cycle(cycle, overrides).key_noise
        config = self.peft_config[adapter]
        groups = group_layers(self, adapter)
        first = next(iter(groups.values()))[0]
        n_new, current = first.counts(adapter)[N_NEW], first.counts(adapter)[TASK]
        if task_id != current:
            raise ValueError(f"begin_task({task_id}) but the adapter expects task {current} next (tasks run in order)")
        if task_id > 0 and n_new > 0:
            raise ValueError(
                f"task {task_id} began while {n_new} ranks of task {task_id - 1} are still new; call end_task"
            )
        count = config.ranks_for_task(task_id)
        overflow = max(layer.counts(adapter)[N_STATIC] for layers in groups.values() for layer in layers) + count
        overflow -= config.pool_size
        if overflow > 0:
            # The schedule did not leave enough room (e.g. a shortened schedule): compress the static pool further
            # without integration rather than ever exceeding the cap.
            compress(self, overflow, adapter=adapter, only_static=True)
        proto = F.normalize(prototype.detach().float().flatten(), dim=0)
        for layers in groups.values():
            owner = layers[0]
            keys_static = owner.static_keys(adapter)
            n_s, dim = keys_static.shape
            if proto.numel() != dim:
                raise ValueError(f"`prototype` has {proto.numel()} entries but the keys have width {dim}")
            source: list[int] = []
            if config.init_from_static and n_s > 0:
                scores = F.normalize(keys_static.float(), dim=-1) @ proto.to(keys_static.device)
                source = scores.topk(min(count, n_s)).indices.tolist()
            device = owner.pclr_keys[adapter].device
            # relative to the unit prototype: the noise's expected norm is key_noise, so a new key's cosine to the
            # prototype is about 1 / sqrt(1 + key_noise^2) (0.9988 at 0.05) whatever the query width. Per-coordinate
            # noise of key_noise would have norm key_noise * sqrt(dim): at width 384 about as long as the prototype,
            # cosine 0.71, so the new keys would lose the top-k to the trained static keys and the new ranks would
            # hardly train (docs/pclr.md, "Why new tasks learnt poorly").
            noise = torch.randn(count, dim, device=device) * (key_noise / math.sqrt(dim))
            keys = F.normalize(proto.to(device) + noise, dim=-1)
            # drawn from each process's generator: rank 0's draw for all, before it is written (under FSDP2 each
            # process then writes its own shard of the same values)
            broadcast_([keys])
            for layer in layers:
                A_static = layer.static_ranks(adapter)[0]
                A = torch.randn(count, A_static.shape[1], device=A_static.device) / math.sqrt(A_static.shape[1])
                if source:
                    # Copy the directions a_i of the matching old ranks, not b_i: copying both would add their output
                    # a second time; with b_i = 0 the model's function is unchanged when the task starts (LoRA's
                    # init).
                    A[: len(source)] = A_static[source]
                broadcast_([A])
                layer.begin_new_ranks(adapter, task_id, A, keys if layer is owner else None)
        return count

    def end_task(
        self,
        task_id: int,
        prototype: torch.Tensor,
        batches: Sequence[Batch] = (),
        adapter_name: Optional[str] = None,
        *,
        cycle: Optional[PCLRCycleConfig] = None,
        forward: Optional[Callable[[nn.Module, Batch], Any]] = None,
        mask: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
        **overrides: Any,
    ) -> Optional[IntegrateResult]:
        """Finish task ``task_id``: store its prototype, compress + integrate if scheduled, fold the new ranks, pull
        keys.

        The number of ranks dropped is ``round(compress_ratio_after(task_id) * active ranks)``, raised if needed so
        the next task's new ranks fit within ``pool_size``, and never all of them (:func:`drop_count`).

        Args:
            task_id: The task that just finished training.
            prototype: (query_dim,) its query prototype.
            batches: The task's data for integration (empty: compress without integrating).
            adapter_name: The PCLR adapter (default: the single active one).
            cycle: The cycle's settings (distillation, key pulling); default :class:`PCLRCycleConfig`.
            forward: ``forward(model, batch) -> output`` for the distillation; default ``model(**batch)`` without
                ``labels``.
            mask: Optional bool mask of the logits that take part in distillation.
            generator: Random generator for the task draws of ``"tasks"`` routing.
            **overrides: Single :class:`PCLRCycleConfig` fields (``integrate_epochs=0``, ``integrate_lr=...``, ...),
                applied over ``cycle``.

        Returns:
            The integration result, or ``None`` when nothing was compressed or integrated.
        """
        settings = self._cycle(cycle, overrides)
        adapter = self._resolve_adapter(adapter_name)
        self._reject_zero3(adapter, "end_task")
        config = self.peft_config[adapter]
        if config.compress_rule in MEASURED_RULES and not batches:
            raise ValueError(
                f"compress_rule={config.compress_rule!r} measures the ranks on the task's data: pass `batches`"
            )
        groups = group_layers(self, adapter)
        current = self.finished_tasks(adapter)
        if task_id != current:
            raise ValueError(f"end_task({task_id}) but the adapter is learning task {current}")
        if task_id >= config.max_tasks:
            raise ValueError(f"task {task_id} exceeds max_tasks={config.max_tasks} stored prototypes; raise max_tasks")
        n_active = max(sum(layer.counts(adapter)[:2]) for layers in groups.values() for layer in layers)
        n_drop = drop_count(config, task_id, n_active)
        proto = F.normalize(prototype.detach().float().flatten(), dim=0)
        for layers in groups.values():
            for layer in layers:
                layer.store_prototype(adapter, task_id, proto)
        result = None
        if n_drop > 0:
            # the cycle's forward passes (on `batches`) call this tuner, below an FSDP2 root on the PeftModel: gather
            # the root's own parameters for them
            with gathered_parameters(self) if batches else nullcontext():
                result = self._compress_and_integrate(adapter, n_drop, batches, settings, forward, mask, generator)
        fold_new_ranks(self, adapter)
        pull_keys_to_prototypes(self, adapter, settings.key_pull_threshold, settings.key_pull_strength)
        for layers in groups.values():
            for layer in layers:
                layer.finish_task(adapter, task_id)
        return result

    def _compress_and_integrate(
        self,
        adapter: str,
        n_drop: int,
        batches: Sequence[Batch],
        settings: PCLRCycleConfig,
        forward: Optional[Callable[[nn.Module, Batch], Any]],
        mask: Optional[torch.Tensor],
        generator: Optional[torch.Generator],
    ) -> Optional[IntegrateResult]:
        by_tasks = settings.integrate_routing == "tasks"
        integrating = bool(batches) and settings.integrate_epochs > 0
        rule = self.peft_config[adapter].compress_rule
        measured = rule in MEASURED_RULES
        # The contribution pass runs the uncompressed pool on every batch routed as every stored task: exactly the
        # teacher's forward passes (the current task routed by its own queries, as `integrate` routes it). Its
        # outputs are kept for the distillation, which then runs the teacher only for pairs it could not keep.
        kept = KeptOutputs() if integrating and measured else None
        teacher: Any = None
        if integrating and by_tasks:
            teacher = PoolSnapshot(self, adapter)
        scores = None
        if measured:
            keep = None if kept is None else kept.offer
            aggregate = MEASURED_RULES[rule]
            scores = contribution_scores(self, batches, adapter, forward, aggregate=aggregate, on_output=keep)
        if integrating and not by_tasks:
            current = len(stored_prototypes(self, adapter)) - 1
            teacher = kept.batches(current, len(batches)) if kept is not None else None
            if teacher is None:
                teacher = teacher_outputs(self, batches, forward)
        compress(self, n_drop, adapter=adapter, scores=scores)
        if not integrating:
            return None
        options = IntegrateOptions(
            epochs=settings.integrate_epochs,
            lr=settings.integrate_lr,
            temperature=settings.temperature,
            top_logits=settings.top_logits,
            forward=forward,
            mask=mask,
            measure=settings.measure_integration,
        )
        if by_tasks:
            known = None if kept is None else kept.outputs
            return integrate_over_tasks(
                self, batches, teacher, adapter, options=options, generator=generator, known_outputs=known
            )
        return integrate(self, batches, teacher, adapter, options=options)
