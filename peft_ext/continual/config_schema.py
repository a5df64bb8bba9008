"""Typed sections of a YAML config: build a dataclass from a mapping, checking every key and type.

Errors are one :class:`ConfigError` naming the key with its full path (``methods[2].adapter.pool_size``) and what
would be valid, with a did-you-mean for a misspelt key or name.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from .methods import AdapterOptions


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, missing or impossible."""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(typing.get_args(tp)[1])}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to float, '1e-3' parsed)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(f"`{key}` must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"`{key}` must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if tp is Any:
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"`{key}` must be a {_type_name(tp)}, got {type(value).__name__} {value!r}")
        key_type, item = typing.get_args(tp)
        return {_coerce(k, key_type, key): _coerce(v, item, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"`{key}` must be a {_type_name(tp)}, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"`{key}` must be null, got {value!r}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"`{key}` must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"`{key}` must be an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        # YAML 1.1 reads `1e-3` (no dot) as a string; accept it as the number the user meant.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"`{key}` must be a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"`{key}` must be a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for `{key}`")  # a bug in a section class, not in the config


def check_local_model_path(key: str, value: str) -> None:
    """Raise ``ValueError`` naming ``key`` when the model ``value`` looks like a local path (starts with ``.``, ``/``
    or ``~``) but no such directory exists; a hub name or a known short name passes.

    Args:
        key: The config key, for the message.
        value: The model name or path.
    """
    if value.startswith((".", "/", "~")) and not Path(value).expanduser().is_dir():
        raise ValueError(f"`{key}` {value!r} looks like a local path but no such directory exists")


def unknown_key(key: str, prefix: str, valid: list[str]) -> ConfigError:
    """The error for a key that ``valid`` does not list, with a did-you-mean."""
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    return ConfigError(f"unknown key `{prefix}{key}`{hint}; valid keys: {', '.join(valid)}")


def unknown_value(key: str, value: Any, valid: list[str]) -> ConfigError:
    """The error for a value outside a fixed set of names, with a did-you-mean."""
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    return ConfigError(f"`{key}` must be one of {', '.join(valid)}; got {value!r}{hint}")


def build_section(cls: type, data: Any, prefix: str = "", skip: tuple[str, ...] = ()) -> Any:
    """Build the dataclass ``cls`` from a mapping, checking keys and types; then run its ``validate()``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        where = f"`{prefix.rstrip('.')}`" if prefix else "the config"
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    kwargs = {}
    for key, value in data.items():
        if key in skip:
            continue
        if key not in fields:
            raise unknown_key(str(key), prefix, fields)
        if key == "adapter" and issubclass(cls, AdapterOptions):
            kwargs[key] = build_adapter_section(cls, value, f"{prefix}adapter.")
        elif dataclasses.is_dataclass(hints[key]):
            kwargs[key] = build_nested_section(hints[key], value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, hints[key], prefix + key)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs
        and f.name not in skip
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing key `{prefix}{missing[0]}`")
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        try:
            obj.validate()
        except ValueError as err:
            raise _prefixed(err, prefix) from None
    return obj


def build_nested_section(cls: type, data: Any, prefix: str) -> Any:
    """Build a nested settings dataclass (e.g. PCLR's ``cycle:``) whose own ``__post_init__`` validates the values.

    Args:
        cls: The dataclass.
        data: Its mapping (``None``: every default).
        prefix: Key prefix of the section (``methods[6].cycle.``).
    """
    try:
        return build_section(cls, data, prefix)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise _prefixed(err, prefix) from None


def _prefixed(err: Exception, prefix: str) -> ConfigError:
    """``err`` as a ConfigError whose leading `` `key` `` names the full path (``methods[2].adapter.pool_size``)."""
    msg = str(err)
    return ConfigError(msg.replace("`", f"`{prefix}", 1) if msg.startswith("`") else f"{prefix.rstrip('.')}: {msg}")


def build_adapter_section(cls: type[AdapterOptions], data: Any, prefix: str) -> Any:
    """Build the adapter config of ``cls`` from its ``adapter:`` mapping; the config class validates the values.

    Args:
        cls: The method's options class.
        data: The mapping (``None``: every default).
        prefix: Key prefix of the section (``methods[2].adapter.``).
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"`{prefix.rstrip('.')}` must be a mapping of adapter fields, got {type(data).__name__}")
    valid = cls.adapter_keys()
    for key in data:
        if key in cls.method_owned:
            raise ConfigError(f"`{prefix}{key}` is set by the method, not by the config")
        if key not in valid:
            raise unknown_key(str(key), prefix, valid)
    try:
        return cls.adapter_cls()(**data)
    except (ValueError, TypeError) as err:
        raise _prefixed(err, prefix) from None
