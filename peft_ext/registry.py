"""Register new adapter types with Hugging Face PEFT.

PEFT's own ``register_peft_method`` only accepts names that are already members of ``peft.utils.PeftType``, a closed
``str`` enum. :func:`register_peft_type` first adds the member (``PeftType.<NAME>`` with value ``"<NAME>"``, exactly
like PEFT's built-in members), checks that the interpreter's enum machinery really sees it, and only then hands the
config and model classes to ``register_peft_method``. Once registered, ``get_peft_model``, ``save_pretrained``,
``PeftConfig.from_pretrained`` and ``PeftModel.from_pretrained`` work for the new type like for a built-in one.

The member exists only in processes that ran the registration: a process that unpickles a config or loads an
adapter (e.g. a spawned DataLoader worker) must import the module that registers the type first.

Example::

    from peft_ext import register_peft_type

    TOYSCALE = register_peft_type("toyscale", config_cls=ToyScaleConfig, model_cls=ToyScaleModel)
"""

from __future__ import annotations

import copy
import json
import pickle
import platform
import re
import threading
from collections.abc import Callable
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

__all__ = ["register_peft_type", "registered_peft_types"]

_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
_PREFIX_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]*_")

# The record of what peft_ext registered lives on the enum class, not in this module: the members it describes live
# there too, so the record survives `importlib.reload` of this module or a fresh import after removing it from
# sys.modules. A module-level dict would be emptied by either, and the next registration would then mistake peft_ext's
# own member for a type built into PEFT.
_STATE_ATTR = "_peft_ext_registrations"

_LOCK = threading.RLock()

_Undo = Callable[[], None]


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


def _python() -> str:
    return f"Python {platform.python_version()} ({platform.python_implementation()})"


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

        member, undo = _add_member(upper)
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
            _undo_all(undo, upper)
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


# --- Adding the enum member ---------------------------------------------------------------------------------------
#
# CPython builds enum members in enum._proto_member.__set_name__ (3.11+) or EnumType.__new__ (3.10). For a str enum
# without a custom __new__ such as PeftType, a member is a str instance of the enum class carrying _value_, _name_,
# __objclass__ and (3.11+) _sort_order_, and it is reachable through four structures, which are all that
# lookups consult on 3.10-3.13: the class attribute (getattr; 3.10/3.11 also fall back to _member_map_ via
# EnumType.__getattr__, 3.12+ do not), _member_names_ (iteration, len), _member_map_ (PeftType[NAME], __members__)
# and _value2member_map_ (PeftType(value), unpickling, `in` on 3.12+). Each step below writes one of them and returns
# how to undo it, so that a failure at any point restores the enum exactly.


def _set_class_attribute(member: PeftType) -> _Undo:
    # type.__setattr__/__delattr__ bypass EnumType's guards against reassigning or deleting members.
    type.__setattr__(PeftType, member._name_, member)
    return lambda: type.__delattr__(PeftType, member._name_)


def _append_member_name(member: PeftType) -> _Undo:
    PeftType._member_names_.append(member._name_)
    return lambda: PeftType._member_names_.remove(member._name_)


def _map_name(member: PeftType) -> _Undo:
    PeftType._member_map_[member._name_] = member
    return lambda: PeftType._member_map_.pop(member._name_)


def _map_value(member: PeftType) -> _Undo:
    PeftType._value2member_map_[member._value_] = member
    # Some CPython versions also keep a list of hashable values for `in` checks; keep it in step where present.
    hashable_values = vars(PeftType).get("_hashable_values_")
    if isinstance(hashable_values, list):
        hashable_values.append(member._value_)

    def undo() -> None:
        PeftType._value2member_map_.pop(member._value_)
        if isinstance(hashable_values, list):
            hashable_values.remove(member._value_)

    return undo


_INSTALL_STEPS: tuple[Callable[[PeftType], _Undo], ...] = (
    _set_class_attribute,
    _append_member_name,
    _map_name,
    _map_value,
)


def _check_internals() -> None:
    expected = {"_member_map_": dict, "_value2member_map_": dict, "_member_names_": list}
    problems = [
        f"PeftType.{attr} is not a {kind.__name__}"
        for attr, kind in expected.items()
        if not isinstance(vars(PeftType).get(attr), kind)
    ]
    if getattr(PeftType, "_member_type_", None) is not str:
        problems.append("PeftType._member_type_ is not str")
    if problems:
        raise RuntimeError(
            f"Cannot extend peft.utils.PeftType on {_python()}: its enum internals are not what peft_ext supports "
            f"({'; '.join(problems)}). Supported: CPython 3.10-3.13."
        )


def _add_member(upper: str) -> tuple[PeftType, list[_Undo]]:
    """Add and verify ``PeftType.<upper>``; return it with the undo steps that take it out again."""
    _check_internals()
    reference = PeftType.LORA
    size_before = len(PeftType)

    member = str.__new__(PeftType, upper)
    member._value_ = upper
    member._name_ = upper
    member.__objclass__ = PeftType
    member._sort_order_ = size_before
    member.__init__(upper)

    undo: list[_Undo] = []
    try:
        for step in _INSTALL_STEPS:
            undo.append(step(member))
    except Exception as exc:
        _undo_all(undo, upper)
        raise RuntimeError(f"Extending peft.utils.PeftType with {upper} failed on {_python()}: {exc!r}") from exc

    failed = [label for label, check in _member_checks(member, reference, size_before) if not _passes(check)]
    if failed:
        _undo_all(undo, upper)
        raise RuntimeError(
            f"Extending peft.utils.PeftType with {upper} does not work on {_python()}; these checks failed: "
            f"{'; '.join(failed)}. The enum was restored; peft_ext's enum extension needs updating for this "
            "interpreter."
        )
    return member, undo


def _undo_all(undo: list[_Undo], upper: str) -> None:
    errors = []
    for step in reversed(undo):
        try:
            step()
        except Exception as exc:  # keep undoing the other steps; report them all below
            errors.append(repr(exc))
    undo.clear()
    if errors:
        raise RuntimeError(
            f"Could not fully remove PeftType.{upper} again on {_python()} ({'; '.join(errors)}); PeftType may be "
            "inconsistent, restart the interpreter."
        )


def _passes(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:
        return False


def _member_checks(member: PeftType, reference: PeftType, size_before: int) -> list[tuple[str, Callable[[], bool]]]:
    upper = member._name_

    def like_reference(render: Callable[[object], str]) -> bool:
        # Built-in members have name == value, so swapping the name in their rendering gives the expected one.
        return render(member) == render(reference).replace(reference._name_, upper)

    def config_json_round_trip() -> bool:
        # What save_pretrained/from_pretrained do with peft_type: dataclasses.asdict (deep copy), json, plain str.
        dumped = json.dumps(PeftConfig(peft_type=member).to_dict())
        loaded = json.loads(dumped)["peft_type"]
        return type(loaded) is str and loaded == upper and PeftType(loaded) is member

    return [
        (f"PeftType[{upper!r}] is the member", lambda: PeftType[upper] is member),
        (f"PeftType({upper!r}) is the member", lambda: PeftType(upper) is member),
        (f"getattr(PeftType, {upper!r}) is the member", lambda: getattr(PeftType, upper) is member),
        ("the member is in list(PeftType) exactly once", lambda: [m for m in PeftType if m is member] == [member]),
        ("len(PeftType) grew by one", lambda: len(PeftType) == size_before + 1),
        ("the member is `in PeftType`", lambda: member in PeftType),
        (f"PeftType.__members__[{upper!r}] is the member", lambda: PeftType.__members__[upper] is member),
        ("member.name and member.value", lambda: member.name == upper and member.value == upper),
        (
            "str equality and hash with the value",
            lambda: member == upper and upper == member and hash(member) == hash(upper),
        ),
        (
            "isinstance(member, PeftType) and isinstance(member, str)",
            lambda: isinstance(member, PeftType) and isinstance(member, str),
        ),
        ("repr() like built-in members", lambda: like_reference(repr)),
        ("str() like built-in members", lambda: like_reference(str)),
        ("format() like built-in members", lambda: like_reference(format)),
        ("copy.deepcopy keeps the member", lambda: copy.deepcopy(member) is member),
        ("pickle round trip", lambda: pickle.loads(pickle.dumps(member)) is member),
        ("JSON round trip of a PeftConfig's peft_type", config_json_round_trip),
    ]


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
            f"PEFT's mappings do not resolve the plain string {value!r} to {member!r} on {_python()}, so "
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
