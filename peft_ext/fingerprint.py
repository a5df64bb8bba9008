"""The fingerprint of a config: a hash of every setting that changes a result, declared by the settings themselves.

A job refuses to ``--resume`` an output folder whose results were made with other settings; the fingerprint it
compares is :func:`fingerprint` of the validated config. A dataclass field says how it takes part through its
metadata, so that whoever adds a setting decides there, not in a list elsewhere:

- :func:`not_a_setting` - never hashed (whether progress bars show, where trained models go, a note for readers);
- :func:`added_later` - hashed only when it differs from its default, so runs fingerprinted before the setting
  existed still resume;
- ``metadata={FINGERPRINT: predicate}`` - left out whenever ``predicate(value)`` is true (a section that is off).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

__all__ = ["FINGERPRINT", "added_later", "fingerprint", "fingerprint_data", "json_default", "not_a_setting"]

#: The metadata key of a dataclass field: a predicate of the field's value, true where the value is left out.
FINGERPRINT = "fingerprint"


def _always(value: Any) -> bool:
    return True


def not_a_setting(default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field that changes no result: the fingerprint never holds it (``kwargs`` go to ``field``)."""
    metadata = {**kwargs.pop("metadata", {}), FINGERPRINT: _always}
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def added_later(default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field added after runs were fingerprinted: hashed only when it differs from its default (a
    ``default_factory`` works too)."""
    factory = kwargs.get("default_factory", dataclasses.MISSING)
    if factory is dataclasses.MISSING:

        def at_default(value: Any) -> bool:
            return bool(value == default)

        metadata = {**kwargs.pop("metadata", {}), FINGERPRINT: at_default}
        return dataclasses.field(default=default, metadata=metadata, **kwargs)

    def at_factory_default(value: Any) -> bool:
        return bool(value == factory())

    metadata = {**kwargs.pop("metadata", {}), FINGERPRINT: at_factory_default}
    return dataclasses.field(metadata=metadata, **kwargs)


def fingerprint_data(value: Any) -> Any:
    """``value`` as plain JSON-able data, as :func:`dataclasses.asdict` makes it, less the fields whose metadata
    leaves them out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        data = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            skip: Callable[[Any], bool] | None = f.metadata.get(FINGERPRINT)
            if skip is not None and skip(item):
                continue
            data[f.name] = fingerprint_data(item)
        return data
    if isinstance(value, (list, tuple)):
        return [fingerprint_data(v) for v in value]
    if isinstance(value, dict):
        return {k: fingerprint_data(v) for k, v in value.items()}
    return value


def json_default(value: Any) -> Any:
    """``json.dumps``'s fallback for config values: sets (PEFT configs turn target_modules into a set) in a stable
    order, anything else as text."""
    return sorted(map(str, value)) if isinstance(value, (set, frozenset)) else str(value)


def fingerprint(config: Any) -> str:
    """16 hex digits of a SHA-256 over :func:`fingerprint_data` of ``config`` (any dataclass)."""
    text = json.dumps(fingerprint_data(config), sort_keys=True, default=json_default)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
