"""The config fingerprint that guards --resume: each field declares whether and when it is hashed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from peft_ext.fingerprint import FINGERPRINT, added_later, fingerprint, fingerprint_data, not_a_setting


@dataclass
class Inner:
    rate: float = 0.1
    note: str = not_a_setting("for readers")
    newer: int = added_later(3)
    listed: list[int] = added_later(default_factory=list)


@dataclass
class Outer:
    name: str = "run"
    inner: Inner = field(default_factory=Inner)
    extra: Inner = field(default_factory=Inner, metadata={FINGERPRINT: lambda v: v.rate == 0})
    many: list[Inner] = field(default_factory=lambda: [Inner(), Inner(rate=0.5)])


def test_fields_leave_the_fingerprint_as_they_declare():
    data = fingerprint_data(Outer())
    assert data["inner"] == {"rate": 0.1}  # note never, newer and listed at their defaults not
    assert data["many"] == [{"rate": 0.1}, {"rate": 0.5}]
    assert fingerprint_data(Inner(newer=4, listed=[1]))["newer"] == 4
    assert fingerprint_data(Inner(listed=[1]))["listed"] == [1]
    assert "extra" not in fingerprint_data(Outer(extra=Inner(rate=0)))


def test_a_setting_changes_the_fingerprint_and_a_note_does_not():
    base = fingerprint(Outer())
    assert len(base) == 16 and int(base, 16) >= 0
    assert fingerprint(Outer(inner=Inner(note="another note"))) == base
    assert fingerprint(Outer(inner=Inner(rate=0.2))) != base
    assert fingerprint(Outer(inner=Inner(newer=4))) != base
    assert fingerprint(Outer(inner=Inner(listed=[2]))) != base
    assert fingerprint(Outer(name="other")) != base


def test_without_declarations_it_is_asdict():
    @dataclass
    class Plain:
        a: int = 1
        b: tuple[int, ...] = (1, 2)
        c: dict[str, int] = field(default_factory=lambda: {"x": 1})

    assert fingerprint_data(Plain()) == {"a": 1, "b": [1, 2], "c": {"x": 1}}
    assert dataclasses.asdict(Plain())["c"] == fingerprint_data(Plain())["c"]


def test_the_shipped_configs_declare_their_non_settings():
    from peft_ext.continual.config import load_config
    from peft_ext.jobs.resume import config_hash

    from .helpers import ROOT

    config = load_config(ROOT / "configs" / "quickstart.yaml")
    quiet = dataclasses.replace(config, train=dataclasses.replace(config.train, progress=False))
    elsewhere = dataclasses.replace(config, output=dataclasses.replace(config.output, save_adapters=False))
    assert config_hash(quiet) == config_hash(elsewhere) == config_hash(config)
    chat = dataclasses.replace(config, model=dataclasses.replace(config.model, system_prompt="Be brief."))
    assert config_hash(chat) != config_hash(config)
