"""SplitLoRA layers: ``y = W x + (dW_old + B A) x`` with a frozen ``A`` and a frozen, compact ``dW_old``."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from peft.tuners._buffer_dict import BufferDict
from torch import nn

from ...distributed import full_tensor
from ...distributed.features import FeatureShards
from ...precision import is_half
from ..adapter_layer import AdapterLayer, AdapterLinear
from .config import SplitLoRAConfig
from .statistics import LayerStatistics
from .subspace import kaiming_lora_A, seeded_generator

__all__ = ["Linear", "SplitLoRALayer"]


class SplitLoRALayer(LayerStatistics, AdapterLayer):
    """Per-adapter state of a SplitLoRA layer.

    Saved with the adapter (``BufferDict``/``ParameterDict`` entries keyed by adapter name):

    - ``splitlora_B`` (``out x r``, trainable) and ``splitlora_A`` (``r x in``, frozen): the current task's adapter.
    - ``splitlora_old_B`` (``out x R``) and ``splitlora_old_A`` (``R x in``): the finished tasks' ``B A`` stacked,
      ``R = r * tasks``; or ``splitlora_old_dense`` (``out x in``) once ``R * (out + in) > out * in``.
    - ``splitlora_cov`` (dense, ``in x in``: running sum of ``x x^T``) or ``splitlora_sketch`` (``l x in``
      frequent-directions sketch) with ``splitlora_sketch_error`` (certified spectral error of the sketch).
    - ``splitlora_tokens`` and ``splitlora_energy`` (token count and sum of ``||x||^2`` over all tasks so far):
      ``C = sum / tokens`` is the running token-weighted mean that docs/methods.md (SplitLoRA) asks for, never reset.
    - ``splitlora_tasks`` (finished tasks) and ``splitlora_primary`` (primary directions chosen last).

    The statistics of the task in progress are held apart (``_splitlora_pending``, not saved) until ``end_task``:
    under DDP only that increment is all-reduced, never the already-global running sums.

    Half precision: the delta's factors (:attr:`weight_names`) are float32, or the base's bfloat16 / float16 with
    ``autocast_adapter_dtype=False``; the statistics (covariance or sketch, energy, sketch error) are float32 (float64
    on a float64 base) always; a sketch's shrinks run in float64 (:mod:`.covariance`), the spectra in float32
    (:mod:`.subspace`).
    """

    method_name = "SplitLoRA"
    adapter_dict_name = "splitlora_B"
    adapter_layer_names: tuple[str, ...] = ("splitlora_B",)
    adapter_buffer_names: tuple[str, ...] = (
        "splitlora_A",
        "splitlora_old_A",
        "splitlora_old_B",
        "splitlora_old_dense",
        "splitlora_cov",
        "splitlora_sketch",
        "splitlora_sketch_error",
        "splitlora_tokens",
        "splitlora_energy",
        "splitlora_tasks",
        "splitlora_primary",
    )
    other_param_names: tuple[str, ...] = (*adapter_buffer_names, "r", "splitlora_config")
    #: The delta's factors: float32, or the base's dtype with ``autocast_adapter_dtype=False``.
    weight_names: tuple[str, ...] = (
        "splitlora_B",
        "splitlora_A",
        "splitlora_old_A",
        "splitlora_old_B",
        "splitlora_old_dense",
    )
    #: Buffers whose shape changes as tasks finish; loading resizes them to the checkpoint's shapes first.
    resizable_buffer_names: tuple[str, ...] = ("splitlora_old_A", "splitlora_old_B", "splitlora_old_dense")

    def __init__(self, base_layer: nn.Module, seed_key: str, **kwargs: Any) -> None:
        AdapterLayer.__init__(self, base_layer, **kwargs)  # the parameter and buffer dicts named above
        self.r: dict[str, int] = {}
        self.splitlora_config: dict[str, SplitLoRAConfig] = {}
        self._splitlora_pending: dict[str, dict[str, torch.Tensor]] = {}
        self._splitlora_shards: dict[str, FeatureShards] = {}
        # adapters whose task-in-progress accumulator other modules fed the same input hold too (.sharing)
        self._splitlora_shared: set[str] = set()
        self._splitlora_seed_key = seed_key

    # --- creation ------------------------------------------------------------------------------------------------

    def _adapter_dtype(self) -> torch.dtype:
        # Adapters are created, and statistics kept, in float32 (float64 for float64 bases) whatever the base dtype:
        # bf16 running sums would lose small eigen-directions. With autocast_adapter_dtype=False the delta's factors
        # then take the base's half dtype (after_adapter_cast); the statistics never do.
        weight = getattr(self.get_base_layer(), "weight", None)
        if weight is not None and weight.dtype == torch.float64:
            return torch.float64
        return torch.float32

    def _adapter_device(self) -> torch.device:
        weight = getattr(self.get_base_layer(), "weight", None)
        return weight.device if weight is not None else torch.device("cpu")

    def update_layer(self, adapter_name: str, config: SplitLoRAConfig) -> None:
        """Create (or re-create) the state of ``adapter_name``: task 0, ``A`` random (PEFT's LoRA init), ``B = 0``.

        Args:
            adapter_name: Name of the adapter.
            config: Its configuration.
        """
        r = config.r
        n, m = self.in_features, self.out_features
        if r > n:
            raise ValueError(
                f"`r` ({r}) must be at most the input width of {self._splitlora_seed_key!r} ({n}): A is r x {n}"
            )
        dtype, device = self._adapter_dtype(), self._adapter_device()
        self.r[adapter_name] = r
        self.splitlora_config[adapter_name] = config
        generator = seeded_generator(config.seed, self._splitlora_seed_key, 0)
        self.splitlora_A[adapter_name] = kaiming_lora_A(r, n, generator, dtype).to(device)
        if config.init_weights:
            b = torch.zeros(m, r, dtype=dtype)
        else:
            # Test-only init from the global RNG, so two adapters added under different seeds differ (A is a pure
            # function of the config and the module, by design).
            b = torch.randn(m, r, dtype=torch.float64).mul_(0.1).to(dtype)
        self.splitlora_B[adapter_name] = nn.Parameter(b.to(device))
        self.splitlora_old_A[adapter_name] = torch.zeros(0, n, dtype=dtype, device=device)
        self.splitlora_old_B[adapter_name] = torch.zeros(m, 0, dtype=dtype, device=device)
        self.splitlora_old_dense[adapter_name] = torch.zeros(0, 0, dtype=dtype, device=device)
        if config.statistics_for(n) == "dense":
            self.splitlora_cov[adapter_name] = torch.zeros(n, n, dtype=dtype, device=device)
        else:
            self.splitlora_sketch[adapter_name] = torch.zeros(config.sketch_rank, n, dtype=dtype, device=device)
            self.splitlora_sketch_error[adapter_name] = torch.zeros((), dtype=torch.float64, device=device)
        self.splitlora_tokens[adapter_name] = torch.zeros((), dtype=torch.int64, device=device)
        self.splitlora_energy[adapter_name] = torch.zeros((), dtype=torch.float64, device=device)
        self.splitlora_tasks[adapter_name] = torch.zeros((), dtype=torch.int64, device=device)
        self.splitlora_primary[adapter_name] = torch.zeros((), dtype=torch.int64, device=device)
        self._splitlora_pending.pop(adapter_name, None)
        self._splitlora_shared.discard(adapter_name)
        self.set_adapter(self.active_adapters)

    def after_adapter_cast(self, adapter_name: str, autocast_adapter_dtype: bool) -> None:
        """PEFT's ``autocast_adapter_dtype=False`` on a bfloat16 / float16 base: the delta's factors (``B``, ``A``,
        the finished tasks' factors or dense delta) take the base's dtype. The statistics stay float32 either way.

        Args:
            adapter_name: The adapter.
            autocast_adapter_dtype: The flag PEFT's cast got; ``True`` leaves the float32 factors as they are.
        """
        base_dtype = self.base_dtype()
        if autocast_adapter_dtype or base_dtype is None or not is_half(base_dtype):
            return
        for attr in self.weight_names:
            container = getattr(self, attr)
            value = container[adapter_name]
            if isinstance(value, nn.Parameter):
                container[adapter_name] = nn.Parameter(value.data.to(base_dtype), requires_grad=value.requires_grad)
            else:
                container[adapter_name] = value.to(base_dtype)

    def delete_adapter(self, adapter_name: str) -> None:
        self._splitlora_pending.pop(adapter_name, None)
        self._splitlora_shared.discard(adapter_name)
        super().delete_adapter(adapter_name)

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: Optional[torch.device] = None) -> None:
        # PEFT's version also casts floating buffers to the base dtype (bf16 for a bf16 model); the running
        # covariance must stay in the adapter dtype, so only the device follows the base layer here.
        target = device if device is not None else self._adapter_device()
        for attr in self.adapter_layer_names + self.other_param_names:
            container = getattr(self, attr, None)
            if not isinstance(container, (nn.ParameterDict, BufferDict)) or adapter_name not in container:
                continue
            value = container[adapter_name]
            if value.device == target:
                continue
            if isinstance(value, nn.Parameter):
                container[adapter_name] = nn.Parameter(value.data.to(target), requires_grad=value.requires_grad)
            else:
                container[adapter_name] = value.to(target)

    @property
    def seed_key(self) -> str:
        """The module's name in the model: seeds its frozen ``A`` draws and names it in messages."""
        return self._splitlora_seed_key

    # --- the task lifecycle --------------------------------------------------------------------------------------

    @torch.no_grad()
    def fold_task(self, adapter_name: str) -> None:
        """``dW_old += B A`` (exactly, by stacking the factors; densified only when that is smaller); ``B = 0``.

        Args:
            adapter_name: Name of the adapter.

        Raises:
            ValueError: If ``B`` has non-finite values; nothing is changed then.
        """
        param = self.splitlora_B[adapter_name]
        b = full_tensor(param)  # FSDP2: B is a DTensor shard here; the fold needs all of its rows
        a = self.splitlora_A[adapter_name]
        if not bool(torch.isfinite(b).all()):
            # Folding would spread the non-finite values into dW_old and so into every earlier task's output.
            raise ValueError(
                f"B of SplitLoRA adapter {adapter_name!r} on {self._splitlora_seed_key!r} has non-finite values "
                "(training diverged); nothing was folded. Lower the learning rate and retrain this task."
            )
        if bool(b.detach().any()):
            dense = self.splitlora_old_dense[adapter_name]
            if dense.numel():
                dense.addmm_(b.detach().to(dense.dtype), a.to(dense.dtype))
            else:
                old_b = torch.cat([self.splitlora_old_B[adapter_name], b.detach().to(a.dtype)], dim=1)
                old_a = torch.cat([self.splitlora_old_A[adapter_name], a], dim=0)
                rank, (m, n) = old_a.shape[0], (self.out_features, self.in_features)
                if rank * (m + n) > m * n:
                    self.splitlora_old_dense[adapter_name] = old_b @ old_a
                    old_b, old_a = old_b[:, :0].contiguous(), old_a[:0].contiguous()
                self.splitlora_old_B[adapter_name] = old_b
                self.splitlora_old_A[adapter_name] = old_a
        param.zero_()  # elementwise: each FSDP2 process zeroes its own shard

    # --- the delta (the forward skeleton and merging are AdapterLinear's) ------------------------------------------

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """``dW_old + B A`` as an ``out x in`` matrix in the adapter dtype.

        Args:
            adapter_name: Name of the adapter.
        """
        b = self.splitlora_B[adapter_name]
        delta = b @ self.splitlora_A[adapter_name]
        if self.splitlora_old_A[adapter_name].shape[0]:
            delta = delta + self.splitlora_old_B[adapter_name] @ self.splitlora_old_A[adapter_name]
        if self.splitlora_old_dense[adapter_name].numel():
            delta = delta + self.splitlora_old_dense[adapter_name]
        return delta

    def adapter_output(self, x: torch.Tensor, adapter_name: str, rows: Optional[list[int]] = None) -> torch.Tensor:
        """``(dW_old + B A) x`` in factored form (``x`` already in the adapter dtype; see ``AdapterLayer``)."""
        out = F.linear(F.linear(x, self.splitlora_A[adapter_name]), self.splitlora_B[adapter_name])
        old_a = self.splitlora_old_A[adapter_name]
        if old_a.shape[0]:
            out = out + F.linear(F.linear(x, old_a), self.splitlora_old_B[adapter_name])
        dense = self.splitlora_old_dense[adapter_name]
        if dense.numel():
            out = out + F.linear(x, dense)
        return out


class Linear(AdapterLinear, SplitLoRALayer):
    """SplitLoRA on an ``nn.Linear`` (or a quantized linear layer PEFT can dequantize, e.g. bitsandbytes).

    Forward dispatch, mixed-adapter batches, merging and ``repr`` come from :class:`AdapterLinear`.

    Args:
        base_layer: The layer to adapt.
        adapter_name: Name of the first adapter.
        config: Its configuration.
        seed_key: The module's name in the model; seeds its frozen ``A`` draws.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: SplitLoRAConfig, seed_key: str, **kwargs):
        super().__init__()
        SplitLoRALayer.__init__(self, base_layer, seed_key, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config)
