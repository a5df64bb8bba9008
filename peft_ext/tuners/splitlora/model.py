"""The SplitLoRA tuner: finds and wraps target layers, and runs the task lifecycle across all of them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from peft.config import PeftConfig
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, get_quantization_kwargs
from torch import nn

from ...distributed import reject_zero3
from .._cycle import resolve_cycle_adapter
from ..adapter_tuner import AdapterTuner
from .collection import statistics_hooks
from .config import SplitLoRAConfig
from .layer import Linear, SplitLoRALayer
from .sequence_state import (
    fill_missing_sequence_state,
    is_sequence_key,
    load_sequence_state,
    missing_sequence_state,
    save_sequence_state,
)
from .statistics import statistics_mesh
from .task import commit_task, plan_task

__all__ = ["SplitLoRAModel", "TaskSplit"]


@dataclass(frozen=True)
class TaskSplit:
    """What ``end_task`` chose for one module.

    Args:
        task: 0-based index of the task that was finished.
        k_star: ``argmin_j f(j)`` (docs/methods.md (SplitLoRA)).
        primary: Number of primary directions, ``max(k_star, 1) + 1``; the next ``A`` is orthogonal to them.
        in_features: Input width ``d`` of the module.
    """

    task: int
    k_star: int
    primary: int
    in_features: int


def _reject_pending(model: nn.Module, adapter_name: str) -> None:
    pending = [
        layer._splitlora_seed_key
        for layer in model.modules()
        if isinstance(layer, SplitLoRALayer) and layer.has_pending_statistics(adapter_name)
    ]
    if pending:
        # They are not part of the saved state: saving now would silently drop part of the task's statistics.
        raise ValueError(
            f"SplitLoRA adapter {adapter_name!r} has statistics of the task in progress that are not saved "
            f"(e.g. {pending[0]!r}); call end_task() before saving."
        )


class SplitLoRAModel(AdapterTuner):
    """Creates a SplitLoRA model from a base model (docs/methods.md (SplitLoRA)).

    Use it through PEFT: ``model = get_peft_model(base, SplitLoRAConfig(...))``. The task lifecycle is on this tuner
    and reachable from the ``PeftModel``::

        for task in tasks:
            model.begin_task()                    # checks the state, makes B trainable; returns the task index
            train(model, task)                    # a fresh optimizer over the trainable parameters
            with torch.no_grad(), model.collect_statistics():
                for batch in task:                # forward hooks accumulate x x^T of every adapted module
                    model(**batch)
            model.end_task()                      # split, fold B A into dW_old, new A in the minor subspace

    Inference needs no task id: all tasks share one merged delta. Under ``torch.distributed`` every rank must call
    ``end_task`` (it all-reduces the task's statistics), so every rank picks the same subspace. Wrap the model with
    ``DistributedDataParallel(model, forward_sync_buffers=False)`` (``broadcast_buffers=False`` before torch 2.13):
    every SplitLoRA buffer is identical on all ranks by construction, and the default would re-send them (the
    covariances included) on every forward, as a collective that hangs when ranks run different numbers of batches.
    Collect statistics through the unwrapped model.

    Args:
        model: The model to adapt.
        config: The adapter's :class:`SplitLoRAConfig`.
        adapter_name: Name of the adapter (default ``"default"``).
        low_cpu_mem_usage: Create the adapter weights on the meta device (PEFT's loading path).
    """

    prefix: str = "splitlora_"
    tuner_layer_cls = SplitLoRALayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    def _prepare_target(
        self, peft_config: SplitLoRAConfig, adapter_name: str, target: nn.Module, current_key: str
    ) -> None:
        if current_key is None:
            raise ValueError("SplitLoRA needs the module's name (current_key) to seed its frozen A.")

    def _update_target(
        self, target: SplitLoRALayer, peft_config: SplitLoRAConfig, adapter_name: str, current_key: str
    ) -> None:
        target.update_layer(adapter_name, peft_config)

    def _new_layer(
        self, peft_config: SplitLoRAConfig, adapter_name: str, target: nn.Module, current_key: str
    ) -> nn.Module:
        return Linear(target, adapter_name, peft_config, current_key, **get_quantization_kwargs(self.model))

    # --- saving and loading ------------------------------------------------------------------------------------------

    @classmethod
    def _get_adapter_state_dict(
        cls,
        model: nn.Module,
        config: PeftConfig,
        adapter_name: str,
        state_dict: dict[str, torch.Tensor],
        unwanted_adapter_names: list[str],
    ) -> dict[str, torch.Tensor]:
        selected = super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)
        # Inference needs the delta only; the input statistics go to save_sequence_state on request.
        return {key: value for key, value in selected.items() if not is_sequence_key(key)}

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls, model: nn.Module, config: PeftConfig, adapter_name: str, state_dict: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        state_dict = super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
        state_dict = fill_missing_sequence_state(model, adapter_name, state_dict)
        # The finished tasks' stacked factors grow with every task; give the fresh layers the checkpoint's shapes
        # before load_state_dict compares them.
        for key, value in state_dict.items():
            for name in SplitLoRALayer.resizable_buffer_names:
                suffix = f".{name}.{adapter_name}"
                if not key.endswith(suffix):
                    continue
                layer = model.get_submodule(key[: -len(suffix)])
                if not isinstance(layer, SplitLoRALayer):
                    raise ValueError(f"checkpoint key {key!r} does not belong to a SplitLoRA layer")
                container = getattr(layer, name)
                current = container[adapter_name]
                if current.shape != value.shape:
                    container[adapter_name] = torch.zeros(value.shape, dtype=current.dtype, device=current.device)
        return state_dict

    # --- the task lifecycle -----------------------------------------------------------------------------------------

    def _layers(self, adapter_name: str | None = None) -> list[tuple[str, SplitLoRALayer]]:
        return [
            (layer._splitlora_seed_key, layer)
            for layer in self.model.modules()
            if isinstance(layer, SplitLoRALayer) and (adapter_name is None or adapter_name in layer.splitlora_B)
        ]

    def _resolve_adapter(self, adapter_name: str | None) -> str:
        return resolve_cycle_adapter(self, adapter_name, SplitLoRAConfig, "SplitLoRA")

    def _lifecycle_layers(self, adapter_name: str) -> list[tuple[str, SplitLoRALayer]]:
        layers = self._layers(adapter_name)
        if not layers:
            raise ValueError(f"adapter {adapter_name!r} adapts no module")
        merged = [key for key, layer in layers if layer.merged]
        if merged:
            raise ValueError(
                f"adapter {adapter_name!r} is merged into the base weights (e.g. {merged[0]!r}); call "
                "unmerge_adapter() before changing the task."
            )
        return layers

    def _shard_statistics(self, adapter_name: str, layers: list[tuple[str, SplitLoRALayer]]) -> None:
        # FSDP2: each process keeps its features' share of the statistics (shard_statistics; a no-op once done)
        if not self.peft_config[adapter_name].shard_statistics:
            return
        for _, layer in layers:
            mesh = statistics_mesh(layer.splitlora_B[adapter_name])
            if mesh is not None:
                layer.shard_statistics(adapter_name, mesh)

    @staticmethod
    def _reject_zero3(layers: list[tuple[str, SplitLoRALayer]], method: str) -> None:
        # end_task folds the whole B into dW_old: a ZeRO-3 partition is not B (FSDP2 shards are gathered instead)
        named = ((f"{key}.splitlora_B.{name}", b) for key, layer in layers for name, b in layer.splitlora_B.items())
        reject_zero3(named, f"SplitLoRA {method}")

    def finished_tasks(self, adapter_name: str | None = None) -> int:
        """Number of tasks finished with ``end_task`` (the 0-based index of the task in progress).

        Args:
            adapter_name: The SplitLoRA adapter (default: the single active one).
        """
        name = self._resolve_adapter(adapter_name)
        counts = {int(layer.splitlora_tasks[name]) for _, layer in self._layers(name)}
        if len(counts) != 1:
            raise ValueError(f"adapter {name!r}: modules disagree on the number of finished tasks ({sorted(counts)})")
        return counts.pop()

    def begin_task(self, adapter_name: str | None = None) -> int:
        """Check that the adapter can train the next task and make its ``B`` trainable (``A`` stays frozen).

        Args:
            adapter_name: The SplitLoRA adapter (default: the single active one).

        Returns:
            The 0-based index of the task about to be trained.
        """
        name = self._resolve_adapter(adapter_name)
        layers = self._lifecycle_layers(name)
        self._reject_zero3(layers, "begin_task")
        if self.peft_config[name].inference_mode:
            raise ValueError(
                f"adapter {name!r} was loaded for inference; load it with "
                "PeftModel.from_pretrained(..., is_trainable=True) to continue its task sequence."
            )
        if name not in self.active_adapters:
            raise ValueError(f"adapter {name!r} is not active ({self.active_adapters}); call set_adapter({name!r}).")
        pending = [key for key, layer in layers if layer.has_pending_statistics(name)]
        if pending:
            raise ValueError(
                f"statistics were collected for adapter {name!r} (e.g. on {pending[0]!r}) but end_task() was not "
                "called; call end_task() to finish the previous task first."
            )
        self._require_sequence_state(name)
        for _, layer in layers:
            layer.splitlora_B[name].requires_grad_(True)
        return self.finished_tasks(name)

    def _require_sequence_state(self, name: str) -> None:
        missing = missing_sequence_state(self.model, name)
        if missing:
            raise ValueError(
                f"adapter {name!r} was loaded without its sequence state ({self.finished_tasks(name)} finished "
                f"task(s) but no input statistics, e.g. on {missing[0]!r}): call "
                "model.load_sequence_state(folder) with the folder model.save_sequence_state(folder) wrote, to "
                "continue the task sequence (the adapter checkpoint alone serves inference)"
            )

    def save_sequence_state(self, save_directory: str, adapter_name: str | None = None) -> str:
        """Write what continuing the task sequence needs (input statistics, token counts, task index) to
        ``save_directory/splitlora_sequence_state.safetensors`` (``<adapter name>/`` below it for an adapter other
        than ``default``, as ``save_pretrained`` does), atomically. ``save_pretrained`` writes only what inference
        needs; call both to be able to continue.

        Args:
            save_directory: The checkpoint folder (normally the one given to ``save_pretrained``).
            adapter_name: The SplitLoRA adapter (default: the single active one).

        Returns:
            The path of the file written.
        """
        name = self._resolve_adapter(adapter_name)
        _reject_pending(self.model, name)
        self._require_sequence_state(name)
        return str(save_sequence_state(self.model, name, save_directory))

    def load_sequence_state(self, save_directory: str, adapter_name: str | None = None) -> str:
        """Restore the sequence state :meth:`save_sequence_state` wrote, into the adapter loaded from the same
        checkpoint (``PeftModel.from_pretrained(..., is_trainable=True)``); the sequence then continues exactly.
        Checked all or nothing: module names, shapes and the number of finished tasks must match the loaded adapter.

        Args:
            save_directory: The checkpoint folder.
            adapter_name: The SplitLoRA adapter (default: the single active one).

        Returns:
            The path of the file read.
        """
        name = self._resolve_adapter(adapter_name)
        return str(load_sequence_state(self.model, name, save_directory))

    @contextmanager
    def collect_statistics(
        self, adapter_name: str | None = None, mask_key: str | None = "attention_mask"
    ) -> Iterator[None]:
        """Accumulate the inputs of every adapted module during forward passes inside this block.

        The statistics of the task in progress stay apart until :meth:`end_task` folds them into the running,
        never-reset token-weighted covariance. Call it inside ``torch.no_grad()`` after training the task, as the
        paper does (the inputs then come from the trained model).

        Args:
            adapter_name: The SplitLoRA adapter (default: the single active one).
            mask_key: Name of the forward keyword argument holding the token mask (``(batch, seq)``, nonzero = real
                token); positions where it is 0 are skipped, in layers fed flattened tokens (``(batch x seq, d)``,
                OPT's MLP) too. ``None`` counts every position. With the default ``mask_key`` on an encoder-decoder
                (T5, BART) the encoder's tokens and the decoder's cross-attention inputs follow the encoder's
                ``attention_mask``, the decoder's tokens ``decoder_attention_mask`` (every decoder position when it
                is not given).
        """
        name = self._resolve_adapter(adapter_name)
        layers = self._layers(name)
        if not layers:
            raise ValueError(f"adapter {name!r} adapts no module")
        self._shard_statistics(name, layers)
        with statistics_hooks(self.model, [layer for _, layer in layers], name, mask_key):
            yield

    def end_task(self, adapter_name: str | None = None, process_group: Any = None) -> dict[str, TaskSplit]:
        """Finish the task in progress in every adapted module.

        All or nothing: every module is checked (finite ``B`` and statistics, some non-zero input) and its split
        computed before any changes, so a refusal (``ValueError`` naming the module and the value) leaves every
        module as it was and ``end_task`` can be retried. Per module: add the task's statistics to the running
        covariance (all-reduced over ``torch.distributed``
        when it is initialized), choose ``k*``, fold ``B A`` into the frozen ``dW_old``, draw the next task's frozen
        ``A`` in the minor subspace and set ``B = 0``. The model's outputs do not change.

        Args:
            adapter_name: The SplitLoRA adapter (default: the single active one).
            process_group: Group to all-reduce over (default: the default group, when initialized).

        Returns:
            ``{module name: TaskSplit}``.
        """
        name = self._resolve_adapter(adapter_name)
        layers = self._lifecycle_layers(name)
        self._reject_zero3(layers, "end_task")
        self._shard_statistics(name, layers)
        task_index = self.finished_tasks(name)
        self._require_sequence_state(name)
        # All-or-nothing: reduce and check every module's statistics and plan its split first, then change them all
        # (a refusal in one module must not leave the others a task ahead or their statistics counted twice).
        pending = [layer.reduced_statistics(name, process_group) for _, layer in layers]
        tokens = [int(layer.splitlora_tokens[name] + p["tokens"]) for (_, layer), p in zip(layers, pending)]
        empty = [key for (key, _), count in zip(layers, tokens) if count == 0]
        if empty:
            raise ValueError(
                f"no statistics for adapter {name!r} on {len(empty)} module(s) (e.g. {empty[0]!r}): run forward "
                "passes over the task's data inside `collect_statistics()` before `end_task()`"
            )
        plans = [plan_task(layer, name, p, process_group) for (_, layer), p in zip(layers, pending)]
        result = {}
        for (key, layer), plan in zip(layers, plans):
            info = commit_task(layer, name, plan)
            result[key] = TaskSplit(task=task_index, **{k: info[k] for k in ("k_star", "primary", "in_features")})
        return result

    def statistics_groups(self, adapter_name: str | None = None) -> list[list[str]]:
        """The modules holding one accumulator of the task in progress's statistics between them (fed the same
        inputs in ``collect_statistics``: a Llama block's q/k/v projections, its gate/up ones), in module order;
        modules without statistics of the task in progress are left out.

        Args:
            adapter_name: The SplitLoRA adapter (default: the single active one).
        """
        name = self._resolve_adapter(adapter_name)
        groups: dict[int, list[str]] = {}
        for key, layer in self._layers(name):
            pending = layer._splitlora_pending.get(name)
            if pending is not None:
                groups.setdefault(id(pending), []).append(key)
        return list(groups.values())

    def task_state(self, adapter_name: str | None = None) -> dict[str, dict[str, Any]]:
        """Per module: finished tasks, primary directions, the old delta's storage, statistics kind and size.

        Args:
            adapter_name: The SplitLoRA adapter (default: the single active one).
        """
        name = self._resolve_adapter(adapter_name)
        state = {}
        for key, layer in self._layers(name):
            state[key] = {
                "tasks": int(layer.splitlora_tasks[name]),
                "primary": int(layer.splitlora_primary[name]),
                "old_rank": int(layer.splitlora_old_A[name].shape[0]),
                "old_dense": bool(layer.splitlora_old_dense[name].numel()),
                "statistics": layer.statistics_kind(name),
                "tokens": int(layer.splitlora_tokens[name]),
                "statistics_error": layer.statistics_error(name),
            }
        return state
