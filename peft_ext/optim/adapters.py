"""What the Riemannion optimizer needs from the layers that hold fixed-rank adapters, as an interface.

:class:`~peft_ext.optim.Riemannion` steps every adapter ``X = A B^T`` on the manifold of rank-r matrices. It needs, per
adapter, its three parameters (``A`` with orthonormal columns, ``B``, and the zero gradient probe ``Z``) and access to
the layer's cache of ``B_R = qr(B).Q``, which the forward pass and the step share. A layer offers these by
implementing :class:`FixedRankAdapters` (``peft_ext.tuners.riemannion.RiemannionLayer`` does); the optimizer finds
such layers with :func:`find_fixed_rank_adapters` and imports no tuner.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

from torch import Tensor, nn

__all__ = ["AdapterHandle", "FixedRankAdapters", "find_fixed_rank_adapters"]


@runtime_checkable
class FixedRankAdapters(Protocol):
    """A module holding one or more fixed-rank adapters ``X = A B^T`` that the Riemannion optimizer steps."""

    def fixed_rank_adapters(self) -> list[str]:
        """The names of the adapters this module holds."""

    def fixed_rank_factors(self, adapter_name: str) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
        """``(A, B, Z)`` of an adapter: ``A`` (m x r, orthonormal columns), ``B`` (n x r) and the zero probe ``Z``
        (m x r) whose gradient is ``G B_R``."""

    def cached_right_basis(self, adapter_name: str) -> Optional[Tensor]:
        """``B_R = qr(B).Q`` of the adapter's current ``B`` as the forward pass uses it, or ``None`` when this module
        keeps no cache (the optimizer then computes the same deterministic QR itself)."""

    def store_right_basis(self, adapter_name: str, B_R: Tensor) -> None:
        """Cache ``B_R`` for the ``B`` just written (the retraction computed it), so the next forward reuses it; a
        module that keeps no cache ignores it."""

    def stop_caching_right_basis(self) -> None:
        """Recompute ``B_R`` in every forward from now on: for ``B`` that FSDP2 refills in place without bumping its
        version counter, which a cache keyed on the version could not see."""


@dataclass(frozen=True)
class AdapterHandle:
    """One adapter of a model, as the optimizer sees it.

    Args:
        layer_name: Qualified name of its module in the model (for messages).
        adapter_name: The adapter's name in that module.
        module: The module, which implements :class:`FixedRankAdapters`.
    """

    layer_name: str
    adapter_name: str
    module: FixedRankAdapters

    @property
    def factors(self) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
        """``(A, B, Z)``."""
        return self.module.fixed_rank_factors(self.adapter_name)

    @property
    def A(self) -> nn.Parameter:
        return self.factors[0]

    @property
    def B(self) -> nn.Parameter:
        return self.factors[1]

    @property
    def Z(self) -> nn.Parameter:
        return self.factors[2]

    def __str__(self) -> str:
        return f"adapter {self.adapter_name!r} of {self.layer_name or 'the model'}"


def find_fixed_rank_adapters(model: nn.Module) -> list[AdapterHandle]:
    """Every adapter of every :class:`FixedRankAdapters` module in ``model``, in module order."""
    return list(_handles(model))


def _handles(model: nn.Module) -> Iterator[AdapterHandle]:
    for layer_name, module in model.named_modules():
        if isinstance(module, FixedRankAdapters):
            for name in module.fixed_rank_adapters():
                yield AdapterHandle(layer_name, name, module)
