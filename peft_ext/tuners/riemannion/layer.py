"""The Riemannion layer: ``y = W x + (X - X0) x`` with ``X = A B^T`` on the fixed-rank manifold.

Per adapter the layer holds

- ``riemannion_A`` (out x r, orthonormal columns) and ``riemannion_B`` (in x r): the point ``X = A B^T``;
- ``riemannion_Z`` (out x r): a gradient probe that is always zero;
- ``riemannion_X0_A``, ``riemannion_X0_B`` (buffers): the initial point ``X0``, subtracted so the delta starts at zero.

The forward pass is one rank-3r product pair, ``[A, Z, -X0_A] ([B, B_R, X0_B]^T x)`` with ``B_R = qr(B).Q``
(treated as a constant). Because ``Z = 0`` contributes nothing, the output is ``W x + (A B^T - X0) x``, but one
ordinary backward pass now yields both products the Riemannian gradient needs (docs/methods.md (Riemannion), "Both
products from one backward pass"): ``dL/dZ = G B_R`` and ``dL/dB = G^T A``, with ``G = dL/dW``. Nothing is inverted
(recovering ``G B_R`` from ``dL/dA = G B`` would need ``R^{-1}`` of ``qr(B)``, unstable for the small B of LOI).

The base weight is never modified outside ``merge``; quantized bases (bitsandbytes 4-bit and 8-bit) go through
PEFT's quantization backends, so one ``Linear`` class serves them all. The forward skeleton, mixed batches, merging
and dtype handling are :class:`~peft_ext.tuners.adapter_layer.AdapterLinear`'s; this module holds the delta math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from peft.tuners._buffer_dict import BufferDict
from torch import nn

from ...manifolds.fixed_rank import random_point, reorthonormalize, right_basis
from ...precision import is_half
from ..adapter_layer import AdapterLayer, AdapterLinear, delta_matmul
from .config import RiemannionConfig

__all__ = ["AdapterRef", "Linear", "RiemannionLayer", "find_adapters"]


class RiemannionLayer(AdapterLayer):
    """State and delta math of a layer carrying Riemannion adapters (see the module docstring)."""

    method_name = "Riemannion"
    adapter_dict_name = "riemannion_A"
    adapter_layer_names: tuple[str, ...] = ("riemannion_A", "riemannion_B", "riemannion_Z")
    other_param_names: tuple[str, ...] = (
        "r",
        "riemannion_X0_A",
        "riemannion_X0_B",
        "riemannion_dropout",
        "_riemannion_B_R",
    )

    def __init__(self, base_layer: nn.Module, **kwargs: Any) -> None:
        AdapterLayer.__init__(self, base_layer, **kwargs)  # riemannion_A, _B, _Z
        self.r: dict[str, int] = {}
        # Persistent: X0 is part of the adapter, saved and loaded with it (what makes LOI portable).
        self.riemannion_X0_A = BufferDict({}, persistent=True)
        self.riemannion_X0_B = BufferDict({}, persistent=True)
        self.riemannion_dropout = nn.ModuleDict({})
        # (kind, basis, zero probe) while initialize_loi runs; see loi.py
        self._riemannion_probe: Optional[tuple[str, torch.Tensor, torch.Tensor]] = None
        # B_R per adapter with the (identity, storage, version) of the B it was computed from; see _right_basis
        self._riemannion_B_R: dict[str, tuple[tuple[int, int, int], torch.Tensor]] = {}
        #: Cache B_R between forward passes (see _right_basis). The Riemannion optimizer turns it off for FSDP2-sharded
        #: adapters: FSDP2 refills the forward's unsharded B in place and keeps its version counter, so the cache key
        #: could not see a new B.
        self.cache_right_basis = True

    def update_layer(self, adapter_name: str, config: RiemannionConfig, inference_mode: bool = False) -> None:
        """Add (or re-create) adapter ``adapter_name`` from ``config``.

        Args:
            adapter_name: Name of the adapter.
            config: Its configuration.
            inference_mode: Create it frozen.
        """
        m, n = self.out_features, self.in_features
        # a rank-r point needs r <= min(m, n): a narrower layer (a small classification head under `all-linear`) gets
        # the largest rank it has; the tuner warns once, naming such layers
        r = min(config.r, m, n)
        self.r[adapter_name] = r
        self._riemannion_B_R.pop(adapter_name, None)
        point = random_point(m, n, r, config.resolved_init_scale)
        # QR returns column-major factors; FSDP2 (fully_shard) shards only contiguous parameters, and every later
        # write (optimizer step, LOI, load_state_dict) copies into the parameter, keeping its layout
        A, B = point.A.contiguous(), point.B.contiguous()
        self.riemannion_A[adapter_name] = nn.Parameter(A)
        self.riemannion_B[adapter_name] = nn.Parameter(B)
        self.riemannion_Z[adapter_name] = nn.Parameter(torch.zeros(m, r))
        if config.init_weights:
            self.riemannion_X0_A[adapter_name] = A.clone()
            self.riemannion_X0_B[adapter_name] = B.clone()
        else:
            self.riemannion_X0_A[adapter_name] = torch.zeros(m, r)
            self.riemannion_X0_B[adapter_name] = torch.zeros(n, r)
        dropout = config.riemannion_dropout
        self.riemannion_dropout[adapter_name] = nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def after_adapter_cast(self, adapter_name: str, autocast_adapter_dtype: bool) -> None:
        """Re-orthonormalize ``A`` in float32 when PEFT upcast an adapter created in a half-precision base's dtype.

        Args:
            adapter_name: The adapter.
            autocast_adapter_dtype: The flag PEFT's cast got.
        """
        base_dtype = self.base_dtype()
        if base_dtype is not None and is_half(base_dtype) and not is_half(self.riemannion_A[adapter_name].dtype):
            self.reorthonormalize(adapter_name)

    @torch.no_grad()
    def reorthonormalize(self, adapter_name: str) -> None:
        """Make ``A`` orthonormal to the precision of its dtype again, keeping the point ``X = A B^T``.

        PEFT creates an adapter in the base layer's dtype and upcasts it to float32 afterwards
        (``autocast_adapter_dtype=True``); on a bfloat16 / float16 base that leaves ``A`` orthonormal only to half
        precision (``|A^T A - I|`` about 1e-3), too far off the manifold for float32 steps;
        :meth:`after_adapter_cast` calls this after the upcast. ``X0`` follows when it is the point itself
        (``init_weights=True``), so the delta stays zero.

        Args:
            adapter_name: The adapter.
        """
        A, B = self.riemannion_A[adapter_name], self.riemannion_B[adapter_name]
        X0_A, X0_B = self.riemannion_X0_A[adapter_name], self.riemannion_X0_B[adapter_name]
        if any(t.is_meta for t in (A, B, X0_A, X0_B)):
            return  # created without values (PEFT's low_cpu_mem_usage loading): the checkpoint's point is loaded
        at_start = torch.equal(A, X0_A) and torch.equal(B, X0_B)
        point = reorthonormalize(A, B)
        A.copy_(point.A)
        B.copy_(point.B)
        if at_start:
            X0_A.copy_(point.A)
            X0_B.copy_(point.B)

    # -- the delta in factored form ---------------------------------------------------------------------------------

    def _right_basis(self, adapter_name: str) -> torch.Tensor:
        """``B_R = qr(B).Q``, a constant of the forward pass, recomputed only when B changed.

        B changes once per optimizer step but the forward runs once per micro-batch (and many times in evaluation
        and LOI), so the QR is cached under B's identity, storage pointer and autograd version counter, which every
        in-place update of the parameter (optimizer steps, ``load_state_dict``) bumps; writes through ``B.data``
        bypass the counter and are not supported. The optimizer computes the same deterministic QR itself, so both
        sides use the same basis. A bfloat16 / float16 ``B`` is factored in float32 and its basis cast to ``B``'s
        dtype (:func:`~peft_ext.manifolds.fixed_rank.right_basis`).
        """
        B = self.riemannion_B[adapter_name]
        if not self.cache_right_basis:
            with torch.no_grad():
                return right_basis(B)
        key = (id(B), B.data_ptr(), B._version)
        cached = self._riemannion_B_R.get(adapter_name)
        if cached is None or cached[0] != key or cached[1].dtype != B.dtype:
            with torch.no_grad():
                cached = (key, right_basis(B))
            self._riemannion_B_R[adapter_name] = cached
        return cached[1]

    def _factors(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L, R)`` with ``L R^T = A B^T + Z B_R^T - X0``: ``L = [A, Z, -X0_A]``, ``R = [B, B_R, X0_B]``."""
        A = self.riemannion_A[adapter_name]
        B = self.riemannion_B[adapter_name]
        B_R = self._right_basis(adapter_name)
        left = torch.cat([A, self.riemannion_Z[adapter_name], -self.riemannion_X0_A[adapter_name]], dim=1)
        right = torch.cat([B, B_R, self.riemannion_X0_B[adapter_name]], dim=1)
        return left, right

    def adapter_output(self, x: torch.Tensor, adapter_name: str, rows: Optional[list[int]] = None) -> torch.Tensor:
        """``(X - X0) x`` in factored form, the input already in the adapter dtype (see ``AdapterLayer``)."""
        left, right = self._factors(adapter_name)
        x = self.riemannion_dropout[adapter_name](x)
        return (x @ right) @ left.mT

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The adapter's weight delta (out x in): ``A B^T + Z B_R^T - X0_A X0_B^T`` (``Z`` is zero in training).

        Only merging needs this m x n matrix; the forward pass stays factored.

        Args:
            adapter_name: The adapter.
        """
        left, right = self._factors(adapter_name)
        return delta_matmul(left, right.mT)

    def after_forward(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """Add LOI's zero gradient probe while :func:`~.loi.initialize_loi` runs (in every forward branch)."""
        if self._riemannion_probe is not None:
            result = self._add_probe(x, result)
        return result

    def _add_probe(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        kind, basis, probe = self._riemannion_probe
        x = x.to(probe.dtype)
        if kind == "right":  # out += Zp (N^T x), Zp = 0: dL/dZp = G N
            extra = (x @ basis) @ probe.mT
        else:  # out += M (Zp^T x), Zp = 0: dL/dZp = G^T M
            extra = (x @ probe) @ basis.mT
        return result + extra.to(result.dtype)

    def get_right_basis(self, adapter_name: str) -> torch.Tensor:
        """``B_R = qr(B).Q`` of the adapter's current ``B``, from the cache (computed there if ``B`` changed).

        The Riemannion optimizer reads its step's starting point from here, so the layer and the optimizer use one
        basis.

        Args:
            adapter_name: The adapter.
        """
        return self._right_basis(adapter_name)

    def set_right_basis(self, adapter_name: str, B_R: torch.Tensor) -> None:
        """Cache ``B_R`` as the right basis of the adapter's current ``B``, so the next forward does not compute it.

        The Riemannion optimizer calls this after writing a new ``B``: its retraction has already computed
        ``right_basis`` of that ``B`` (bit for bit what the layer would compute). Any later in-place change of ``B``
        invalidates the entry as usual.

        Args:
            adapter_name: The adapter.
            B_R: ``right_basis(B)`` for the current ``B``: same shape and dtype as ``B``, on its device.
        """
        B = self.riemannion_B[adapter_name]
        if B_R.shape != B.shape or B_R.dtype != B.dtype or B_R.device != B.device:
            raise ValueError(
                f"B_R for adapter {adapter_name!r} must match riemannion_B ({tuple(B.shape)}, {B.dtype}, "
                f"{B.device}), got {tuple(B_R.shape)}, {B_R.dtype}, {B_R.device}"
            )
        self._riemannion_B_R[adapter_name] = ((id(B), B.data_ptr(), B._version), B_R)

    # -- peft_ext.optim.adapters.FixedRankAdapters: what the Riemannion optimizer reads and refreshes ---------------

    def fixed_rank_adapters(self) -> list[str]:
        """The names of this layer's adapters."""
        return list(self.riemannion_A)

    def fixed_rank_factors(self, adapter_name: str) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
        """``(riemannion_A, riemannion_B, riemannion_Z)`` of ``adapter_name``."""
        return (
            self.riemannion_A[adapter_name],
            self.riemannion_B[adapter_name],
            self.riemannion_Z[adapter_name],
        )

    def cached_right_basis(self, adapter_name: str) -> Optional[torch.Tensor]:
        """:meth:`get_right_basis`, or ``None`` when the cache is off (:attr:`cache_right_basis`)."""
        return self.get_right_basis(adapter_name) if self.cache_right_basis else None

    def store_right_basis(self, adapter_name: str, B_R: torch.Tensor) -> None:
        """:meth:`set_right_basis` when the cache is on; nothing when it is off."""
        if self.cache_right_basis:
            self.set_right_basis(adapter_name, B_R)

    def stop_caching_right_basis(self) -> None:
        """Turn :attr:`cache_right_basis` off: ``B_R`` is recomputed in every forward."""
        self.cache_right_basis = False


class Linear(AdapterLinear, RiemannionLayer):
    """A ``torch.nn.Linear`` (or a bitsandbytes ``Linear8bitLt`` / ``Linear4bit``) ``base_layer`` with Riemannion
    adapters, the first one ``adapter_name`` built from ``config``.

    Forward dispatch, mixed-adapter batches, merging and ``repr`` come from :class:`AdapterLinear`.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: RiemannionConfig, **kwargs: Any) -> None:
        super().__init__()
        RiemannionLayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, inference_mode=config.inference_mode)


@dataclass(frozen=True)
class AdapterRef:
    """One Riemannion adapter of a model: where it lives and its current parameters.

    Args:
        layer_name: Qualified name of the layer in the model.
        adapter_name: Name of the adapter.
        layer: The layer.
    """

    layer_name: str
    adapter_name: str
    layer: RiemannionLayer

    @property
    def A(self) -> nn.Parameter:
        return self.layer.riemannion_A[self.adapter_name]

    @property
    def B(self) -> nn.Parameter:
        return self.layer.riemannion_B[self.adapter_name]

    @property
    def Z(self) -> nn.Parameter:
        return self.layer.riemannion_Z[self.adapter_name]

    def __str__(self) -> str:
        return f"adapter {self.adapter_name!r} of {self.layer_name or 'the model'}"


def find_adapters(model: nn.Module, adapter_name: Optional[str] = None) -> list[AdapterRef]:
    """Every Riemannion adapter in ``model`` (or only those named ``adapter_name``), in module order.

    Args:
        model: Any module, typically a ``PeftModel``.
        adapter_name: Restrict to this adapter name.
    """
    refs = []
    for layer_name, module in model.named_modules():
        if isinstance(module, RiemannionLayer):
            for name in module.riemannion_A:
                if adapter_name is None or name == adapter_name:
                    refs.append(AdapterRef(layer_name, name, module))
    return refs
