"""The tuner side of the adapter skeleton: :class:`AdapterTuner` finds, wraps and updates the target layers.

PEFT's ``BaseTuner`` leaves ``_create_and_replace`` (wrap one matched module) and ``_enable_peft_forward_hooks``
(route ``adapter_names`` to the layers) to each tuner; every peft-ext tuner did both the same way. The shared part
is here, with small hooks for what differs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from ._common import forward_adapter_names, matches_targets, require_linear_target
from .adapter_layer import AdapterLayer

__all__ = ["AdapterTuner"]


class AdapterTuner(BaseTuner):
    """A ``BaseTuner`` for adapters on linear layers whose layer class is an :class:`AdapterLayer`.

    Subclasses set PEFT's ``prefix``, ``tuner_layer_cls`` (the :class:`AdapterLayer` subclass) and
    ``target_module_mapping``, and implement :meth:`_new_layer`. Wrapping a matched module runs, in order:
    refuse ``target_parameters`` -> :meth:`_prepare_target` -> if the module already carries adapters of this type,
    :meth:`_update_target` and stop -> :meth:`_check_target` -> :meth:`_new_layer` -> freeze it unless its adapter
    is active -> put it in the parent's place.
    """

    tuner_layer_cls: type[AdapterLayer]

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        """PEFT's injection, then a warning for every ``target_modules`` entry that matched no module.

        PEFT refuses a list of which nothing matches but adapts what some entries match and is silent about the
        others (``["qury", "value"]`` adapts only ``value``). A warning, not an error: PEFT's own tests and configs
        shared across architectures name modules that some models lack.
        """
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        targets = self.peft_config[adapter_name].target_modules
        if isinstance(targets, str) or not targets:
            return
        wrapped = list(self.targeted_module_names)
        missed = sorted(t for t in targets if not any(matches_targets(n, [t]) for n in wrapped))
        if missed and wrapped:
            warnings.warn(
                f"target_modules entries {missed} match no module of the model; only {len(wrapped)} modules matched "
                f"by the other entries got {type(self).__name__} adapters (e.g. {wrapped[0]!r}). Misspelled?",
                UserWarning,
                stacklevel=3,
            )

    # -- hooks ----------------------------------------------------------------------------------------------------

    def _prepare_target(self, peft_config: PeftConfig, adapter_name: str, target: nn.Module, current_key: str) -> None:
        """Run before a matched module is wrapped or updated (tuner-level state, extra checks); nothing by default.

        Args:
            peft_config: The adapter's config.
            adapter_name: The adapter.
            target: The matched module (possibly already an adapter layer).
            current_key: Its name in the model.
        """

    def _update_target(
        self, target: AdapterLayer, peft_config: PeftConfig, adapter_name: str, current_key: str
    ) -> None:
        """Add adapter ``adapter_name`` to a module that already carries adapters of this type.

        Default: ``target.update_layer(adapter_name, peft_config, inference_mode=peft_config.inference_mode)``.

        Args:
            target: The adapter layer.
            peft_config: The adapter's config.
            adapter_name: The adapter.
            current_key: Its name in the model.
        """
        target.update_layer(adapter_name, peft_config, inference_mode=peft_config.inference_mode)

    def _check_target(self, target: nn.Module, current_key: str) -> None:
        """Raise ``ValueError`` unless ``target`` can be wrapped; default: a linear or quantized linear layer.

        Args:
            target: The matched module.
            current_key: Its name in the model.
        """
        require_linear_target(target, current_key, self.tuner_layer_cls.method_name)

    def _new_layer(self, peft_config: PeftConfig, adapter_name: str, target: nn.Module, current_key: str) -> nn.Module:
        """The adapter layer wrapping ``target`` with its first adapter ``adapter_name``.

        Args:
            peft_config: The adapter's config.
            adapter_name: The adapter.
            target: The module to wrap.
            current_key: Its name in the model.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement _new_layer")

    # -- PEFT's BaseTuner API -------------------------------------------------------------------------------------

    def _create_and_replace(
        self,
        peft_config: PeftConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        *,
        parameter_name: Optional[str] = None,
    ) -> None:
        if parameter_name is not None:
            raise ValueError(
                f"{self.tuner_layer_cls.method_name} adapts whole linear layers, not parameters; got "
                f"target_parameters {parameter_name!r}"
            )
        self._prepare_target(peft_config, adapter_name, target, current_key)
        if isinstance(target, self.tuner_layer_cls):
            self._update_target(target, peft_config, adapter_name, current_key)
            return
        self._check_target(target, current_key)
        new_module = self._new_layer(peft_config, adapter_name, target, current_key)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """PEFT's cast (``autocast_adapter_dtype``: bfloat16 / float16 adapter weights upcast to float32, else left
        in the base's dtype), then each layer's :meth:`~.adapter_layer.AdapterLayer.after_adapter_cast`; adapters of a
        dtype no adapter computes in (float8, complex) are refused with a ``TypeError``.

        Args:
            adapter_name: The adapter just created or loaded.
            autocast_adapter_dtype: Upcast half-precision adapters to float32 (PEFT's default).
        """
        super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype=autocast_adapter_dtype)
        for layer in self.adapter_layers():
            if layer.carries_adapter(adapter_name):
                layer.after_adapter_cast(adapter_name, autocast_adapter_dtype)
                # e.g. a float8 base with autocast_adapter_dtype=False: refused here, not at the first forward
                layer.check_adapter_dtypes([adapter_name])

    def adapter_layers(self) -> list[AdapterLayer]:
        """Every layer of this tuner's type in the model, in module order."""
        return [module for module in self.model.modules() if isinstance(module, self.tuner_layer_cls)]

    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        # Mixed-adapter batches: PeftModel.forward routes `adapter_names` here; every layer receives it as a kwarg.
        names = kwargs.pop("adapter_names", None)
        with forward_adapter_names(
            self,
            names,
            lambda: set().union(*(layer.carried_adapters() for layer in self.adapter_layers())),
            (self.tuner_layer_cls,),
            merged=lambda: any(layer.merged for layer in self.adapter_layers()),
        ):
            yield
