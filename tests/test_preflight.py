"""`peft-ext check` (and `run`, before any training) catches what `run` would otherwise fail on late: non-finite
numbers, an unwritable output folder, impossible data, an unresolvable backbone, adapters that do not fit the
backbone. Each is one line naming the key and the value, exit status 2, and no work started."""

import pytest

from peft_ext_cli import main

from .helpers import job_config, offline_env, save_tiny_bert


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=1, seed=0)


@pytest.fixture
def cfg(tmp_path, tiny_backbone):
    def edit(data: dict) -> None:
        data["model"]["backbone"] = str(tiny_backbone)
        data["data"].update(n_tasks=2, classes_per_task=2, train_per_class=4, test_per_class=2)

    return job_config(tmp_path, "quickstart", edit)


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("peft-ext: config error: "), err
    return err[0]


def test_valid_config_passes(cfg, capsys):
    assert main(["check", str(cfg)]) == 0
    assert "valid (11 methods" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("methods.seq_lora.lr=.inf", "methods.seq_lora.lr", "inf"),
        ("methods.splitlora.weight_decay=.nan", "methods.splitlora.weight_decay", "nan"),
        ("train.max_grad_norm=.nan", "train.max_grad_norm", "nan"),
        ("methods.pclr.adapter.alpha=-.inf", "methods.pclr.adapter.alpha", "-inf"),
    ],
)
def test_non_finite_numbers_are_named(cfg, capsys, tmp_path, override, key, value):
    line = _error(capsys, ["check", str(cfg), "--set", override])
    assert f"`{key}` must be a finite number, got {value}" in line
    _error(capsys, ["run", str(cfg), "--no-progress", "--set", override])
    assert not (tmp_path / "out").exists()


def test_output_dir_under_a_file(cfg, capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    line = _error(capsys, ["check", str(cfg), "--set", f"output.dir={tmp_path / 'afile' / 'sub' / 'out'}"])
    assert "`output.dir`" in line and "afile" in line and "is a file, not a directory" in line


def test_output_dir_probe_write_failure_is_named(cfg, capsys, tmp_path, monkeypatch):
    # A read-only folder is writable for root (tests may run as root), so the probe's refusal is simulated.
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    line = _error(capsys, ["check", str(cfg)])
    assert "`output.dir`" in line and "is not writable" in line and "Permission denied" in line


@pytest.mark.slow
def test_a_read_only_output_dir_is_refused_for_real(cfg, tmp_path):
    """A real read-only folder and a process that cannot write there (root writes anywhere, so as root the child
    runs without CAP_DAC_OVERRIDE): ``run`` refuses it before any work (its preflight is ``check``'s), naming it."""
    import ctypes
    import os
    import subprocess
    import sys

    out = tmp_path / "readonly"
    out.mkdir()
    out.chmod(0o555)

    def drop_write_override() -> None:
        if os.geteuid() == 0:  # prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE): the exec'ed child loses it
            if ctypes.CDLL(None, use_errno=True).prctl(24, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    argv = [sys.executable, "-m", "peft_ext", "run", str(cfg), "--set", f"output.dir={out}"]
    try:
        proc = subprocess.run(
            argv, env=offline_env(), capture_output=True, text=True, preexec_fn=drop_write_override, timeout=300
        )
    except subprocess.SubprocessError as err:
        pytest.skip(f"cannot start a process without write override here: {err}")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "`output.dir`" in err[0] and "is not writable" in err[0], err
    assert str(out) in err[0] and "Permission denied" in err[0]
    assert list(out.iterdir()) == []


def test_data_constraints(cfg, capsys):
    line = _error(capsys, ["check", str(cfg), "--set", "data.n_tasks=50"])
    assert "`data` (n_tasks=50, classes_per_task=2)" in line and "100 classes needed" in line
    classes = "[noun.state, noun.time, adv.all, noun.persn]"
    line = _error(capsys, ["check", str(cfg), "--set", f"data.classes={classes}"])
    assert "`data.classes[3]`" in line and "'noun.persn'" in line and "did you mean `noun.person`" in line


def test_unresolvable_backbone_offline_names_the_model(cfg, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = _error(capsys, ["check", str(cfg), "--set", "model.backbone=nobody/no-such-model-xyz"])
    assert "`model.backbone` 'nobody/no-such-model-xyz' is not in the local Hugging Face cache" in line


def test_a_hub_id_fails_at_once_when_the_hub_cannot_be_reached(cfg, capsys, monkeypatch):
    """No HF_HUB_OFFLINE, no network: the hub's host is probed once (a refused or unresolved connection), the id is
    looked up in the local cache only, and an id that is not there is refused naming it (no half minute of
    retries)."""
    import functools
    import socket
    import time

    from peft_ext.jobs import preflight

    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    probed = []

    def refuse(address, timeout=None):
        probed.append((address, timeout))
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", refuse)
    # an empty cache of its own: probes of this test neither come from nor stay in the process's cache
    monkeypatch.setattr(preflight, "_refused", functools.cache(preflight._refused.__wrapped__))
    start = time.perf_counter()
    line = _error(capsys, ["check", str(cfg), "--set", "model.backbone=nobody/no-such-model-xyz"])
    assert "`model.backbone` 'nobody/no-such-model-xyz' is not in the local Hugging Face cache and the hub" in line
    assert "(huggingface.co) cannot be reached" in line
    assert time.perf_counter() - start < 10 and probed[0] == (("huggingface.co", 443), 3.0)
    assert len(probed) == 1  # the backbone's and the tokenizer's checks share one probe
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example:8080")
    assert preflight.hub_unreachable() and probed[-1][0] == ("mirror.example", 8080)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # behind a proxy the proxy decides: no probe
    n = len(probed)
    assert not preflight.hub_unreachable() and len(probed) == n


def test_adapter_dry_build(cfg, capsys, tmp_path):
    line = _error(capsys, ["check", str(cfg), "--set", "methods.splitlora.adapter.r=40"])
    assert "`methods.splitlora` r=40 is above the input width 32" in line
    line = _error(capsys, ["check", str(cfg), "--set", "methods.seq_lora.adapter.target_modules=[nope]"])
    assert "`methods.seq_lora` target_modules" in line and "nope" in line and "match no linear layer" in line
    _error(capsys, ["run", str(cfg), "--no-progress", "--set", "methods.inflora.r=33"])
    assert not (tmp_path / "out").exists()


def test_config_path_is_a_directory(capsys, tmp_path):
    line = _error(capsys, ["check", str(tmp_path)])
    assert "is a directory, expected a YAML file" in line


def test_a_partly_misspelled_target_list_is_refused_with_a_suggestion(cfg, capsys, tmp_path):
    """PEFT adapts what the other entries match and says nothing; ``check`` and ``run`` refuse before any work."""
    line = _error(capsys, ["check", str(cfg), "--set", "methods.seq_lora.adapter.target_modules=[qury, value]"])
    assert "`methods.seq_lora` target_modules entry 'qury' matches no linear layer" in line
    assert "(did you mean 'query'?)" in line and "only the other entries would get adapters" in line
    line = _error(capsys, ["run", str(cfg), "--set", "methods.inflora.target_modules=[query, valeu]"])
    assert "`methods.inflora` target_modules entry 'valeu'" in line and "'value'" in line
    assert not (tmp_path / "out").exists()


def test_a_model_folder_without_a_tokenizer_is_refused(cfg, capsys, tmp_path, tiny_backbone):
    """Without tokenizer files transformers builds a placeholder of a few special tokens: every word would be [UNK]
    and the job would train at chance, silently."""
    import shutil

    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_backbone / name, bare / name)
    line = _error(capsys, ["check", str(cfg), "--set", f"model.backbone={bare}"])
    assert f"`model.backbone` '{bare}' has no tokenizer files" in line and "tokenizer.save_pretrained" in line

    (bare / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer"}')  # a config, no vocabulary
    line = _error(capsys, ["run", str(cfg), "--set", f"model.backbone={bare}"])
    assert f"`model.backbone` '{bare}'" in line and "tokenizer" in line
    assert not (tmp_path / "out").exists()
