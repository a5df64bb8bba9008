"""A SplitLoRA layer's input statistics: the task in progress's, the running ones, and their sharding under FSDP2.

:class:`LayerStatistics` is the part of ``SplitLoRALayer`` that collects inputs (``accumulate_statistics``), reduces
them over processes (``reduced_statistics``) and folds them into the running statistics (``add_statistics``). Modules
fed the same input hold one accumulator of the task in progress between them (:mod:`.sharing`; :func:`add_rows`
does the per-input work once).

Two layouts:

- replicated (one process, DDP, and FSDP2 with ``shard_statistics=False``): every process holds the whole running
  statistics and collects its own inputs' increment; ``end_task`` all-reduces the increment (the sketches are merged).
- sharded over the input features (FSDP2, ``shard_statistics=True``): each process holds its share of the features,
  a row block of the covariance (``Shard(0)``) or a column block of the sketch (``Shard(1)``), as DTensors of the
  model's mesh. Each batch's inputs are reduced at once: the covariance increment is reduce-scattered, and for a
  sketch every process receives every process's rows restricted to its features (an all-to-all) and streams them
  into its columns of one sketch whose shrinks sum their Gram matrix over the processes. So the sketch is the one a
  single process would keep for the concatenated batch, not a merge of per-process sketches, and each process holds
  ``1 / world`` of it (the buffer of the task in progress too).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ...distributed import full_tensor, is_dtensor
from ...distributed.features import FeatureShards
from .covariance import accumulate_covariance_lower, fd_append, symmetrize_lower_
from .subspace import covariance_spectrum, sketch_spectrum
from .task import distributed_group

__all__ = ["LayerStatistics", "add_rows", "statistics_mesh"]


def statistics_mesh(b: torch.Tensor) -> Any:
    """The 1-D device mesh of more than one process that an FSDP2-sharded ``B`` lives on, else ``None`` (the
    statistics stay replicated: one process, DDP, or a mesh of several dimensions)."""
    if not is_dtensor(b):
        return None
    mesh = b.device_mesh
    return mesh if mesh.ndim == 1 and mesh.size() > 1 else None


@torch.no_grad()
def add_rows(
    accumulators: list[dict[str, torch.Tensor]],
    rows: torch.Tensor,
    in_features: int,
    dtype: torch.dtype,
    shards: Optional[FeatureShards] = None,
) -> None:
    """Add one input's rows to each of ``accumulators`` (the task in progress's statistics of modules fed that input),
    doing the per-input work once: the energy, the dense product ``rows^T rows`` (and its reduce-scatter when
    sharded), the sharded sketch's exchange of rows; only the sketch's append (and its shrinks) is per accumulator.

    Every accumulator ends as it would after adding ``rows`` on its own (bit for bit for sketches; dense sums to the
    rounding of one addition). Sharded, this is a collective (see ``LayerStatistics.accumulate_statistics``).

    Args:
        accumulators: Distinct accumulators of one kind, dtype, device and sharding (``statistics_signature``).
        rows: Inputs, one token per row, reshaped to ``(N, in_features)``.
        in_features: The input width.
        dtype: The statistics' dtype (the adapter dtype).
        shards: The features' split, when the statistics are sharded.
    """
    first = accumulators[0]
    rows = rows.detach().reshape(-1, in_features).to(device=first["tokens"].device, dtype=dtype)
    if rows.shape[0] == 0 and shards is None:
        return
    # summed in the adapter dtype (a float64 copy of every batch costs as much as the covariance update itself);
    # only the running total is float64
    energy = rows.square().sum().to(torch.float64)
    for pending in accumulators:
        pending["tokens"] += rows.shape[0]
        pending["energy"] += energy
    if "cov" in first:
        # only the lower block triangle is multiplied (half the products); replicated sums are mirrored once by
        # reduced_statistics, a sharded one per batch before its rows are scattered
        if shards is None and len(accumulators) == 1:
            accumulate_covariance_lower(first["cov"], rows)  # in place: no n x n product apart
            return
        gram = torch.zeros(in_features, in_features, dtype=dtype, device=rows.device)
        accumulate_covariance_lower(gram, rows)
        if shards is not None:
            gram = shards.reduce_scatter(symmetrize_lower_(gram))
        for pending in accumulators:
            pending["cov"].add_(gram)
        return
    if shards is not None:
        rows = shards.exchange(rows)
    for pending in accumulators:
        fill, delta = fd_append(pending["sketch"], int(pending["fill"]), rows, shards)
        pending["fill"].fill_(fill)
        pending["error"] += delta


class LayerStatistics:
    """Input statistics of ``SplitLoRALayer`` (a mixin: the layer owns the buffers named here)."""

    splitlora_B: Any
    splitlora_cov: Any
    splitlora_sketch: Any
    splitlora_sketch_error: Any
    splitlora_tokens: Any
    splitlora_energy: Any
    in_features: int
    _splitlora_pending: dict[str, dict[str, torch.Tensor]]
    _splitlora_shards: dict[str, FeatureShards]
    _splitlora_shared: set[str]
    _splitlora_seed_key: str
    _adapter_dtype: Any
    _adapter_device: Any

    def statistics_kind(self, adapter_name: str) -> str:
        """``"dense"`` or ``"sketch"``: how ``adapter_name`` keeps its running statistics here.

        Args:
            adapter_name: Name of the adapter.
        """
        return "dense" if adapter_name in self.splitlora_cov else "sketch"

    def has_pending_statistics(self, adapter_name: str) -> bool:
        """Whether statistics of the task in progress were collected and not yet folded in by ``end_task``.

        Args:
            adapter_name: Name of the adapter.
        """
        return adapter_name in self._splitlora_pending

    # --- sharding --------------------------------------------------------------------------------------------------

    def statistics_shards(self, adapter_name: str) -> Optional[FeatureShards]:
        """How ``adapter_name``'s statistics are split over processes here (``None``: whole on every process).

        Args:
            adapter_name: Name of the adapter.
        """
        return self._splitlora_shards.get(adapter_name)

    @torch.no_grad()
    def shard_statistics(self, adapter_name: str, mesh: Any) -> None:
        """Keep only this process's share of the input features of ``adapter_name``'s statistics from now on.

        The running statistics (identical on every process) become DTensors of ``mesh`` holding this process's row
        block of the covariance or column block of the sketch; no communication. A no-op when already sharded.

        Args:
            adapter_name: Name of the adapter.
            mesh: A 1-D device mesh (the FSDP2 model's).

        Raises:
            RuntimeError: If statistics of the task in progress were collected whole (before the model was sharded):
                finish that task (``end_task``) first.
        """
        if adapter_name in self._splitlora_shards:
            return
        if adapter_name in self._splitlora_pending:
            raise RuntimeError(
                f"SplitLoRA module {self._splitlora_seed_key!r} has statistics of the task in progress collected "
                "before the model was sharded; call end_task() before sharding it, or collect them again after"
            )
        shards = FeatureShards(mesh, self.in_features)
        if self.statistics_kind(adapter_name) == "dense":
            self.splitlora_cov[adapter_name] = shards.dtensor(shards.local(self.splitlora_cov[adapter_name], 0), 0)
        else:
            self.splitlora_sketch[adapter_name] = shards.dtensor(
                shards.local(self.splitlora_sketch[adapter_name], 1), 1
            )
        self._splitlora_shards[adapter_name] = shards

    def local_statistics(self, adapter_name: str) -> torch.Tensor:
        """This process's part of the running covariance or sketch (the whole tensor when replicated).

        Args:
            adapter_name: Name of the adapter.
        """
        if self.statistics_kind(adapter_name) == "dense":
            running = self.splitlora_cov[adapter_name]
        else:
            running = self.splitlora_sketch[adapter_name]
        return running.to_local() if is_dtensor(running) else running

    # --- the task in progress --------------------------------------------------------------------------------------

    def _new_pending(self, adapter_name: str) -> dict[str, torch.Tensor]:
        dtype, device = self._adapter_dtype(), self._adapter_device()
        shards = self._splitlora_shards.get(adapter_name)
        n = self.in_features
        mine = n if shards is None else shards.local_size
        pending = {
            "tokens": torch.zeros((), dtype=torch.int64, device=device),
            "energy": torch.zeros((), dtype=torch.float64, device=device),
        }
        if self.statistics_kind(adapter_name) == "dense":
            pending["cov"] = torch.zeros(mine, n, dtype=dtype, device=device)  # sharded: this process's rows
        else:
            # a (2 l, n) buffer: new rows are appended and shrunk to l rows once per l rows (fd_append); "fill"
            # (rows in use) stays on the CPU so that reading it never waits for the device. Sharded: its columns.
            ell = self.splitlora_sketch[adapter_name].shape[0]
            pending["sketch"] = torch.zeros(2 * ell, mine, dtype=dtype, device=device)
            pending["fill"] = torch.zeros((), dtype=torch.int64)
            pending["error"] = torch.zeros((), dtype=torch.float64, device=device)
        return pending

    def statistics_signature(self, adapter_name: str) -> tuple:
        """What must match for two modules fed the same input to share one accumulator of the task in progress's
        statistics (:func:`add_rows`): the width, the kind, the dtype and device, the sketch's rows, the sharding.

        Args:
            adapter_name: Name of the adapter.
        """
        kind = self.statistics_kind(adapter_name)
        ell = 0 if kind == "dense" else self.splitlora_sketch[adapter_name].shape[0]
        shards = self._splitlora_shards.get(adapter_name)
        layout = None if shards is None else (id(shards.mesh), shards.size)
        return (self.in_features, kind, ell, self._adapter_dtype(), self._adapter_device(), layout)

    def pending_statistics(self, adapter_name: str) -> dict[str, torch.Tensor]:
        """The accumulator of the task in progress's statistics, created empty when there is none yet. Modules fed
        the same input may hold the very same one (``collect_statistics``); only :mod:`.sharing` writes to it then.

        Args:
            adapter_name: Name of the adapter.
        """
        if adapter_name not in self.splitlora_B:
            raise ValueError(f"no SplitLoRA adapter named {adapter_name!r} on {self._splitlora_seed_key!r}")
        pending = self._splitlora_pending.get(adapter_name)
        if pending is None:
            pending = self._splitlora_pending[adapter_name] = self._new_pending(adapter_name)
        return pending

    @torch.no_grad()
    def accumulate_statistics(self, adapter_name: str, rows: torch.Tensor) -> None:
        """Add inputs to the statistics of the task in progress (kept apart until ``end_task``'s
        :meth:`add_statistics`).

        Sharded (:meth:`shard_statistics`), this is a collective: every process calls it for the same modules in the
        same order (as FSDP2's forward does), with its own rows (possibly none). An accumulator shared with other
        modules (``collect_statistics`` shares one between modules fed the same input) is copied first, so that
        only this module's statistics change.

        Args:
            adapter_name: Name of the adapter.
            rows: Inputs, one token per row, reshaped to ``(N, in_features)``.
        """
        pending = self.pending_statistics(adapter_name)
        if adapter_name in self._splitlora_shared:
            self._splitlora_shared.discard(adapter_name)
            pending = self._splitlora_pending[adapter_name] = {key: value.clone() for key, value in pending.items()}
        add_rows([pending], rows, self.in_features, self._adapter_dtype(), self._splitlora_shards.get(adapter_name))

    def reduced_statistics(self, adapter_name: str, group: Any = None) -> dict[str, torch.Tensor]:
        """The task in progress's statistics, summed over all processes under ``torch.distributed``; changes nothing
        but the dense sum's upper triangle, mirrored from the lower one (the only one accumulated) to the same value.

        Every rank must call this for every layer in the same order (it runs collectives). Under
        ``torch.distributed`` the result is a reduced copy, so a refused ``end_task`` can be retried without counting
        other processes' tokens twice. Sharded, the covariance or sketch is already reduced (per batch); only the
        token count and the energy are summed here.

        Args:
            adapter_name: Name of the adapter.
            group: ``torch.distributed`` process group (default: the default group, when initialized).
        """
        pending = self._splitlora_pending.get(adapter_name)
        if pending is None:
            pending = self._new_pending(adapter_name)
        shards = self._splitlora_shards.get(adapter_name)
        if shards is not None:
            pending = dict(pending)
            for key in ("tokens", "energy"):
                pending[key] = shards.all_reduce_(pending[key].clone())
            return pending
        if "cov" in pending:
            symmetrize_lower_(pending["cov"])  # accumulated on the lower triangle only; idempotent
        sync, group = distributed_group(group)
        if not sync:
            return pending
        pending = {key: value.clone() for key, value in pending.items()}
        for key in ("tokens", "energy", "cov", "error"):
            if key in pending:
                dist.all_reduce(pending[key], group=group)
        if "sketch" in pending:
            # Frequent-directions sketches merge by stacking and compressing (Ghashami et al. 2016, sec. 3):
            # every rank gathers the same stack, so every rank computes the same merged sketch.
            parts = [torch.empty_like(pending["sketch"]) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, pending["sketch"].contiguous(), group=group)
            pending["sketch"] = torch.cat(parts)
        return pending

    @torch.no_grad()
    def add_statistics(
        self,
        adapter_name: str,
        pending: dict[str, torch.Tensor],
        sketch: Optional[torch.Tensor] = None,
        sketch_error: Optional[torch.Tensor] = None,
    ) -> None:
        """Add (reduced) task statistics to the running ones and drop the task in progress's.

        Args:
            adapter_name: Name of the adapter.
            pending: :meth:`reduced_statistics`.
            sketch: Sketch statistics: the running sketch merged with the task's (``plan_task``; this process's
                columns when sharded).
            sketch_error: Its error bound, with ``sketch``.
        """
        self._splitlora_pending.pop(adapter_name, None)
        self._splitlora_shared.discard(adapter_name)
        # model.to(torch.bfloat16) casts these running sums too: back to their working dtypes before adding to them
        sums = (("splitlora_energy", "energy"), ("splitlora_cov", "cov"), ("splitlora_sketch_error", "error"))
        for attr, key in sums:
            container = getattr(self, attr)
            if key in pending and container[adapter_name].dtype != pending[key].dtype:
                container[adapter_name] = container[adapter_name].to(pending[key].dtype)
        self.splitlora_tokens[adapter_name] += pending["tokens"]
        self.splitlora_energy[adapter_name] += pending["energy"]
        shards = self._splitlora_shards.get(adapter_name)
        if "cov" in pending and shards is None:
            self.splitlora_cov[adapter_name] += pending["cov"]
            return
        if "cov" in pending:
            self.splitlora_cov[adapter_name] = shards.dtensor(self.local_statistics(adapter_name) + pending["cov"], 0)
            return
        self.splitlora_sketch[adapter_name] = sketch if shards is None else shards.dtensor(sketch, 1)
        self.splitlora_sketch_error[adapter_name] = sketch_error

    # --- reading the running statistics ----------------------------------------------------------------------------

    def covariance(self, adapter_name: str) -> torch.Tensor:
        """The running uncentered input covariance ``C`` (token-weighted mean over all finished tasks).

        For a sketch this is ``S^T S / tokens``, which differs from ``C`` by at most :meth:`statistics_error` in
        spectral norm (the bound is on ``S^T S`` itself; this float32 product of it rounds once more). Sharded, the
        statistics are gathered whole (a collective).

        Args:
            adapter_name: Name of the adapter.
        """
        tokens = int(self.splitlora_tokens[adapter_name])
        if tokens == 0:
            raise ValueError(f"no statistics yet for adapter {adapter_name!r} on {self._splitlora_seed_key!r}")
        if self.statistics_kind(adapter_name) == "dense":
            return full_tensor(self.splitlora_cov[adapter_name]) / tokens
        sketch = full_tensor(self.splitlora_sketch[adapter_name])
        return sketch.T @ sketch / tokens

    def statistics_error(self, adapter_name: str) -> float:
        """Certified spectral-norm bound on ``C_true - S^T S / tokens`` (0 for dense statistics), rounding included.

        Args:
            adapter_name: Name of the adapter.
        """
        if self.statistics_kind(adapter_name) == "dense":
            return 0.0
        tokens = max(int(self.splitlora_tokens[adapter_name]), 1)
        return float(self.splitlora_sketch_error[adapter_name]) / tokens

    def spectrum(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Eigenvalues (descending), eigenvectors and trace of the running statistics (sum scale); sharded, they are
        gathered whole first (a collective).

        Args:
            adapter_name: Name of the adapter.
        """
        if self.statistics_kind(adapter_name) == "dense":
            return covariance_spectrum(full_tensor(self.splitlora_cov[adapter_name]))
        sketch = full_tensor(self.splitlora_sketch[adapter_name])
        return sketch_spectrum(sketch, float(self.splitlora_energy[adapter_name]))
