"""The MoRA layer: a square projection of one tower with a shared (Gram-coupled) and a specific low-rank branch.

Per adapter the layer holds the modality-specific LoRA pair ``mora_spec_A`` (``r x in``), ``mora_spec_B``
(``out x r``) and the two magnitude vectors ``mora_mag_shared`` / ``mora_mag_specific`` (``out``). The modality-common
factors ``S_A`` / ``S_B`` live once, on the tuner (:class:`~.model.MoRAModel`), and the layer reads them through a
plain (unregistered) reference, so the state dict holds one copy and every module of the pair uses the same tensors.

The composed weight (docs/methods.md (MoRA)) is::

    W' = diag(s_sh) (W + a dW_sh) + diag(s_sp) (W + a dW_sp),   s_x = m_x / ||W + a dW_x||_row

and the layer adds ``x (W' - W)^T`` to the base output. Writing the adapter as the delta ``W' - W`` (rather than
replacing the base forward) keeps the base path untouched, so the identity at init is exact (``W' - W`` is exactly
zero when ``m_sh = 0``, ``m_sp = ||W||`` and ``M_B = 0``) and quantized bases need no special forward. Exact in every
dtype: the magnitudes are never rounded on their way to the base's device (PEFT's move would round ``m_sp`` to a
bfloat16 base's dtype, so ``s_sp`` would be that rounding's ratio, not 1), and a half-precision magnitude
(``autocast_adapter_dtype=False``) divides the norm rounded to its own dtype (:func:`magnitude_scale`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, Optional

import torch
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from ...distributed import sharding_of
from ...precision import is_half
from ..adapter_layer import AdapterLayer, AdapterLinear
from .config import MoRAConfig

__all__ = ["MODALITIES", "Linear", "MoRALayer", "SharedFactors", "magnitude_scale", "refuse_shards", "row_norm"]

MODALITIES = ("text", "vision")
MAGNITUDES = ("mora_mag_shared", "mora_mag_specific")


def refuse_shards(named: Iterable[tuple[str, torch.Tensor]], action: str, fix: str) -> None:
    """Raise ``ValueError`` naming the first FSDP2 (DTensor) or DeepSpeed ZeRO-3 shard among ``named``.

    MoRA's merge, unmerge and magnitude init read whole weights and write whole base weights; under FSDP2 they
    would compute on DTensor shards outside any unit's forward, under ZeRO-3 on flat partitions.

    Args:
        named: ``(name, tensor)`` pairs to check, before anything changes.
        action: What refuses, for the message (e.g. ``"merge"``).
        fix: What works instead, for the message.
    """
    for name, p in named:
        kind = sharding_of(p)
        if kind is not None:
            shape = tuple(getattr(p, "ds_shape", p.shape))
            article = "an" if kind.startswith("FSDP") else "a"
            raise ValueError(
                f"MoRA {action} got `{name}` (shape {shape}) as {article} {kind} shard, but it needs the whole "
                f"tensor. {fix}; see docs/distributed.md"
            )


def row_norm(weight: torch.Tensor) -> torch.Tensor:
    """L2 norm of each output unit's weight vector (``weight`` is ``out x in``): DoRA's magnitude convention."""
    return torch.linalg.vector_norm(weight, dim=1)


def magnitude_scale(magnitude: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """The row scale ``s = m / ||W + a dW||_row``, with the norm rounded to the magnitude's dtype when that is half.

    A bfloat16 / float16 magnitude (``autocast_adapter_dtype=False``) starts as ``||W||`` rounded to its dtype;
    dividing by the float32 norm would make ``s_sp`` that rounding's ratio (``1 +- 2^-9`` in bfloat16) instead of 1,
    moving every output at init. Rounded the same way, the ratio is exactly 1 there, and the scale loses nothing the
    magnitude had not lost already (it carries the half dtype's precision either way). The gradient passes through
    the rounding. float32 magnitudes divide the float32 norm as it is.

    Args:
        magnitude: ``m`` (``out``).
        norm: The row norms (``out``, float32).

    Returns:
        ``s`` (``out``), in the promoted dtype of the two.
    """
    if is_half(magnitude.dtype) and norm.dtype != magnitude.dtype:
        norm = norm.to(magnitude.dtype).to(norm.dtype)
    # The clamp keeps an all-zero row of W (norm 0, delta 0) at scale 0 instead of 0/0.
    return magnitude / norm.clamp_min(torch.finfo(norm.dtype).tiny)


class SharedFactors:
    """The tuner's modality-common parameters as the layers see them: ``S_A[adapter][pair]``, ``S_B[adapter][pair]``.

    A plain object (not an ``nn.Module``), so that layers holding it do not register the shared parameters again:
    ``state_dict`` and ``named_parameters`` list them once, under the tuner.

    Args:
        text: ``ModuleDict`` adapter -> ``ParameterDict`` pair key -> ``S_A`` (``d_text x r``).
        vision: ``ModuleDict`` adapter -> ``ParameterDict`` pair key -> ``S_B`` (``d_vision x r``).
    """

    def __init__(self, text: nn.ModuleDict, vision: nn.ModuleDict) -> None:
        self.text = text
        self.vision = vision

    def pair(self, adapter_name: str, pair_key: str, modality: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(own, other)``: this tower's factor and the other tower's, for one adapter and layer pair.

        Raises:
            ValueError: If a factor is an FSDP2 (DTensor) or DeepSpeed ZeRO-3 shard when a layer reads it (see
                :meth:`check_whole`).
        """
        a = self.text[adapter_name][pair_key]
        b = self.vision[adapter_name][pair_key]
        self.check_whole(adapter_name, pair_key)
        return (a, b) if modality == "text" else (b, a)

    def named(self, adapter_name: str, pair_key: str) -> list[tuple[str, torch.Tensor]]:
        """``[(name, S_A), (name, S_B)]`` of one adapter and layer pair, named as under the tuner."""
        return [
            (f"mora_shared_{m}.{adapter_name}.{pair_key}", c[adapter_name][pair_key])
            for m, c in (("text", self.text), ("vision", self.vision))
        ]

    def check_whole(self, adapter_name: str, pair_key: str) -> None:
        """Raise ``ValueError`` if a factor of the pair is a shard where a layer is about to read it.

        The factors belong to the tuner, not to the layers that read them. Under FSDP2 they are the parameters of
        the unit holding the tuner (the root ``PeftModel``), whole only during that unit's forward and backward: a
        tower or submodule called on its own would read DTensor shards. Under DeepSpeed ZeRO-3 the tuner's modules
        never run a forward, so nothing gathers the factors for the layers.

        Args:
            adapter_name: The adapter.
            pair_key: The layer pair.
        """
        refuse_shards(
            self.named(adapter_name, pair_key),
            "layer forward",
            "The shared factors live on the tuner: under FSDP2 call the sharded root model itself (e.g. "
            "model(input_ids=..., pixel_values=...)) so its unit gathers them, or register a tower's method with "
            "torch.distributed.fsdp.register_fsdp_forward_method(model, 'get_text_features'); DeepSpeed ZeRO-3 does "
            "not gather them for the layers at all, train with DistributedDataParallel or FSDP2",
        )


class MoRALayer(AdapterLayer):
    """State and composition of a layer carrying MoRA adapters (see the module docstring)."""

    method_name = "MoRA"
    adapter_dict_name = "mora_spec_A"
    adapter_layer_names: tuple[str, ...] = ("mora_spec_A", "mora_spec_B", "mora_mag_shared", "mora_mag_specific")
    other_param_names: tuple[str, ...] = ("r", "scaling", "mora_pair")

    def __init__(self, base_layer: nn.Module, modality: str, shared: SharedFactors, **kwargs: Any) -> None:
        if modality not in MODALITIES:
            raise ValueError(f"`modality` must be one of {MODALITIES}, got {modality!r}")
        AdapterLayer.__init__(self, base_layer, **kwargs)
        self.mora_modality = modality
        # object.__setattr__: keep the reference out of nn.Module's registry (one copy in the state dict, see above)
        object.__setattr__(self, "_mora_shared", shared)
        self.r: dict[str, int] = {}
        self.scaling: dict[str, float] = {}
        self.mora_pair: dict[str, str] = {}
        self.mora_spec_A = nn.ParameterDict({})
        self.mora_spec_B = nn.ParameterDict({})
        self.mora_mag_shared = nn.ParameterDict({})
        self.mora_mag_specific = nn.ParameterDict({})
        # one entry per merge() call: {adapter: (s_sh, s_sp)}, what unmerge() needs to invert it exactly
        self._mora_merge_scales: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        if self.in_features != self.out_features:
            raise ValueError(
                f"MoRA's shared delta S (G) S^T is square, so it adapts square projections only; this layer is "
                f"{self.out_features} x {self.in_features}. Restrict `target_modules` to the attention projections."
            )

    def update_layer(self, adapter_name: str, pair_key: str, config: MoRAConfig, inference_mode: bool = False) -> None:
        """Add (or re-create) adapter ``adapter_name``; the shared factors must already exist on the tuner.

        Args:
            adapter_name: Name of the adapter.
            pair_key: Key of this layer's modality-common pair in the tuner's shared factors.
            config: The adapter's configuration.
            inference_mode: Create it frozen.
        """
        r, d = config.r, self.out_features
        refuse_shards(
            [("base_layer.weight", self.get_base_layer().weight)],
            f"update_layer (adapter {adapter_name!r})",
            "The magnitudes start at the row norms of the whole base weight: create MoRA adapters (get_peft_model, "
            "load_adapter, add_adapter) before fully_shard / outside DeepSpeed ZeRO-3",
        )
        own, _ = self._mora_shared.pair(adapter_name, pair_key, self.mora_modality)
        if own.shape[0] != d:
            raise ValueError(f"shared factor for pair {pair_key!r} has {own.shape[0]} rows, this layer is {d} wide")
        self.r[adapter_name] = r
        self.scaling[adapter_name] = config.scaling
        self.mora_pair[adapter_name] = pair_key
        # LoRA's init for the specific pair: A Kaiming-uniform-like, B zero (identity) or small random (tests)
        bound = 1.0 / d**0.5
        self.mora_spec_A[adapter_name] = nn.Parameter(torch.empty(r, d).uniform_(-bound, bound))
        spec_b = torch.zeros(d, r) if config.init_weights else torch.randn(d, r) * 0.5
        self.mora_spec_B[adapter_name] = nn.Parameter(spec_b)
        with torch.no_grad():
            norm = row_norm(self.get_base_weight().float())
        if config.init_weights:
            mag_shared, mag_specific = torch.zeros_like(norm), norm
        else:
            mag_shared, mag_specific = norm / 2, norm / 2
        self.mora_mag_shared[adapter_name] = nn.Parameter(mag_shared)
        self.mora_mag_specific[adapter_name] = nn.Parameter(mag_specific.clone())
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: Optional[torch.device] = None) -> None:
        # PEFT's move also casts to the base dtype. For the magnitudes that would be lossy: m_sp = ||W|| rounded to
        # bfloat16 and upcast again (autocast_adapter_dtype=True) no longer equals the norm it is divided by, so the
        # identity at init would be off by that rounding. They follow the device only; after_adapter_cast gives
        # them PEFT's final dtype directly.
        saved = {attr: getattr(self, attr)[adapter_name] for attr in MAGNITUDES if adapter_name in getattr(self, attr)}
        super()._move_adapter_to_device_of_base_layer(adapter_name, device)
        for attr, value in saved.items():
            target = getattr(self, attr)[adapter_name].device
            if value.device != target:
                value = nn.Parameter(value.data.to(target), requires_grad=value.requires_grad)
            getattr(self, attr)[adapter_name] = value

    def after_adapter_cast(self, adapter_name: str, autocast_adapter_dtype: bool) -> None:
        """Give the magnitudes the dtype PEFT gives adapter weights: the base's, upcast to float32 from bfloat16 /
        float16 with ``autocast_adapter_dtype``, in one cast from the float32 they were created in.

        Args:
            adapter_name: The adapter.
            autocast_adapter_dtype: The flag PEFT's cast got.
        """
        base_dtype = self.base_dtype()
        if base_dtype is None or not base_dtype.is_floating_point:
            return
        target = torch.float32 if autocast_adapter_dtype and is_half(base_dtype) else base_dtype
        for attr in MAGNITUDES:
            container = getattr(self, attr)
            value = container[adapter_name]
            if value.dtype != target:
                container[adapter_name] = nn.Parameter(value.data.to(target), requires_grad=value.requires_grad)

    # -- the composed weight ----------------------------------------------------------------------------------------

    def shared_delta(self, adapter_name: str) -> torch.Tensor:
        """The modality-common delta ``S_own (S_other^T S_other) S_own^T`` (``d x d``) of this layer's tower."""
        own, other = self._mora_shared.pair(adapter_name, self.mora_pair[adapter_name], self.mora_modality)
        return own @ (other.mT @ other) @ own.mT

    def specific_delta(self, adapter_name: str) -> torch.Tensor:
        """The modality-specific delta ``M_B M_A`` (``d x d``)."""
        return self.mora_spec_B[adapter_name] @ self.mora_spec_A[adapter_name]

    def _scales(
        self, adapter_name: str, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(s_sh, s_sp, a dW_sh, a dW_sp)`` for the base weight ``weight`` (float32)."""
        a = self.scaling[adapter_name]
        d_sh = a * self.shared_delta(adapter_name)
        d_sp = a * self.specific_delta(adapter_name)
        # Not detached: DoRA (paper section 4.3, and PEFT) treats the norm as a constant to save the d x d graph;
        # MoRA adapts a few top layers only, so we keep the exact gradient of the paper's formula.
        s_sh = magnitude_scale(self.mora_mag_shared[adapter_name], row_norm(weight + d_sh))
        s_sp = magnitude_scale(self.mora_mag_specific[adapter_name], row_norm(weight + d_sp))
        return s_sh, s_sp, d_sh, d_sp

    def get_delta_weight(self, adapter_name: str, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``W' - W = (s_sh + s_sp - 1) W + s_sh a dW_sh + s_sp a dW_sp`` (rows scaled), float32, ``out x in``.

        Exactly zero at the identity init (``m_sh = 0``, ``m_sp = ||W||``, ``M_B = 0``) in every dtype:
        ``s_sp = ||W|| / ||W + 0||`` is the same float divided by itself (both rounded to a half magnitude's dtype,
        :func:`magnitude_scale`).

        Args:
            adapter_name: The adapter.
            weight: The base weight to compose with (default: the layer's, dequantized if needed).
        """
        if weight is None:
            weight = self.get_base_weight()
        weight = weight.detach().float()
        s_sh, s_sp, d_sh, d_sp = self._scales(adapter_name, weight)
        return (s_sh + s_sp - 1).unsqueeze(1) * weight + s_sh.unsqueeze(1) * d_sh + s_sp.unsqueeze(1) * d_sp

    def adapter_dtype(self, adapter_name: str) -> None:
        # The composed delta's dtype is known only once it is computed (float32, or wider shared factors'):
        # adapter_output casts the input to it.
        return None

    def adapter_output(self, x: torch.Tensor, adapter_name: str, rows: Optional[list[int]] = None) -> torch.Tensor:
        """``x (W' - W)^T``: the composed weight's change applied to ``x`` (see ``AdapterLayer``)."""
        delta = self.get_delta_weight(adapter_name)
        return self._cast_input_dtype(x, delta.dtype) @ delta.mT


class Linear(AdapterLinear, MoRALayer):
    """A square ``torch.nn.Linear`` (or bitsandbytes ``Linear8bitLt`` / ``Linear4bit``) of one tower, with MoRA.

    Forward dispatch, mixed-adapter batches and ``repr`` come from :class:`AdapterLinear`; merging is MoRA's own
    (the adapters merged in one call are composed from the same base weight, and unmerging inverts that exactly).

    Args:
        base_layer: The layer to adapt.
        adapter_name: Name of the first adapter.
        pair_key: Key of the layer pair's shared factors on the tuner.
        modality: ``"text"`` or ``"vision"``: which shared factor is this tower's own.
        shared: The tuner's shared factors.
        config: The adapter's configuration.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        pair_key: str,
        modality: str,
        shared: SharedFactors,
        config: MoRAConfig,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        MoRALayer.__init__(self, base_layer, modality, shared, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, pair_key, config, inference_mode=config.inference_mode)

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """Write the active (or the given) adapters' composed weight into the base weight.

        Adapters merged in one call are composed from the same base weight, exactly like the unmerged forward of
        several active adapters (each delta is relative to ``W``).

        Args:
            safe_merge: Compute the merged weight in a copy and raise ``ValueError`` if it has non-finite values,
                leaving the base weight untouched.
            adapter_names: Adapters to merge (default: the active ones).
        """
        adapter_names = [n for n in check_adapters_to_merge(self, adapter_names) if n in self.mora_spec_A]
        if not adapter_names:
            return
        self.refuse_sharded(adapter_names, "merge")
        self.check_adapter_dtypes(adapter_names)
        if self.quantization_backend is not None and not self.quantization_backend.supports_merge:
            raise TypeError(
                f"Cannot merge into a {self.quantization_backend.backend_name} base layer: it cannot be dequantized"
            )
        weight = self.get_base_weight()
        base = weight.detach().float()
        merged = base.clone()
        scales = {}
        with torch.no_grad():
            for name in adapter_names:
                s_sh, s_sp, d_sh, d_sp = self._scales(name, base)
                merged += (s_sh + s_sp - 1).unsqueeze(1) * base + s_sh.unsqueeze(1) * d_sh + s_sp.unsqueeze(1) * d_sp
                scales[name] = (s_sh.clone(), s_sp.clone())
        if safe_merge and not torch.isfinite(merged).all():
            raise ValueError(
                f"Merging MoRA adapters {adapter_names} gives non-finite weights (NaN or inf); the adapter is broken "
                "and the base weight was left unchanged"
            )
        self.set_base_weight(merged.to(weight.dtype))
        self._mora_merge_scales.append(scales)
        self.merged_adapters.extend(adapter_names)

    def refuse_sharded(self, adapter_names: list[str], action: str) -> None:
        """Raise ``ValueError`` if the base weight, or a parameter of ``adapter_names`` (shared factors included), is
        an FSDP2 or ZeRO-3 shard: merging and unmerging read and write whole weights.

        Args:
            adapter_names: The adapters about to be merged or unmerged.
            action: ``"merge"`` or ``"unmerge"``, for the message.
        """
        named = [("base_layer.weight", self.get_base_layer().weight)]
        for name in adapter_names:
            named += [(f"{attr}.{name}", getattr(self, attr)[name]) for attr in self.adapter_layer_names]
            named += self._mora_shared.named(name, self.mora_pair[name])
        refuse_shards(
            named,
            action,
            f"To {action} a sharded model, gather its full state dict (FSDP2: torch.distributed.checkpoint.state_dict."
            "get_model_state_dict with StateDictOptions(full_state_dict=True)), load it into an unsharded copy and "
            f"{action} there, or {action} before fully_shard",
        )

    def unmerge(self) -> None:
        """Restore the base weight: invert each merge (a per-row affine map of ``W``) with the scales it used.

        With ``W_m = diag(1 + sum_k (s_sh,k + s_sp,k - 1)) W + sum_k a (s_sh,k dW_sh,k + s_sp,k dW_sp,k)`` the scales
        cached at merge time make ``W`` recoverable without storing a copy of it (PEFT's DoRA caches its norm the same
        way).
        """
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", UserWarning, stacklevel=2)
            return
        self.refuse_sharded(sorted({n for scales in self._mora_merge_scales for n in scales}), "unmerge")
        while self._mora_merge_scales:
            scales = self._mora_merge_scales.pop()
            weight = self.get_base_weight()
            restored = weight.detach().float().clone()
            gain = torch.ones_like(restored[:, 0])
            with torch.no_grad():
                for name, (s_sh, s_sp) in scales.items():
                    a = self.scaling[name]
                    restored -= s_sh.unsqueeze(1) * (a * self.shared_delta(name))
                    restored -= s_sp.unsqueeze(1) * (a * self.specific_delta(name))
                    gain += s_sh + s_sp - 1
            self.set_base_weight((restored / gain.unsqueeze(1)).to(weight.dtype))
            for _ in scales:
                self.merged_adapters.pop()

    def extra_repr(self) -> str:
        return f"modality={self.mora_modality}, " + super().extra_repr()
