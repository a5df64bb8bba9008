"""The MoRA tuner: pairs the top layers of a dual encoder's towers, owns their shared factors, wraps projections."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ...precision import is_half
from .._common import matches_targets, require_linear_target
from ..adapter_tuner import AdapterTuner
from .config import MoRAConfig
from .layer import Linear, MoRALayer, SharedFactors

__all__ = ["MoRAModel", "MoRATarget", "plan_targets"]


@dataclass(frozen=True)
class MoRATarget:
    """Where one adapted projection sits: its tower, its layer index there, and its layer pair's key.

    Args:
        modality: ``"text"`` or ``"vision"``.
        layer: Layer index inside the tower.
        pair_key: Key of the shared factors, ``"t<text layer>_v<vision layer>"``.
        width: ``in_features == out_features`` of the projection.
    """

    modality: str
    layer: int
    pair_key: str
    width: int


def _width(module: nn.Module, key: str) -> int:
    require_linear_target(module, key, "MoRA")
    base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
    if base.in_features != base.out_features:
        raise ValueError(
            f"MoRA adapts square projections only (its shared delta S (G) S^T is d x d); {key!r} is "
            f"{base.out_features} x {base.in_features}. Restrict `target_modules` to attention projections."
        )
    return base.in_features


def plan_targets(model: nn.Module, config: MoRAConfig) -> dict[str, MoRATarget]:
    """Resolve which modules a config adapts in ``model`` and how the two towers' layers pair up.

    Args:
        model: The dual encoder (e.g. transformers' ``CLIPModel``).
        config: The MoRA config.

    Returns:
        Module name -> :class:`MoRATarget`, in module order.

    Raises:
        ValueError: If a tower has no matching projection, the requested layers do not exist in both towers, or the
            projections of one tower's layer pair differ in width.
    """
    found: dict[str, dict[int, list[tuple[str, nn.Module]]]] = {"text": {}, "vision": {}}
    patterns = {"text": re.compile(config.text_pattern), "vision": re.compile(config.vision_pattern)}
    for key, module in model.named_modules():
        if not key or not matches_targets(key, config.target_modules):
            continue
        hits = {m: p.search(key) for m, p in patterns.items()}
        hits = {m: h for m, h in hits.items() if h is not None}
        if len(hits) == 2:
            raise ValueError(f"module {key!r} matches both `text_pattern` and `vision_pattern`; make them disjoint")
        for modality, hit in hits.items():
            found[modality].setdefault(int(hit.group(1)), []).append((key, module))
    for modality, layers in found.items():
        if not layers:
            pattern = config.text_pattern if modality == "text" else config.vision_pattern
            raise ValueError(
                f"no {modality}-tower module matches `target_modules`={sorted(config.target_modules)!r} inside "
                f"`{modality}_pattern`={pattern!r}; MoRA needs both towers of a dual encoder"
            )
    if config.layers is not None:
        for modality, layers in found.items():
            missing = sorted(set(config.layers) - set(layers))
            if missing:
                raise ValueError(
                    f"`layers` asks for layers {missing} but the {modality} tower has target projections in layers "
                    f"{sorted(layers)} only"
                )
        pairs = [(i, i) for i in sorted(config.layers)]
    else:
        text_top = sorted(found["text"])[-config.top_layers :]
        vision_top = sorted(found["vision"])[-config.top_layers :]
        if len(text_top) < config.top_layers or len(vision_top) < config.top_layers:
            raise ValueError(
                f"`top_layers`={config.top_layers} but the text tower has {len(found['text'])} and the vision tower "
                f"{len(found['vision'])} layers with target projections"
            )
        pairs = list(zip(text_top, vision_top))

    plan: dict[str, MoRATarget] = {}
    for t, v in pairs:
        key = f"t{t}_v{v}"
        for modality, layer in (("text", t), ("vision", v)):
            widths = {name: _width(module, name) for name, module in found[modality][layer]}
            if len(set(widths.values())) != 1:
                raise ValueError(f"the {modality} projections of layer {layer} share S but differ in width: {widths}")
            for name, width in widths.items():
                if config.r > width:
                    raise ValueError(
                        f"`r`={config.r} is larger than the width {width} of {name!r}: the factors are {width} x r "
                        f"and a rank above the width adds nothing. Use r <= {width}."
                    )
                plan[name] = MoRATarget(modality, layer, key, width)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return dict(sorted(plan.items(), key=lambda item: order[item[0]]))


class MoRAModel(AdapterTuner):
    """MoRA adapters (docs/methods.md (MoRA)) on the top layers of both towers of a dual encoder.

    Use it through PEFT: ``get_peft_model(clip_model, MoRAConfig(r=4))``. The tuner owns the modality-common factors
    (``mora_shared_text[adapter][pair]`` = ``S_A``, ``mora_shared_vision[adapter][pair]`` = ``S_B``), so they are
    trained, saved and loaded once and stay tied across all projections of a layer pair; each projection carries its
    own specific LoRA pair and magnitudes. Supports several adapters, merging, disabling, deleting, mixed-adapter
    batches (``model(..., adapter_names=[...])`` in eval mode) and bitsandbytes 8-bit / 4-bit bases. Either tower
    can run alone (``get_text_features`` / ``get_image_features``): the other tower's factor still shapes the delta
    through its Gram matrix but needs no input.

    Args:
        model: The dual encoder.
        config: The adapter configuration.
        adapter_name: Name of the first adapter.
        low_cpu_mem_usage: Accepted for PEFT's signature; MoRA adapters are small and always materialized.
    """

    prefix: str = "mora_"
    tuner_layer_cls = MoRALayer

    def _prepare_adapter_config(self, peft_config: MoRAConfig, model_config: dict) -> MoRAConfig:
        if peft_config.target_modules is None:
            raise ValueError("MoRA needs `target_modules` (suffixes of square projections), got None")
        return peft_config

    def _shared(self) -> SharedFactors:
        if "mora_shared_text" not in self._modules:
            self.mora_shared_text = nn.ModuleDict()
            self.mora_shared_vision = nn.ModuleDict()
            self._mora_shared_view = SharedFactors(self.mora_shared_text, self.mora_shared_vision)
        return self._mora_shared_view

    def _prepare_model(self, peft_config: MoRAConfig, model: nn.Module) -> None:
        # Resolved here (inject_adapter calls this before matching, for the first and for every added adapter)
        # because the pairing depends on the model's depth, which the static config cannot see.
        self._mora_plan = plan_targets(model, peft_config)
        self._shared()

    def _check_target_module_exists(self, peft_config: MoRAConfig, key: str) -> bool:
        return key in self._mora_plan

    def _ensure_shared(self, adapter_name: str, target: MoRATarget, config: MoRAConfig, device: torch.device) -> None:
        shared = self._shared()
        trainable = adapter_name in self.active_adapters and not config.inference_mode
        std = config.resolved_shared_init_std
        for modality, container in (("text", shared.text), ("vision", shared.vision)):
            if adapter_name not in container:
                container[adapter_name] = nn.ParameterDict()
            if target.pair_key in container[adapter_name]:
                continue
            widths = {
                t.width for t in self._mora_plan.values() if t.pair_key == target.pair_key and t.modality == modality
            }
            (width,) = widths
            factor = torch.randn(width, config.r, device=device) * std
            container[adapter_name][target.pair_key] = nn.Parameter(factor, requires_grad=trainable)

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """PEFT's cast of the layers' parameters, then the shared factors (which live on the tuner, where PEFT's cast
        does not look) take the same dtype: with ``autocast_adapter_dtype=False`` on a bfloat16 / float16 base, that
        dtype. The composed delta is computed in float32 either way (:meth:`~.layer.MoRALayer.get_delta_weight`).

        Args:
            adapter_name: The adapter.
            autocast_adapter_dtype: Upcast half-precision adapters to float32 (PEFT's default).
        """
        super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype=autocast_adapter_dtype)
        layers = [layer for layer in self.adapter_layers() if layer.carries_adapter(adapter_name)]
        if not layers:
            return
        dtype = layers[0].mora_spec_A[adapter_name].dtype
        if not is_half(dtype):
            return
        shared = self._shared()
        for container in (shared.text, shared.vision):
            factors = container[adapter_name]
            for key, factor in factors.items():
                factors[key] = nn.Parameter(factor.data.to(dtype), requires_grad=factor.requires_grad)

    def _prepare_target(self, peft_config: MoRAConfig, adapter_name: str, target: nn.Module, current_key: str) -> None:
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        self._ensure_shared(adapter_name, self._mora_plan[current_key], peft_config, base.weight.device)

    def _update_target(self, target: MoRALayer, peft_config: MoRAConfig, adapter_name: str, current_key: str) -> None:
        pair_key = self._mora_plan[current_key].pair_key
        target.update_layer(adapter_name, pair_key, peft_config, inference_mode=peft_config.inference_mode)

    def _check_target(self, target: nn.Module, current_key: str) -> None:
        pass  # plan_targets checked every target (linear and square) before any was wrapped

    def _new_layer(self, peft_config: MoRAConfig, adapter_name: str, target: nn.Module, current_key: str) -> nn.Module:
        info = self._mora_plan[current_key]
        return Linear(target, adapter_name, info.pair_key, info.modality, self._shared(), peft_config)

    def _check_merge_allowed(self) -> None:
        # every layer is checked before the first one merges (merge_adapter, merge_and_unload), so a sharded model
        # is refused with all its weights unchanged
        super()._check_merge_allowed()
        for layer in self.adapter_layers():
            layer.refuse_sharded(list(layer.mora_spec_A.keys()), "merge")

    def set_adapter(self, adapter_name: str | list[str], inference_mode: bool = False) -> None:
        """Set the active adapter(s); only their shared and specific parameters require grad.

        Args:
            adapter_name: The adapter(s) to activate.
            inference_mode: Freeze them as well.
        """
        super().set_adapter(adapter_name, inference_mode=inference_mode)
        self._set_shared_requires_grad(adapter_name, inference_mode)

    def set_requires_grad(self, adapter_names: str | list[str], requires_grad: bool = True) -> None:
        """Enable or disable gradients of the given adapters, their shared factors included.

        Args:
            adapter_names: The adapter(s).
            requires_grad: Whether they require grad.
        """
        super().set_requires_grad(adapter_names, requires_grad=requires_grad)
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        shared = self._shared()
        for container in (shared.text, shared.vision):
            for name in names:
                if name in container:
                    container[name].requires_grad_(requires_grad)

    def _set_shared_requires_grad(self, adapter_name: str | list[str], inference_mode: bool) -> None:
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        shared = self._shared()
        for container in (shared.text, shared.vision):
            for name, factors in container.items():
                factors.requires_grad_(name in names and not inference_mode)

    def delete_adapter(self, adapter_name: str) -> None:
        """Delete an adapter: its layer parameters and its shared factors.

        Args:
            adapter_name: The adapter to delete.
        """
        super().delete_adapter(adapter_name)
        shared = self._shared()
        for container in (shared.text, shared.vision):
            if adapter_name in container:
                del container[adapter_name]

    def shared_factors(self, adapter_name: str = "default") -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
        """The modality-common pairs of an adapter: pair key -> ``(S_A, S_B)``.

        Args:
            adapter_name: The adapter.
        """
        shared = self._shared()
        if adapter_name not in shared.text:
            raise ValueError(f"unknown adapter {adapter_name!r}; known: {sorted(shared.text.keys())}")
        return {k: (shared.text[adapter_name][k], shared.vision[adapter_name][k]) for k in shared.text[adapter_name]}
