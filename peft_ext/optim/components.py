"""The one registry of :class:`~peft_ext.optim.SubspaceAdamW`'s exchangeable parts, and the base class they share.

A part is a subspace basis (``kind = "basis"``, :mod:`.bases`) or an update rule (``kind = "update"``,
:mod:`.update_rules`). Each declares its options as the keyword arguments of its constructor and validates them
there, so ``DCTBasis(dct_method="svd")`` fails where it is written, with the option's name and the valid values. A
param group stores a part as its registered name plus its options (plain numbers and strings), never the object:
``state_dict()``, ``copy.deepcopy`` and pickling keep everything, and :meth:`Component.from_group` rebuilds the object
when a step needs it (construction is a few attribute assignments).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

__all__ = ["KINDS", "REGISTRY", "Component", "component_class", "component_of", "register", "registered_names"]

#: The kinds of part and the optimizer argument that picks each.
KINDS = ("basis", "update")

#: ``kind -> name -> class``: every registered basis and update rule. Add one with :func:`register`.
REGISTRY: dict[str, dict[str, type[Component]]] = {kind: {} for kind in KINDS}

C = TypeVar("C", bound="type[Component]")


class Component:
    """A basis or an update rule: a name in :data:`REGISTRY` and options declared by ``__init__``'s keywords.

    Subclasses store every option under the attribute of the same name (``self.dct_method = dct_method``), after
    validating it, so :meth:`options` can read them back.
    """

    #: ``"basis"`` or ``"update"``.
    kind: ClassVar[str]
    #: The value of the optimizer's ``basis=`` / ``update=`` argument that selects this class.
    name: ClassVar[str]
    #: Options of other parts that this one cannot honour, ``{option: why}``: the reason is added to the error a
    #: param group that sets one of them gets.
    why_not: ClassVar[dict[str, str]] = {}

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """``{option: default}`` for every option the constructor declares."""
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
        return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}

    def options(self) -> dict[str, Any]:
        """This object's options, ``{option: value}``: what a param group stores besides :attr:`name`."""
        return {key: getattr(self, key) for key in self.option_defaults()}

    @classmethod
    def from_group(cls, group: Mapping[str, Any]) -> Component:
        """The object configured by a param group's keys (options it lacks take their defaults)."""
        return cls(**{key: group[key] for key in cls.option_defaults() if key in group})

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options() == self.options()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.options().items(), key=lambda kv: kv[0]))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options().items())})"


def register(cls: C) -> C:
    """Class decorator: add ``cls`` to :data:`REGISTRY` under its ``kind`` and ``name`` (a new name only)."""
    if cls.kind not in KINDS:
        raise ValueError(f"{cls.__name__}.kind must be one of {KINDS}, got {cls.kind!r}")
    names = REGISTRY[cls.kind]
    if cls.name in names and names[cls.name] is not cls:
        raise ValueError(f"a {cls.kind} named {cls.name!r} is already registered ({names[cls.name].__name__})")
    names[cls.name] = cls
    return cls


def registered_names(kind: str) -> tuple[str, ...]:
    """The names of every registered part of ``kind``, in registration order."""
    return tuple(REGISTRY[kind])


def component_class(kind: str, name: Any) -> type[Component]:
    """The registered class of ``kind`` called ``name``; ``ValueError`` naming the valid names otherwise."""
    names = REGISTRY[kind]
    if isinstance(name, str) and name in names:
        return names[name]
    close = difflib.get_close_matches(name, list(names), n=1) if isinstance(name, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"`{kind}` must be one of {tuple(names)} or a {kind} object, got {name!r}{hint}")


def component_of(kind: str, value: Any, options: Mapping[str, Any] | None = None) -> Component:
    """The part ``value`` stands for: an object of ``kind`` as it is, or a registered name built with ``options``.

    Raises:
        TypeError: For options given with an object (configure the object instead), or options the class does not
            declare (naming the ones it does).
        ValueError: For an unknown name, or an invalid option value (raised by the class).
    """
    options = dict(options or {})
    if isinstance(value, Component):
        if value.kind != kind:
            raise TypeError(f"`{kind}` must be a {kind} object or name, got the {value.kind} {value!r}")
        if options:
            raise TypeError(
                f"options {sorted(options)} were given with the {kind} object {value!r}: pass them to its "
                f"constructor, or give the {kind} by name"
            )
        return value
    if not isinstance(value, str):
        raise TypeError(f"`{kind}` must be a {kind} name {registered_names(kind)} or a {kind} object, got {value!r}")
    cls = component_class(kind, value)
    unknown = sorted(set(options) - set(cls.option_defaults()))
    if unknown:
        raise TypeError(unknown_options_message(cls, unknown))
    return cls(**options)


def unknown_options_message(cls: type[Component], unknown: list[str]) -> str:
    """Why ``unknown`` are not options of ``cls``: its own options, who declares them, and ``cls``'s reason."""
    own = tuple(cls.option_defaults()) or "none"
    lines = []
    for key in unknown:
        owners = [f"{k} {n!r}" for k in KINDS for n, c in REGISTRY[k].items() if key in c.option_defaults()]
        where = f"; it is an option of {' and '.join(owners)}" if owners else ""
        why = f" ({cls.why_not[key]})" if key in cls.why_not else ""
        lines.append(f"`{key}` is not an option of {cls.kind} {cls.name!r}{why}{where}")
    return "; ".join(lines) + f". Options of {cls.kind} {cls.name!r}: {own}"
