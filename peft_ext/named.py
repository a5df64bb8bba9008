"""Registries of kinds: one object per name, registered by a class decorator, looked up with an error that names the
registered ones. The task kinds (:mod:`peft_ext.continual.task_kinds`) and the model kinds
(:mod:`peft_ext.models.kinds`) are such registries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["KindRegistry"]

T = TypeVar("T")


class KindRegistry(dict[str, T], Generic[T]):
    """Objects by their ``name``: :meth:`register` adds an instance of a class, :meth:`lookup` finds one.

    Args:
        what: What the objects are, in the words of the lookup's error (``"model kind"``).
    """

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def register(self, cls: Callable[[], T]) -> Any:
        """Register an instance of ``cls`` under its ``name``; returns ``cls`` (a class decorator). A name already
        taken by another class is refused."""
        name = cls.name  # type: ignore[attr-defined]
        if name in self and type(self[name]) is not cls:
            raise ValueError(f"a {self.what} named {name!r} is already registered ({type(self[name]).__name__})")
        self[name] = cls()
        return cls

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plug-in's kind, or a test's)."""
        del self[name]

    def lookup(self, name: Any) -> T:
        """The object registered as ``name``.

        Raises:
            ValueError: A name no one registered, naming the registered ones.
        """
        if isinstance(name, str) and name in self:
            return self[name]
        raise ValueError(f"unknown {self.what} {name!r}; known kinds: {sorted(self)}")
