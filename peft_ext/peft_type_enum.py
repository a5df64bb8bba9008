"""Adding a member to PEFT's closed ``PeftType`` enum (``peft_ext.registry`` registers adapter types with it).

CPython builds enum members in enum._proto_member.__set_name__ (3.11+) or EnumType.__new__ (3.10). For a str enum
without a custom __new__ such as PeftType, a member is a str instance of the enum class carrying _value_, _name_,
__objclass__ and (3.11+) _sort_order_, and it is reachable through four structures, which are all that
lookups consult on 3.10-3.13: the class attribute (getattr; 3.10/3.11 also fall back to _member_map_ via
EnumType.__getattr__, 3.12+ do not), _member_names_ (iteration, len), _member_map_ (PeftType[NAME], __members__)
and _value2member_map_ (PeftType(value), unpickling, `in` on 3.12+). Each step below writes one of them and returns
how to undo it, so that a failure at any point restores the enum exactly.
"""

from __future__ import annotations

import copy
import json
import pickle
import platform
from collections.abc import Callable

from peft.config import PeftConfig
from peft.utils import PeftType

__all__ = ["Undo", "add_member", "interpreter", "undo_all"]

#: Takes one installation step back.
Undo = Callable[[], None]


def interpreter() -> str:
    """The running interpreter, for messages: ``"Python 3.11.9 (CPython)"``."""
    return f"Python {platform.python_version()} ({platform.python_implementation()})"


def _set_class_attribute(member: PeftType) -> Undo:
    # type.__setattr__/__delattr__ bypass EnumType's guards against reassigning or deleting members.
    type.__setattr__(PeftType, member._name_, member)
    return lambda: type.__delattr__(PeftType, member._name_)


def _append_member_name(member: PeftType) -> Undo:
    PeftType._member_names_.append(member._name_)
    return lambda: PeftType._member_names_.remove(member._name_)


def _map_name(member: PeftType) -> Undo:
    PeftType._member_map_[member._name_] = member
    return lambda: PeftType._member_map_.pop(member._name_)


def _map_value(member: PeftType) -> Undo:
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


_INSTALL_STEPS: tuple[Callable[[PeftType], Undo], ...] = (
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
            f"Cannot extend peft.utils.PeftType on {interpreter()}: its enum internals are not what peft_ext supports "
            f"({'; '.join(problems)}). Supported: CPython 3.10-3.13."
        )


def add_member(upper: str) -> tuple[PeftType, list[Undo]]:
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

    undo: list[Undo] = []
    try:
        for step in _INSTALL_STEPS:
            undo.append(step(member))
    except Exception as exc:
        undo_all(undo, upper)
        raise RuntimeError(f"Extending peft.utils.PeftType with {upper} failed on {interpreter()}: {exc!r}") from exc

    failed = [label for label, check in _member_checks(member, reference, size_before) if not _passes(check)]
    if failed:
        undo_all(undo, upper)
        raise RuntimeError(
            f"Extending peft.utils.PeftType with {upper} does not work on {interpreter()}; these checks failed: "
            f"{'; '.join(failed)}. The enum was restored; peft_ext's enum extension needs updating for this "
            "interpreter."
        )
    return member, undo


def undo_all(undo: list[Undo], upper: str) -> None:
    errors = []
    for step in reversed(undo):
        try:
            step()
        except Exception as exc:  # keep undoing the other steps; report them all below
            errors.append(repr(exc))
    undo.clear()
    if errors:
        raise RuntimeError(
            f"Could not fully remove PeftType.{upper} again on {interpreter()} ({'; '.join(errors)}); PeftType may be "
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
