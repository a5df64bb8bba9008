"""Job kinds are registry entries (peft_ext/jobs/kinds.py): a config's ``job`` key finds its kind, which owns the
config class, the checks before training, whether it runs data-parallel, and the run; nothing tests kinds by name."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import yaml

from peft_ext.continual.config import ConfigError
from peft_ext.jobs import load_job_config, run_job_config
from peft_ext.jobs.kinds import JOB_KINDS, JobKind, get_job_kind, job_kind_of, register_job_kind
from peft_ext.jobs.preflight import preflight


@dataclass
class _Output:
    dir: str


@dataclass
class EchoConfig:
    words: list[str]
    output: _Output = field(default_factory=lambda: _Output("unused"))


@pytest.fixture
def echo_kind(tmp_path):
    ran, checked = [], []

    def from_dict(data):
        if not isinstance(data.get("words"), list):
            raise ConfigError(f"`words` must be a list, got {data.get('words')!r}")
        return EchoConfig(data["words"], _Output(str(tmp_path / "out")))

    def run(config, *, progress, debug, resume):
        ran.append((config.words, progress, resume))
        return " ".join(config.words)

    kind = register_job_kind(JobKind("echo", EchoConfig, from_dict, run, preflight=lambda c: checked.append(c) or 7))
    yield kind, ran, checked
    JOB_KINDS.pop("echo")


def test_a_registered_kind_is_read_checked_and_run_through_its_entry(echo_kind, tmp_path):
    kind, ran, checked = echo_kind
    path = tmp_path / "echo.yaml"
    path.write_text(yaml.safe_dump({"job": "echo", "words": ["a", "b"]}))
    config = load_job_config(str(path))
    assert isinstance(config, EchoConfig) and job_kind_of(config) is kind
    assert preflight(config) == 7 and checked == [config]
    assert run_job_config(config, progress=False) == "a b" and ran == [(["a", "b"], False, False)]
    assert not kind.data_parallel and JOB_KINDS["continual"].data_parallel


def test_the_shipped_kinds_and_an_unknown_one():
    assert list(JOB_KINDS)[:2] == ["continual", "missing_modality"]
    assert job_kind_of(load_job_config("configs/mora_emoji.yaml")).name == "missing_modality"
    assert job_kind_of(load_job_config("configs/quickstart.yaml")).name == "continual"
    with pytest.raises(ConfigError, match="continul"):
        get_job_kind("continul")
    with pytest.raises(TypeError, match="the config of no registered job kind"):
        job_kind_of(object())
    with pytest.raises(ValueError, match="already registered"):
        register_job_kind(JobKind("continual", dict, dict, print))


def test_a_kind_that_is_not_data_parallel_is_refused_under_a_launcher(echo_kind, monkeypatch):
    from peft_ext.jobs.launch import job_processes

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = EchoConfig(["x"])
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2: only `job: continual` runs data-parallel"):
        with job_processes(config):
            pass
