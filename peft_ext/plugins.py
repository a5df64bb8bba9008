"""Finding continual methods and heads: every module of their folder, and those other packages declare.

A shipped method or head is one module in ``peft_ext/continual/methods/`` or ``peft_ext/continual/heads/`` that
registers itself when imported (``@register_continual_method`` / ``@register_head``); :func:`import_modules` imports
every such module, so adding one is adding its file, with no list to edit.

Another package adds its own through an entry point in its ``pyproject.toml``::

    [project.entry-points."peft_ext.continual_methods"]
    anchored_lora = "my_package.anchored:AnchoredLoRA"     # a module or a class; importing it registers it

    [project.entry-points."peft_ext.heads"]
    euclidean = "my_package.euclidean"

:func:`load_entry_points` loads them when the registry is first read. One that fails to load is reported with a
warning naming it and its error, and the rest load: a broken plug-in never stops ``import peft_ext``.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings
from importlib import metadata
from typing import Any

__all__ = ["ENTRY_POINT_GROUPS", "import_modules", "load_entry_points", "load_plugins"]

#: The entry-point groups this package reads, by what they add.
ENTRY_POINT_GROUPS = {"continual_methods": "peft_ext.continual_methods", "heads": "peft_ext.heads"}

_LOADED: dict[str, set[str]] = {}  # group -> entry points loaded (or failed) in this process


def import_modules(package: str, path: list[str], skip: tuple[str, ...] = ()) -> list[str]:
    """Import every public module of a package folder (not ``_private`` ones, not sub-packages, not ``skip``), in
    name order; returns their names.

    Args:
        package: The package's dotted name (``__name__`` of its ``__init__``).
        path: Its ``__path__``.
        skip: Module names not to import here (e.g. ``base``, imported by the package itself).
    """
    names = sorted(
        info.name for info in pkgutil.iter_modules(path)
        if not info.ispkg and not info.name.startswith("_") and info.name not in skip
    )  # fmt: skip
    for name in names:
        importlib.import_module(f"{package}.{name}")
    return names


def load_entry_points(group: str) -> list[str]:
    """Load (import) every entry point of ``group`` not loaded yet in this process; returns the names loaded now.

    An entry point names a module or an object in one (``module:attr``); loading imports the module, which registers
    what it defines. One that raises is skipped with a ``UserWarning`` naming it, its target and the error.
    """
    done = _LOADED.setdefault(group, set())
    loaded = []
    for entry in _entry_points(group):
        if entry.name in done:
            continue
        done.add(entry.name)
        try:
            entry.load()
        except Exception as err:  # a third-party plug-in: report it, keep the rest working
            warnings.warn(
                f"peft_ext: the {group!r} entry point {entry.name!r} ({entry.value}) failed to load and is skipped: "
                f"{type(err).__name__}: {err}",
                UserWarning,
                stacklevel=2,
            )
            continue
        loaded.append(entry.name)
    return loaded


def load_plugins(package: str, path: list[str], kind: str) -> None:
    """Register every plug-in of one kind: the modules of its package folder but ``base`` (:func:`import_modules`),
    then the entry points other packages declare (:func:`load_entry_points`). What the ``__init__`` of
    ``peft_ext/continual/methods/`` and of ``peft_ext/continual/heads/`` runs.

    Args:
        package: The folder's dotted name (``__name__`` of its ``__init__``).
        path: Its ``__path__``.
        kind: A key of :data:`ENTRY_POINT_GROUPS` (``"continual_methods"`` or ``"heads"``).
    """
    import_modules(package, path, skip=("base",))
    load_entry_points(ENTRY_POINT_GROUPS[kind])


def _entry_points(group: str) -> list[Any]:
    return sorted(metadata.entry_points(group=group), key=lambda entry: entry.name)
