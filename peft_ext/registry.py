"""Register new adapter types with Hugging Face PEFT.

PEFT's own ``register_peft_method`` only accepts names that are already members of ``peft.utils.PeftType``, a closed
``str`` enum. :func:`register_peft_type` first adds the member (``PeftType.<NAME>`` with value ``"<NAME>"``, exactly
like PEFT's built-in members), checks that the interpreter's enum machinery really sees it, and only then hands the
config and model classes to ``register_peft_method``. Once registered, ``get_peft_model``, ``save_pretrained``,
``PeftConfig.from_pretrained`` and ``PeftModel.from_pretrained`` work for the new type like for a built-in one.

The member exists only in processes that ran the registration: a process that unpickles a config or loads an
adapter (e.g. a spawned DataLoader worker) must import the module that registers the type first.

Example (``peft_ext.register_peft_type`` is :func:`register_peft_type`)::

    TOYSCALE = peft_ext.register_peft_type("toyscale", config_cls=ToyScaleConfig, model_cls=ToyScaleModel)
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

from peft.config import PeftConfig
from peft.mapping import (
    PEFT_TYPE_TO_CONFIG_MAPPING,
    PEFT_TYPE_TO_MIXED_MODEL_MAPPING,
    PEFT_TYPE_TO_PREFIX_MAPPING,
    PEFT_TYPE_TO_TUNER_MAPPING,
)
from peft.utils import PeftType, register_peft_method
from torch import nn

from .peft_type_enum import add_member, interpreter, undo_all

__all__ = ["register_peft_type", "registered_peft_types"]

_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
_PREFIX_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]*_")

# The record of what peft_ext registered lives on the enum class, not in this module: the members it describes live
# there too, so the record survives `importlib.reload` of this module or a fresh import after removing it from
# sys.modules. A module-level dict would be emptied by either, and the next registration would then mistake peft_ext's
# own member for a type built into PEFT.
_STATE_ATTR = "_peft_ext_registrations"

_LOCK = threading.RLock()


@dataclass(frozen=True)
class _Registration:
    member: PeftType
    config_cls: type
    model_cls: type
    prefix: str
    is_mixed_compatible: bool


def _registrations() -> dict[str, _Registration]:
    state = vars(PeftType).get(_STATE_ATTR)
    if state is None:
        state = {}
        # EnumType.__setattr__ only guards member names, so a plain attribute can be added to the class.
        setattr(PeftType, _STATE_ATTR, state)
    return state


def registered_peft_types() -> dict[str, PeftType]:
    """Return the adapter types that peft_ext registered with PEFT.

    Returns:
        A new dict mapping each registered lower-case name (e.g. ``"toyscale"``) to its ``PeftType`` member, in
        registration order. PEFT's built-in types are not included.
    """
    with _LOCK:
        return {name: registration.member for name, registration in _registrations().items()}


def register_peft_type(
    name: str,
    *,
    config_cls: type[PeftConfig],
    model_cls: type[nn.Module],
    prefix: str | None = None,
    is_mixed_compatible: bool = False,
) -> PeftType:
    """Add an adapter type to PEFT: a new ``PeftType`` member plus PEFT's config/tuner/prefix mappings.

    Idempotent: registering the same name with the same config class, model class, prefix and mixed flag again (for
    example because the module that registers it was imported twice or reloaded) changes nothing and returns the same
    member. Classes count as the same when they are the same object or, after a module reload, have the same
    ``__module__`` and ``__qualname__``; PEFT's mappings then point to the newly defined classes.

    Registration is all-or-nothing: if any step fails, the enum and PEFT's mappings are left as they were.

    Args:
        name: Lower-case identifier of the method, e.g. ``"toyscale"``; the member is ``PeftType.TOYSCALE`` with value
            ``"TOYSCALE"``, which is what ``adapter_config.json`` stores as ``"peft_type"``. It must not end with
            ``"_"`` and must not be a type built into PEFT (compared case-insensitively).
        config_cls: The config class, a subclass of ``peft.PeftConfig``. Its ``__post_init__`` must set
            ``self.peft_type`` to the member, like PEFT's own configs do, so that a config loaded from JSON (where
            ``peft_type`` is a plain string) carries the enum member again. If it can be built without arguments it
            is instantiated during registration to check this, so look the member up as ``PeftType.<NAME>`` there,
            not through a module global that is only assigned from this function's return value.
        model_cls: The tuner class (usually a ``peft.tuners.tuners_utils.BaseTuner`` subclass), an ``nn.Module``
            subclass. If it defines a ``prefix`` class attribute it must equal ``prefix``.
        prefix: Prefix of the adapter's parameter names; defaults to ``name + "_"``. It must end with ``"_"`` and must
            not be used by another PEFT type.
        is_mixed_compatible: Whether to also add the method to PEFT's mixed-model mapping. Note that PEFT 0.21's
            ``PeftMixedModel`` additionally checks a fixed ``COMPATIBLE_TUNER_TYPES`` tuple, so this only affects
            ``PeftMixedModel.from_pretrained``'s first check, not mixing itself.

    Returns:
        The ``PeftType`` member for ``name``.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If the name or prefix is invalid or taken, the name is registered with different classes, or
            ``config_cls`` does not round-trip its ``peft_type`` through JSON.
        RuntimeError: If this interpreter's enum implementation does not accept the new member; nothing is changed.
    """
    with _LOCK:
        upper = _check_name(name)
        if prefix is None:
            prefix = name + "_"
        _check_arguments(config_cls, model_cls, prefix, is_mixed_compatible)
        wanted = (config_cls, model_cls, prefix, is_mixed_compatible)

        existing = _registrations().get(name)
        if existing is not None:
            return _reregister(name, existing, *wanted)

        if upper in PeftType._value2member_map_:
            raise ValueError(f"Cannot register {name!r}: {upper!r} is already the value of a PeftType member.")
        if any(upper in vars(base) for base in PeftType.__mro__):
            raise ValueError(f"Cannot register {name!r}: {upper!r} is already an attribute of PeftType.")
        if prefix in PEFT_TYPE_TO_PREFIX_MAPPING.values():
            owners = sorted(str(t.value) for t, p in PEFT_TYPE_TO_PREFIX_MAPPING.items() if p == prefix)
            raise ValueError(
                f"Cannot register {name!r} with prefix {prefix!r}: that prefix is already used by "
                f"{', '.join(owners)}; pass a unique prefix=."
            )

        member, undo = add_member(upper)
        try:
            register_peft_method(
                name=name,
                config_cls=config_cls,
                model_cls=model_cls,
                prefix=prefix,
                is_mixed_compatible=is_mixed_compatible,
            )
            _check_registration(member, config_cls, model_cls, prefix)
        except BaseException:
            for mapping in (
                PEFT_TYPE_TO_CONFIG_MAPPING,
                PEFT_TYPE_TO_TUNER_MAPPING,
                PEFT_TYPE_TO_MIXED_MODEL_MAPPING,
                PEFT_TYPE_TO_PREFIX_MAPPING,
            ):
                mapping.pop(member, None)
            undo_all(undo, upper)
            raise

        _registrations()[name] = _Registration(member, config_cls, model_cls, prefix, is_mixed_compatible)
        return member


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}.")
    # The clash with a built-in type is checked before the spelling so that "LoRA" is reported as PEFT's LORA rather
    # than as "not lower case".
    upper = name.upper()
    if upper in PeftType._member_map_ and name.lower() not in _registrations():
        raise ValueError(
            f"Cannot register {name!r}: it clashes with PeftType.{upper}, a PEFT type built into PEFT; choose "
            "another name."
        )
    if not _NAME_PATTERN.fullmatch(name) or name.endswith("_"):
        raise ValueError(
            f"Invalid PEFT type name {name!r}: use a lower-case identifier that starts with a letter and does not end "
            "with '_' (letters, digits and inner underscores, e.g. 'my_method')."
        )
    return upper


def _check_arguments(config_cls: object, model_cls: object, prefix: object, is_mixed_compatible: object) -> None:
    if not (isinstance(config_cls, type) and issubclass(config_cls, PeftConfig)):
        raise TypeError(f"config_cls must be a subclass of peft.PeftConfig, got {config_cls!r}.")
    if not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
        raise TypeError(f"model_cls must be a torch.nn.Module subclass (usually a PEFT BaseTuner), got {model_cls!r}.")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str or None, got {type(prefix).__name__} {prefix!r}.")
    if not _PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(
            f"Invalid prefix {prefix!r}: it must be an identifier that starts with a letter and ends with '_' "
            "(e.g. 'my_method_')."
        )
    if not isinstance(is_mixed_compatible, bool):
        raise TypeError(f"is_mixed_compatible must be a bool, got {is_mixed_compatible!r}.")
    model_prefix = getattr(model_cls, "prefix", None)
    if model_prefix is not None and model_prefix != prefix:
        raise ValueError(
            f"{model_cls.__qualname__}.prefix is {model_prefix!r} but prefix={prefix!r} was passed; they must be "
            "equal."
        )


def _same_class(a: type, b: type) -> bool:
    # A reloaded module defines new class objects with the same qualified name; treat those as the same definition.
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def _reregister(
    name: str,
    existing: _Registration,
    config_cls: type,
    model_cls: type,
    prefix: str,
    is_mixed_compatible: bool,
) -> PeftType:
    differences = []
    if not _same_class(existing.config_cls, config_cls):
        differences.append(f"config_cls {_qualname(existing.config_cls)} != {_qualname(config_cls)}")
    if not _same_class(existing.model_cls, model_cls):
        differences.append(f"model_cls {_qualname(existing.model_cls)} != {_qualname(model_cls)}")
    if existing.prefix != prefix:
        differences.append(f"prefix {existing.prefix!r} != {prefix!r}")
    if existing.is_mixed_compatible != is_mixed_compatible:
        differences.append(f"is_mixed_compatible {existing.is_mixed_compatible} != {is_mixed_compatible}")
    if differences:
        raise ValueError(
            f"PEFT type {name!r} is already registered by peft_ext with different settings "
            f"({'; '.join(differences)}). Use another name for a different adapter type."
        )

    member = existing.member
    if existing.config_cls is not config_cls or existing.model_cls is not model_cls:
        PEFT_TYPE_TO_CONFIG_MAPPING[member] = config_cls
        PEFT_TYPE_TO_TUNER_MAPPING[member] = model_cls
        if is_mixed_compatible:
            PEFT_TYPE_TO_MIXED_MODEL_MAPPING[member] = model_cls
        _registrations()[name] = _Registration(member, config_cls, model_cls, prefix, is_mixed_compatible)
    return member


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_registration(member: PeftType, config_cls: type[PeftConfig], model_cls: type, prefix: str) -> None:
    """Check what PEFT's load path needs: lookups with the plain string from JSON, and a config that round-trips."""
    value = member._value_
    lookups_ok = (
        PEFT_TYPE_TO_CONFIG_MAPPING.get(value) is config_cls
        and PEFT_TYPE_TO_TUNER_MAPPING.get(value) is model_cls
        and PEFT_TYPE_TO_PREFIX_MAPPING.get(value) == prefix
    )
    if not lookups_ok:
        raise RuntimeError(
            f"PEFT's mappings do not resolve the plain string {value!r} to {member!r} on {interpreter()}, so "
            "from_pretrained could not load it."
        )

    try:
        config = config_cls()
    except (TypeError, ValueError):
        # Configs with required arguments cannot be probed here; the enum-level JSON check above still ran.
        return
    if config.peft_type is not member:
        raise ValueError(
            f"{config_cls.__qualname__}().peft_type is {config.peft_type!r}, expected {member!r}: set "
            f"self.peft_type = PeftType.{value} in {config_cls.__qualname__}.__post_init__."
        )
    # Mirror PeftConfig.save_pretrained (sets become lists) and from_pretrained (json -> from_peft_type).
    saved = {k: list(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    loaded = PeftConfig.from_peft_type(**json.loads(json.dumps(saved)))
    if type(loaded) is not config_cls or loaded.peft_type is not member:
        raise ValueError(
            f"{config_cls.__qualname__} does not survive a JSON round trip: it loads as {type(loaded).__qualname__} "
            f"with peft_type={loaded.peft_type!r}; its __post_init__ must set self.peft_type = PeftType.{value}."
        )
