"""One tensor dimension (a layer's input features) split over the processes of an FSDP2 mesh.

:class:`FeatureShards` holds the layout (``torch.chunk``'s, as DTensor's ``Shard`` and FSDP2 use: chunks of
``ceil(size / world)``, the last ones shorter or empty) and the collectives that keep per-feature statistics
sharded: each process's slice, the whole tensor gathered, a sum reduced and scattered, and token rows exchanged so
that each process gets every process's rows restricted to its own features. SplitLoRA keeps its input statistics
this way under FSDP2 (each process holds ``1 / world`` of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FeatureShards"]


@dataclass(frozen=True)
class FeatureShards:
    """``size`` features split over the processes of a one-dimensional device ``mesh``.

    Every method that communicates is a collective: every process of the mesh calls it, in the same order.

    Args:
        mesh: A 1-D ``DeviceMesh`` (an FSDP2 model's).
        size: The number of features (the split dimension's length).
    """

    mesh: Any
    size: int

    @cached_property
    def group(self) -> Any:
        return self.mesh.get_group()

    @cached_property
    def world(self) -> int:
        return self.mesh.size()

    @cached_property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def chunk(self) -> int:
        """Features per process before the last ones run short (``torch.chunk``'s chunk size)."""
        return -(-self.size // self.world)

    def bounds(self, rank: int | None = None) -> tuple[int, int]:
        """``(start, stop)`` of process ``rank``'s features (default: this process's)."""
        rank = self.rank if rank is None else rank
        start = min(rank * self.chunk, self.size)
        return start, min(start + self.chunk, self.size)

    @property
    def local_size(self) -> int:
        start, stop = self.bounds()
        return stop - start

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This process's slice of the whole tensor ``t`` along ``dim`` (a copy, contiguous)."""
        start, stop = self.bounds()
        return t.narrow(dim, start, stop - start).contiguous()

    def dtensor(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """A DTensor sharded along ``dim`` over the mesh whose local part is ``local`` (no communication)."""
        from torch.distributed.tensor import DTensor, Shard

        shape = list(local.shape)
        shape[dim] = self.size
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=tuple(stride)
        )

    def _padded(self, local: torch.Tensor) -> torch.Tensor:
        # all_gather_into_tensor / reduce_scatter_tensor need equal parts: pad this process's rows to the chunk
        if local.shape[0] == self.chunk:
            return local.contiguous()
        padded = local.new_zeros((self.chunk, *local.shape[1:]))
        padded[: local.shape[0]] = local
        return padded

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole tensor from every process's ``local`` slice along ``dim`` (an all-gather)."""
        rows = self._padded(local.movedim(dim, 0))
        out = rows.new_empty((self.world * self.chunk, *rows.shape[1:]))
        dist.all_gather_into_tensor(out, rows, group=self.group)
        return out[: self.size].movedim(0, dim).contiguous()

    def reduce_scatter(self, whole: torch.Tensor) -> torch.Tensor:
        """This process's rows (dim 0) of the sum of every process's ``whole`` (a reduce-scatter)."""
        padded = whole.new_zeros((self.world * self.chunk, *whole.shape[1:]))
        padded[: self.size] = whole
        out = whole.new_empty((self.chunk, *whole.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=self.group)
        return out[: self.local_size]

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the mesh's processes in place; returns ``t``."""
        dist.all_reduce(t, group=self.group)
        return t

    def exchange(self, rows: torch.Tensor) -> torch.Tensor:
        """Every process's token ``rows`` (``(N_p, size)``, ``N_p`` may differ) restricted to this process's features:
        ``(sum_p N_p, local_size)``, process 0's rows first (one all-gather of the counts, one all-to-all)."""
        counts = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
        every = counts.new_empty(self.world)
        dist.all_gather_into_tensor(every, counts, group=self.group)
        every = every.tolist()
        widths = [stop - start for start, stop in map(self.bounds, range(self.world))]
        send = torch.cat([rows[:, slice(*self.bounds(p))].reshape(-1) for p in range(self.world)])
        received = rows.new_empty(sum(every) * self.local_size)
        dist.all_to_all_single(
            received,
            send,
            output_split_sizes=[n * self.local_size for n in every],
            input_split_sizes=[rows.shape[0] * w for w in widths],
            group=self.group,
        )
        return received.reshape(sum(every), self.local_size)
