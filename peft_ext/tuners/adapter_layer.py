"""The skeleton every peft-ext adapter on a linear layer shares: :class:`AdapterLayer` and :class:`AdapterLinear`.

PEFT's LoRA puts what varies between its variants behind one extension point (``LoraVariant``) and keeps the forward
pass, mixed-adapter batches and merging in one place. peft-ext does the same for its adapter types: a tuner's layer
supplies only its state and its delta math through the hooks below, and the base owns everything else.

What the base owns:

- **Forward dispatch** (:meth:`AdapterLinear.forward`): adapters disabled -> unmerge if merged, then the base layer;
  ``adapter_names`` given -> the mixed batch; merged -> the base layer; otherwise the base output plus the sum of
  the active adapters' outputs, in ``active_adapters`` order. :meth:`AdapterLayer.after_forward` runs last, in
  every branch.
- **Mixed-adapter batches**: ``forward(x, adapter_names=[...])`` (one adapter name per row of ``x``, ``"__base__"``
  for no adapter) adds each adapter's output to its own rows only; the tuner side is
  :class:`~peft_ext.tuners.adapter_tuner.AdapterTuner`.
- **Merging**: :meth:`AdapterLinear.merge` / :meth:`AdapterLinear.unmerge` with ``safe_merge`` (non-finite weights
  are refused and the base weight is left unchanged), through PEFT's ``get_base_weight`` / ``set_base_weight``, so
  quantized bases that can be dequantized merge too.
- **Layouts**: the base is an ``nn.Linear`` (weight ``out x in``), a quantized linear layer, or transformers'
  ``Conv1D`` (GPT-2 and the models built on its modules; weight ``in x out``, what PEFT's LoRA calls
  ``fan_in_fan_out``). Every hook works in the ``out x in`` convention: :meth:`AdapterLayer.get_base_weight` and
  :meth:`AdapterLayer.set_base_weight` transpose a ``Conv1D`` weight, so deltas, merges and a tuner's own reads of
  the base weight are the same code for both (``fan_in_fan_out`` tells which one it is).
- **Quantized bases**: the quantization backend is resolved once (bitsandbytes 8-bit / 4-bit), bitsandbytes' lossy
  CPU repacking is switched off, and the base output is cloned where the backend needs it before adding to it.
- **Dtypes**: the input is cast to :meth:`AdapterLayer.adapter_dtype` before :meth:`AdapterLayer.adapter_output`
  and each adapter's output is cast back to the base output's dtype; :func:`delta_matmul` computes half-precision
  deltas on CPU in float32. Adapter parameters of a dtype no adapter computes in (e.g. float8, complex) are refused
  with a ``TypeError`` before a forward or a merge (:func:`peft_ext.precision.check_dtypes`).
  ``autocast_adapter_dtype`` means what it means in PEFT (:meth:`AdapterLayer.after_adapter_cast` is the hook for
  adapters whose state needs more than PEFT's cast).
- ``repr`` (``"<prefix>.Linear(...)"``) and ``extra_repr`` (the quantization backend, if any).

The hooks a tuner's layer provides (subclass :class:`AdapterLayer` for the state, and make the concrete class
``class Linear(AdapterLinear, MyLayer)``):

- ``method_name`` (class attribute): the adapter type's name in messages, e.g. ``"Riemannion"``.
- ``adapter_dict_name`` (class attribute): the attribute holding the per-adapter dict (``nn.ParameterDict`` /
  ``BufferDict``) whose keys are the adapters this layer carries, e.g. ``"riemannion_A"``. Its prefix up to the
  first ``_`` is the ``repr`` prefix.
- :meth:`AdapterLayer.adapter_output` ``(x, adapter_name, rows=None)``: the adapter's contribution to the output for
  the input ``x`` (already cast to :meth:`AdapterLayer.adapter_dtype`). ``rows`` is ``None`` for a whole batch and
  the row indices of ``x`` in the full batch in a mixed batch (``x`` is then those rows only), for adapters whose
  output depends on more than the row itself (e.g. per-sample routing).
- :meth:`AdapterLayer.get_delta_weight` ``(adapter_name)``: the adapter's weight delta (``out x in``), for merging.
- optional: :meth:`AdapterLayer.adapter_dtype` (default: the dtype of the adapter's entry in
  ``adapter_dict_name``; ``None`` leaves the input as it is), :meth:`AdapterLayer.after_forward` (default: the
  result unchanged), :meth:`AdapterLayer.after_adapter_cast` (default: nothing), and
  :meth:`AdapterLayer.merged_weight` / :meth:`AdapterLayer.unmerged_weight` for adapters whose merge is not
  ``W + delta`` (default: add / subtract :meth:`AdapterLayer.get_delta_weight`).

Adapters whose composition is not a sum of per-adapter deltas (MoRA merges several adapters jointly) override
``merge`` / ``unmerge`` on their concrete class and keep the rest.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features, check_adapters_to_merge
from peft.utils import quantization_extra_repr, resolve_quantization_backend
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..precision import SUPPORTED_DTYPES, check_dtypes
from ..quantization import disable_bnb_cpu_repacking
from ._common import check_adapter_names_args

__all__ = ["AdapterLayer", "AdapterLinear", "delta_matmul"]


def delta_matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` in ``left``'s dtype, computed in float32 for half-precision tensors on CPU.

    CPU half-precision matmuls are slow and lossy (PEFT's LoRA upcasts its delta weight the same way); use it in
    :meth:`AdapterLayer.get_delta_weight`.

    Args:
        left: The left factor.
        right: The right factor.
    """
    if left.device.type == "cpu" and left.dtype in (torch.float16, torch.bfloat16):
        return (left.float() @ right.float()).to(left.dtype)
    return left @ right


class AdapterLayer(BaseTunerLayer):
    """State and hooks of a layer carrying additive adapters of one type (see the module docstring).

    Subclasses set ``method_name``, ``adapter_dict_name``, PEFT's ``adapter_layer_names`` / ``other_param_names``
    (and ``adapter_buffer_names``), call ``AdapterLayer.__init__(self, base_layer, **kwargs)`` first in their
    ``__init__`` and then create their other per-adapter state, and implement :meth:`adapter_output` and
    :meth:`get_delta_weight`. ``__init__`` creates an empty ``nn.ParameterDict`` per name of ``adapter_layer_names``
    and then an empty persistent ``BufferDict`` per name of ``adapter_buffer_names``, in that order.

    Args:
        base_layer: The layer to adapt (``nn.Linear`` or a quantized linear layer).
        **kwargs: Kept as ``self.kwargs``; ``get_apply_tensor_subclass`` is passed to PEFT's quantization backend.
    """

    #: The adapter type's name in messages, e.g. ``"Riemannion"``.
    method_name: str = ""
    #: The per-adapter dict whose keys are the adapters this layer carries, e.g. ``"riemannion_A"``.
    adapter_dict_name: str = ""
    #: Per-adapter tensors saved with the adapter but not trained, one persistent ``BufferDict`` each (list them in
    #: ``other_param_names`` too, so PEFT deletes their entries with the adapter).
    adapter_buffer_names: tuple[str, ...] = ()

    def __init__(self, base_layer: nn.Module, **kwargs: Any) -> None:
        self.base_layer = base_layer
        self.quantization_backend = resolve_quantization_backend(
            self.get_base_layer(), get_apply_tensor_subclass=kwargs.get("get_apply_tensor_subclass")
        )
        if self.quantization_backend is not None:
            disable_bnb_cpu_repacking(self.get_base_layer())
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.kwargs = kwargs
        in_features, out_features = _get_in_out_features(self.get_base_layer())
        if in_features is None or out_features is None:
            raise TypeError(
                f"{self.method_name} cannot read the in/out features of {type(self.get_base_layer()).__name__}"
            )
        self.in_features = in_features
        self.out_features = out_features
        #: The base stores its weight ``in x out`` (transformers' ``Conv1D``): see :meth:`get_base_weight`.
        self.fan_in_fan_out = isinstance(self.get_base_layer(), Conv1D)
        for name in self.adapter_layer_names:
            setattr(self, name, nn.ParameterDict({}))
        for name in self.adapter_buffer_names:
            setattr(self, name, BufferDict({}, persistent=True))

    # -- the base weight, out x in ----------------------------------------------------------------------------------

    def get_base_weight(self) -> torch.Tensor:
        """The base weight as ``out x in`` (dequantized if quantized; a ``Conv1D`` weight transposed, a view)."""
        weight = super().get_base_weight()
        return weight.T if self.fan_in_fan_out else weight

    def set_base_weight(self, weight_data: torch.Tensor) -> None:
        """Write the base weight from ``weight_data`` given ``out x in`` (stored transposed for a ``Conv1D``).

        Args:
            weight_data: The new weight, ``out x in``.
        """
        super().set_base_weight(weight_data.T.contiguous() if self.fan_in_fan_out else weight_data)

    # -- what the layer carries ---------------------------------------------------------------------------------

    def carries_adapter(self, adapter_name: str) -> bool:
        """Whether this layer carries adapter ``adapter_name`` (a key of ``adapter_dict_name``).

        Args:
            adapter_name: The adapter.
        """
        return adapter_name in getattr(self, self.adapter_dict_name)

    def carried_adapters(self) -> list[str]:
        """The names of the adapters this layer carries, in creation order."""
        return list(getattr(self, self.adapter_dict_name).keys())

    # -- hooks ----------------------------------------------------------------------------------------------------

    def adapter_output(self, x: torch.Tensor, adapter_name: str, rows: Optional[list[int]] = None) -> torch.Tensor:
        """The adapter's contribution to the layer output for input ``x`` (``x`` is cast to :meth:`adapter_dtype`).

        Args:
            x: The input (in a mixed batch: this adapter's rows only).
            adapter_name: The adapter.
            rows: ``None`` for a whole batch; in a mixed batch, the indices of ``x``'s rows in the full batch.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement adapter_output(x, adapter_name, rows)")

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The adapter's weight delta (``out x in``), what merging adds to the base weight.

        Args:
            adapter_name: The adapter.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement get_delta_weight(adapter_name)")

    def adapter_dtype(self, adapter_name: str) -> Optional[torch.dtype]:
        """The dtype the input is cast to before :meth:`adapter_output` (``None``: no cast).

        Args:
            adapter_name: The adapter.
        """
        return getattr(self, self.adapter_dict_name)[adapter_name].dtype

    def after_adapter_cast(self, adapter_name: str, autocast_adapter_dtype: bool) -> None:
        """Runs after PEFT's ``_cast_adapter_dtype`` for each new or loaded adapter; nothing by default.

        PEFT creates an adapter in the base layer's dtype (:meth:`base_dtype`) and, with ``autocast_adapter_dtype``
        (its default), upcasts its bfloat16 / float16 parameters and buffers to float32. Layers whose state is not
        created that way (statistics kept in float32, factors that must stay orthonormal) finish the job here.

        Args:
            adapter_name: The adapter.
            autocast_adapter_dtype: The flag ``get_peft_model`` / ``load_adapter`` got.
        """

    def base_dtype(self) -> Optional[torch.dtype]:
        """The base layer's dtype as PEFT sees it: its weight's, or a bitsandbytes 4-bit layer's compute dtype."""
        return self._get_base_layer_device_and_dtype(self.get_base_layer())[1]

    def check_adapter_dtypes(self, adapter_names: list[str]) -> None:
        """Raise ``TypeError`` if a parameter of one of ``adapter_names`` has a dtype adapters cannot compute in.

        Args:
            adapter_names: The adapters about to be used.
        """
        check_dtypes(
            (
                (f"{attr}.{name}", params[name])
                for attr in self.adapter_layer_names
                if isinstance(params := getattr(self, attr, None), nn.ParameterDict)
                for name in adapter_names
                if name in params
            ),
            self.method_name,
        )

    def after_forward(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """Last step of every forward pass (adapters enabled, disabled, merged or mixed); the result by default.

        Args:
            x: The layer input.
            result: The layer output so far.
        """
        return result

    def merged_weight(self, weight: torch.Tensor, adapter_name: str) -> torch.Tensor:
        """The base weight with adapter ``adapter_name`` merged into it: ``weight + delta`` by default.

        Args:
            weight: The current (dequantized) base weight.
            adapter_name: The adapter.
        """
        return weight + self.get_delta_weight(adapter_name).to(weight.dtype)

    def unmerged_weight(self, weight: torch.Tensor, adapter_name: str) -> torch.Tensor:
        """The inverse of :meth:`merged_weight`: ``weight - delta`` by default.

        Args:
            weight: The current (dequantized) base weight.
            adapter_name: The adapter.
        """
        return weight - self.get_delta_weight(adapter_name).to(weight.dtype)

    # -- the skeleton's pieces --------------------------------------------------------------------------------------

    def delta_output(self, x: torch.Tensor, adapter_name: str, rows: Optional[list[int]] = None) -> torch.Tensor:
        """:meth:`adapter_output` on ``x`` cast to :meth:`adapter_dtype` (the dtype the caller casts back from).

        Args:
            x: The input (in a mixed batch: this adapter's rows only).
            adapter_name: The adapter.
            rows: See :meth:`adapter_output`.
        """
        dtype = self.adapter_dtype(adapter_name)
        if dtype is not None:
            if dtype not in SUPPORTED_DTYPES:
                self.check_adapter_dtypes([adapter_name])  # raises, naming the parameter
            x = self._cast_input_dtype(x, dtype)
        return self.adapter_output(x, adapter_name, rows=rows)

    def mixed_batch_forward(
        self, x: torch.Tensor, *args: Any, adapter_names: list[str], **kwargs: Any
    ) -> torch.Tensor:
        """The base output with each row's adapter (``adapter_names[i]`` for row ``i``) added to that row.

        Args:
            x: The batch.
            *args: Passed to the base layer.
            adapter_names: One adapter name per row; ``"__base__"`` (or an adapter this layer lacks) adds nothing.
            **kwargs: Passed to the base layer.
        """
        result = self.base_layer(x, *args, **kwargs)
        dtype = result.dtype
        if self.quantization_backend is not None:
            result = self.quantization_backend.maybe_clone_base_result(result)
        for name in sorted(set(adapter_names)):
            if name == "__base__" or not self.carries_adapter(name):
                continue
            rows = [i for i, item in enumerate(adapter_names) if item == name]
            result[rows] += self.delta_output(x[rows], name, rows=rows).to(dtype)
        return result


class AdapterLinear(nn.Module, AdapterLayer):
    """The concrete skeleton: forward dispatch, merge / unmerge and ``repr`` over an :class:`AdapterLayer`'s hooks.

    A tuner's concrete class is ``class Linear(AdapterLinear, MyLayer)``, whose ``__init__`` calls
    ``super().__init__()`` (``nn.Module``), then ``MyLayer.__init__(self, base_layer, ...)``, sets
    ``self._active_adapter`` and creates the first adapter with ``update_layer``.
    """

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """Merge the active (or the given) adapters into the base weight, one after the other: each adapter's
        ``merged_weight(weight, name)`` (by default ``weight + delta``) is written without autograd.

        Args:
            safe_merge: Compute the merged weight in a copy and raise ``ValueError`` if it has non-finite values,
                leaving the base weight untouched.
            adapter_names: Adapters to merge (default: the active ones); names this layer does not carry are skipped.
        """
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        self.check_adapter_dtypes(adapter_names)
        backend = self.quantization_backend
        if backend is not None and not backend.supports_merge:
            raise TypeError(f"Cannot merge into a {backend.backend_name} base layer: it cannot be dequantized")
        for name in adapter_names:
            if not self.carries_adapter(name):
                continue
            with torch.no_grad():
                weight = self.get_base_weight()
                merged = self.merged_weight(weight.clone() if safe_merge else weight, name)
                if safe_merge and not torch.isfinite(merged).all():
                    raise ValueError(
                        f"Merging {self.method_name} adapter {name!r} gives non-finite weights; the adapter is broken "
                        "(the base weight was left unchanged)"
                    )
                self.set_base_weight(merged)
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """Undo the merges, last merged first (each adapter's ``unmerged_weight``)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", UserWarning, stacklevel=2)
            return
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if self.carries_adapter(name):
                with torch.no_grad():
                    self.set_base_weight(self.unmerged_weight(self.get_base_weight(), name))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter_names = kwargs.pop("adapter_names", None)
        check_adapter_names_args(self, x, adapter_names)
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            result = self.base_layer(x, *args, **kwargs)
        elif adapter_names is not None:
            result = self.mixed_batch_forward(x, *args, adapter_names=adapter_names, **kwargs)
        elif self.merged:
            result = self.base_layer(x, *args, **kwargs)
        else:
            result = self.base_layer(x, *args, **kwargs)
            dtype = result.dtype
            if self.quantization_backend is not None:
                result = self.quantization_backend.maybe_clone_base_result(result)
            for name in self.active_adapters:
                if self.carries_adapter(name):
                    result = result + self.delta_output(x, name).to(dtype)
        return self.after_forward(x, result)

    def extra_repr(self) -> str:
        return quantization_extra_repr(self)

    def __repr__(self) -> str:
        return self.adapter_dict_name.split("_")[0] + "." + super().__repr__()
