"""The PCLR layer: a linear with a capped pool of rank-1 components routed per sample, plus an optional shared LoRA.

Per adapter the layer holds (``N_s`` static and ``N_n`` new ranks in use; docs/methods.md (PCLR))

- ``pclr_A_static`` (pool_size x in), ``pclr_B_static`` (pool_size x out): frozen ranks of finished tasks (buffers,
  so no optimizer or ``set_adapter`` can make them trainable); rows ``>= N_s`` are unused;
- ``pclr_A`` (new_capacity x in), ``pclr_B`` (new_capacity x out): the current task's trainable ranks;
- ``pclr_shared_A`` (shared_r x in), ``pclr_shared_B`` (out x shared_r): the always-on shared LoRA;
- ``pclr_rank_task`` (pool_size + new_capacity): the task each slot belongs to (-1: empty);
- ``pclr_counts``: ``[N_s, N_n, tasks with a stored prototype, current task]``;
- on the first layer of each layer group only (the group's *owner*): ``pclr_keys_static`` / ``pclr_keys`` (the keys,
  same layout as the ranks) and ``pclr_prototypes`` (max_tasks x d).

Ranks are stored rank-major (one row per rank), so gathering a subset reads contiguous rows. The group's per-sample
selection indexes the pool of ``N = N_s + N_n`` ranks (static first); the forward pass gathers from it with
:func:`peft_ext.kernels.rank_pool_gather_stores`, which reads both stores as one pool (one gather of the ``K`` slots,
not one per store) and gives the static ranks no gradient. The counts live on the host
(``pclr_host_counts``); ``pclr_counts`` mirrors them for checkpoints and is read back on load. Only the pool API
(:class:`~.store.RankPoolStore`: ``begin_new_ranks``, ``drop_ranks``, ``fold_new_ranks``, ``store_prototype``,
``set_static_keys``, ``finish_task``, ``load_pool_tensors``) writes into the stores.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from ...kernels import rank_pool_gather, rank_pool_gather_shared, rank_pool_gather_stores
from ...precision import is_half
from ..adapter_layer import AdapterLayer, AdapterLinear
from .config import PCLRConfig
from .router import RoutingState
from .selection import allowed_by_prototype, copy_blocks, per_sample, route
from .store import N_NEW, N_PROTOS, N_STATIC, TASK, RankPoolStore

__all__ = ["N_NEW", "N_PROTOS", "N_STATIC", "TASK", "Linear", "PCLRLayer"]


def _restore_host_counts(module: nn.Module, incompatible_keys: Any) -> None:
    # load_state_dict post hook: the loaded pclr_counts buffers become the host-side counts the forward reads
    module.restore_counts()


class PCLRLayer(AdapterLayer, RankPoolStore):
    """State and delta math of a layer carrying PCLR adapters (see the module docstring); the pool API comes from
    :class:`~.store.RankPoolStore`, forward dispatch, mixed batches and merging from the adapter skeleton."""

    method_name = "PCLR"
    adapter_dict_name = "pclr_A"

    adapter_layer_names: tuple[str, ...] = ("pclr_A", "pclr_B", "pclr_keys", "pclr_shared_A", "pclr_shared_B")
    adapter_buffer_names: tuple[str, ...] = (
        "pclr_A_static",
        "pclr_B_static",
        "pclr_keys_static",
        "pclr_rank_task",
        "pclr_counts",
        "pclr_prototypes",
    )
    other_param_names: tuple[str, ...] = (
        *adapter_buffer_names,
        "pclr_host_counts",
        "pclr_scale",
        "pclr_top_k",
        "pclr_shared_scale",
        "pclr_prototype_routing",
    )

    def __init__(self, base_layer: nn.Module, **kwargs: Any) -> None:
        AdapterLayer.__init__(self, base_layer, **kwargs)  # the parameter and buffer dicts named above
        # The counts every forward needs, as python ints: the source of truth (pclr_counts mirrors them for
        # checkpoints and is read back into them on load), so no forward reads a tensor back to the host.
        self.pclr_host_counts: dict[str, list[int]] = {}
        self.pclr_scale: dict[str, float] = {}
        self.pclr_top_k: dict[str, int] = {}
        self.pclr_shared_scale: dict[str, float] = {}
        self.pclr_prototype_routing: dict[str, bool] = {}
        self.pclr_group = ""
        #: The layer's name in the model (for messages).
        self.pclr_name = ""
        self._pclr_state: Optional[RoutingState] = None

    def owns_keys(self, adapter_name: str) -> bool:
        """Whether this layer holds its group's keys and prototypes of ``adapter_name``."""
        state = self._pclr_state
        return state is not None and state.owners.get((self.pclr_group, adapter_name)) is self

    def group_owner(self, adapter_name: str) -> PCLRLayer:
        """The layer holding this layer's group keys and prototypes of ``adapter_name``."""
        state = self._pclr_state
        if state is None or (self.pclr_group, adapter_name) not in state.owners:
            raise ValueError(
                f"PCLR layer of group {self.pclr_group!r} has no key owner for adapter {adapter_name!r}; it is not "
                "attached to a PCLR model"
            )
        return state.owners[(self.pclr_group, adapter_name)]

    def update_layer(
        self, adapter_name: str, config: PCLRConfig, query_dim: int, inference_mode: bool = False
    ) -> None:
        """Add (or re-create) adapter ``adapter_name``: an empty static pool and task 0's new ranks.

        Args:
            adapter_name: Name of the adapter.
            config: Its configuration.
            query_dim: Width of the routing query (keys are created on the group owner only).
            inference_mode: Create it frozen.
        """
        n, m = self.in_features, self.out_features
        cap, new_cap, n_new = config.pool_size, config.new_capacity, config.ranks_for_task(0)
        self.pclr_scale[adapter_name] = config.scale
        self.pclr_top_k[adapter_name] = config.top_k
        self.pclr_prototype_routing[adapter_name] = config.prototype_routing
        self.pclr_A_static[adapter_name] = torch.zeros(cap, n)
        self.pclr_B_static[adapter_name] = torch.zeros(cap, m)
        A = torch.zeros(new_cap, n)
        A[:n_new] = torch.randn(n_new, n) / math.sqrt(n)
        B = torch.zeros(new_cap, m)
        if not config.init_weights:
            B[:n_new] = torch.randn(n_new, m) / math.sqrt(n_new)
        self.pclr_A[adapter_name] = nn.Parameter(A)
        self.pclr_B[adapter_name] = nn.Parameter(B)
        tags = torch.full((cap + new_cap,), -1, dtype=torch.long)
        tags[cap : cap + n_new] = 0
        self.pclr_rank_task[adapter_name] = tags
        self.pclr_counts[adapter_name] = torch.tensor([0, n_new, 0, 0], dtype=torch.long)
        self.pclr_host_counts[adapter_name] = [0, n_new, 0, 0]
        if config.shared_r > 0:
            r = config.shared_r
            self.pclr_shared_A[adapter_name] = nn.Parameter(torch.randn(r, n) / math.sqrt(n))
            shared_B = torch.zeros(m, r) if config.init_weights else torch.randn(m, r) / math.sqrt(r)
            self.pclr_shared_B[adapter_name] = nn.Parameter(shared_B)
            self.pclr_shared_scale[adapter_name] = config.shared_alpha / r
        if self._pclr_state is not None:
            # The first layer of the group that gets this adapter holds the group's keys (an adapter may target only
            # some of a block's linears, so ownership is per adapter).
            self._pclr_state.owners.setdefault((self.pclr_group, adapter_name), self)
        if self.owns_keys(adapter_name):
            keys = torch.zeros(new_cap, query_dim)
            keys[:n_new] = nn.functional.normalize(torch.randn(n_new, query_dim), dim=-1)
            self.pclr_keys[adapter_name] = nn.Parameter(keys)
            self.pclr_keys_static[adapter_name] = torch.zeros(cap, query_dim)
            self.pclr_prototypes[adapter_name] = torch.zeros(config.max_tasks, query_dim)
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def after_adapter_cast(self, adapter_name: str, autocast_adapter_dtype: bool) -> None:
        """Task prototypes stay float32 on a half-precision base: each is a task's mean query, kept for the rest of
        the task sequence, and bfloat16 would round it to three significant digits once and for all. Ranks, keys and
        static pools follow PEFT's ``autocast_adapter_dtype`` like LoRA's weights.

        Args:
            adapter_name: The adapter.
            autocast_adapter_dtype: The flag PEFT's cast got.
        """
        protos = self.pclr_prototypes
        if adapter_name in protos and is_half(protos[adapter_name].dtype):
            protos[adapter_name] = protos[adapter_name].float()

    def selection(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward pass's per-sample ``(indices, gates)`` for the group (computed once per group and pass).

        Args:
            adapter_name: The adapter.
        """
        state = self._pclr_state
        if state is None:
            raise ValueError(f"PCLR layer of group {self.pclr_group!r} is not attached to a PCLR model")
        cache_key = (self.pclr_group, adapter_name)
        if cache_key in state.selections:
            return state.selections[cache_key]
        query = state.require_query()
        keys = self.keys(adapter_name)
        if query.shape[-1] != keys.shape[-1]:
            raise ValueError(
                f"the routing query has width {query.shape[-1]} but adapter {adapter_name!r}'s keys have width "
                f"{keys.shape[-1]} (PCLRConfig.query_dim): make the query function return (batch, {keys.shape[-1]}) "
                "or set query_dim to the query's width"
            )
        allowed = None
        if self.pclr_prototype_routing[adapter_name]:
            allowed = allowed_by_prototype(query, self.prototypes(adapter_name), self.active_rank_task(adapter_name))
        indices, gates, loss = route(query, keys, self.pclr_top_k[adapter_name], allowed)
        state.selections[cache_key] = (indices, gates)
        if loss is not None:
            state.losses.append(loss)
        return indices, gates

    def adapter_output(self, x: torch.Tensor, adapter_name: str, rows: Optional[list[int]] = None) -> torch.Tensor:
        # A mixed-adapter batch passes this adapter's samples only: select for the whole batch (one query per
        # sample) and keep those samples, so each routes exactly as it would alone.
        indices, gates = self.selection(adapter_name)
        if rows is not None:
            indices, gates = indices[rows], gates[rows]
        # (samples, ..., in): a layer fed flattened tokens (batch x seq, in) routes each row by its sample's query
        samples = per_sample(x, indices.shape[0], self.pclr_name or self.pclr_group)
        # One gather over the pool [static..., new...], whose indices the selection gives (in range: the router's
        # top-K over this pool's own keys, so no range check and its host read). rank_pool_gather_stores reads both
        # stores without a concatenated copy in the graph, and no gradient is computed for the static ranks.
        state = self._pclr_state
        if rows is None and state.recorder is not None:
            state.recorder(self, adapter_name, samples, *self.pool(adapter_name), indices, gates)
        scale, gates = self.pclr_scale[adapter_name], gates.to(x.dtype)
        copies = state.routed_copies if rows is None else None
        if copies is None:
            static, new = self.static_ranks(adapter_name), self.new_ranks(adapter_name)
            out = rank_pool_gather_stores(samples, static, new, indices, scale, gates)
        else:
            A, B = self.pool(adapter_name)
            out = torch.cat(
                [
                    rank_pool_gather(part, A.mT, B, index, scale, gate, check_range=False)
                    if shared is None
                    else rank_pool_gather_shared(part, A.mT, B, index[0], scale, gate[0])
                    for part, index, gate, shared in copy_blocks(samples, indices, gates, copies)
                ]
            )
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        if adapter_name in self.pclr_shared_A:
            shared_A, shared_B = self.pclr_shared_A[adapter_name], self.pclr_shared_B[adapter_name]
            out = out + (x @ shared_A.mT) @ shared_B.mT * self.pclr_shared_scale[adapter_name]
        return out

    # -- merging -------------------------------------------------------------------------------------------------

    def routing_is_static(self, adapter_name: str) -> bool:
        """Whether every input selects every active rank, so the adapter equals one fixed weight delta.

        True when ``top_k`` covers the pool and prototype routing cannot exclude any rank (every rank belongs to
        task 0 or to a task without a stored prototype).
        """
        n_s, n_n, n_protos, _ = self.counts(adapter_name)
        if self.pclr_top_k[adapter_name] < n_s + n_n:
            return False
        if not self.pclr_prototype_routing[adapter_name] or n_protos == 0:
            return True
        tags = self.active_rank_task(adapter_name)
        return bool(((tags <= 0) | (tags >= n_protos)).all())

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The adapter's weight delta (out x in) when routing is static (see :meth:`routing_is_static`).

        Args:
            adapter_name: The adapter.

        Raises:
            ValueError: If routing depends on the input; a merged weight could not reproduce it.
        """
        if not self.routing_is_static(adapter_name):
            n_s, n_n = self.counts(adapter_name)[:2]
            raise ValueError(
                f"PCLR adapter {adapter_name!r} routes each input to its own {self.pclr_top_k[adapter_name]} of "
                f"{n_s + n_n} ranks, so no single weight delta reproduces it; merging needs top_k >= the number of "
                "active ranks and no prototype restriction"
            )
        A, B = self.pool(adapter_name)
        compute = torch.float32 if A.device.type == "cpu" and A.dtype in (torch.float16, torch.bfloat16) else A.dtype
        delta = self.pclr_scale[adapter_name] * (B.to(compute).mT @ A.to(compute))
        if adapter_name in self.pclr_shared_A:
            shared = self.pclr_shared_B[adapter_name].to(compute) @ self.pclr_shared_A[adapter_name].to(compute)
            delta = delta + self.pclr_shared_scale[adapter_name] * shared
        return delta.to(A.dtype)


class Linear(AdapterLinear, PCLRLayer):
    """A ``torch.nn.Linear`` (or a bitsandbytes ``Linear8bitLt`` / ``Linear4bit``) with PCLR adapters.

    Args:
        base_layer: The layer to adapt.
        adapter_name: Name of the first adapter.
        config: Its configuration.
        query_dim: Width of the routing query.
        group: The layer group (all linears of one block share keys and selection).
        state: The model's routing state.
        name: The layer's name in the model (for messages).
    """

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: PCLRConfig,
        query_dim: int,
        group: str,
        state: RoutingState,
        name: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        PCLRLayer.__init__(self, base_layer, **kwargs)
        self.pclr_group = group
        self.pclr_name = name
        self._pclr_state = state
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, query_dim, inference_mode=config.inference_mode)
        self.register_load_state_dict_post_hook(_restore_host_counts)
