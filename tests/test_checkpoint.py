"""Atomic adapter saving and checkpoint verification with clear errors (peft_ext.checkpoint)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from peft_ext import (
    MoRAConfig,
    PCLRConfig,
    RiemannionConfig,
    SplitLoRAConfig,
    fileperm,
    save_pretrained_atomic,
    verify_checkpoint,
)
from peft_ext.continual.engine import MethodResult
from peft_ext.continual.report import save_results
from peft_ext.models import tiny_bert, tiny_clip
from peft_ext_cli import main as cli_main

from .helpers import ADAPTER_CONFIGS, offline_env


@pytest.mark.parametrize("name", sorted(ADAPTER_CONFIGS))
def test_atomic_save_round_trips_and_verifies(name, tmp_path):
    model = get_peft_model(tiny_bert(), ADAPTER_CONFIGS[name]())
    path = save_pretrained_atomic(model, tmp_path / "ckpt")
    assert verify_checkpoint(path) == {str(path): name.upper()}
    loaded = PeftModel.from_pretrained(tiny_bert(), path)
    ids = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids)[0], model.eval()(input_ids=ids)[0])
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "no temporary directory is left behind"


def test_a_failing_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    model = get_peft_model(tiny_bert(), ADAPTER_CONFIGS["splitlora"]())
    path = save_pretrained_atomic(model, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    original = type(model).save_pretrained

    def crash(self, directory, **kwargs):
        original(self, directory, **kwargs)
        weights = directory / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])  # half-written ...
        raise KeyboardInterrupt  # ... when the process is interrupted

    monkeypatch.setattr(type(model), "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained_atomic(model, path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    verify_checkpoint(path)


def test_verify_names_the_file_and_the_problem(tmp_path):
    model = get_peft_model(tiny_bert(), ADAPTER_CONFIGS["pclr"]())
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    weights = path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"adapter_model.safetensors is truncated: its tensors need [\d,]+ bytes"):
        verify_checkpoint(path)
    weights.write_bytes(data[:4])
    with pytest.raises(ValueError, match=r"\(4 bytes\) is not a complete safetensors file"):
        verify_checkpoint(path)
    weights.unlink()
    with pytest.raises(ValueError, match="has no adapter weights"):
        verify_checkpoint(path)
    config = path / "adapter_config.json"
    config.write_text(json.dumps({"peft_type": "NOT_A_TYPE"}))
    with pytest.raises(ValueError, match=r"adapter type 'NOT_A_TYPE', which is not registered .* known: .*PCLR"):
        verify_checkpoint(path)
    config.write_text("{not json")
    with pytest.raises(ValueError, match="is not readable JSON"):
        verify_checkpoint(path)
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        verify_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        verify_checkpoint(tmp_path / "empty")


def test_verify_walks_several_adapters(tmp_path):
    model = get_peft_model(tiny_bert(), ADAPTER_CONFIGS["riemannion"]())
    model.add_adapter("second", ADAPTER_CONFIGS["riemannion"]())
    model.save_pretrained(tmp_path / "ckpt")
    found = verify_checkpoint(tmp_path / "ckpt")
    assert sorted(found.values()) == ["RIEMANNION", "RIEMANNION"] and any(k.endswith("second") for k in found)


@pytest.fixture
def umask():
    """Set the process umask for one test and restore it afterwards."""
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    out.update({str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")})
    return out


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_atomic_save_and_results_follow_the_umask(mask, file_mode, dir_mode, tmp_path, umask):
    umask(mask)
    assert fileperm.current_umask() == mask
    model = get_peft_model(tiny_bert(), ADAPTER_CONFIGS["riemannion"]())
    model.add_adapter("second", ADAPTER_CONFIGS["riemannion"]())
    atomic = _modes(save_pretrained_atomic(model, tmp_path / "atomic"))
    model.save_pretrained(tmp_path / "plain")
    plain = _modes(tmp_path / "plain")
    assert atomic.keys() == plain.keys()
    # Directories and the config get the modes of plain save_pretrained; safetensors writes its file through a
    # private temporary (0600 whatever the umask), which the atomic save corrects to what the umask asks for.
    assert {k: m for k, m in atomic.items() if "safetensors" not in k} == {
        k: m for k, m in plain.items() if "safetensors" not in k
    }
    dirs = {".", "second"}
    assert atomic == {k: dir_mode if k in dirs else file_mode for k in atomic}
    result = MethodResult("m", "m", [[0.5, None], [0.4, 0.6]], {"final_acc": 0.5}, 10, 100, 1.0, 0.5, [1.0, 0.9])
    paths = save_results([result], tmp_path / "results", {"name": "x"}, ["a", "b"])
    assert {k: stat.S_IMODE(p.stat().st_mode) for k, p in paths.items()} == dict.fromkeys(paths, file_mode)
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == sorted(p.name for p in paths.values())


def test_umask_read_without_proc(umask, monkeypatch):
    umask(0o027)

    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(fileperm, "open", no_proc, raising=False)
    assert fileperm.current_umask() == 0o027
    assert os.umask(0o027) == 0o027, "the fallback restores the umask it read"


def _edit_config(path: Path, **changes) -> None:
    config_path = path / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))


def test_verify_passes_every_adapter_type_and_a_grown_splitlora(tmp_path):
    mora = get_peft_model(tiny_clip(text_hidden=32, vision_hidden=48), MoRAConfig(r=2))
    mora.save_pretrained(tmp_path / "mora")
    assert verify_checkpoint(tmp_path / "mora") == {str(tmp_path / "mora"): "MORA"}
    lora = get_peft_model(tiny_bert(), LoraConfig(r=3, target_modules=["query"], modules_to_save=["classifier"]))
    lora.save_pretrained(tmp_path / "lora")
    assert verify_checkpoint(tmp_path / "lora") == {str(tmp_path / "lora"): "LORA"}
    # After two finished tasks SplitLoRA's folded factors have grown to 2r rows: still a valid checkpoint.
    split = get_peft_model(tiny_bert(), ADAPTER_CONFIGS["splitlora"]())
    for _ in range(2):
        with split.base_model.collect_statistics():
            split.train()(input_ids=torch.randint(0, 100, (2, 5)))
        with torch.no_grad():
            for name, param in split.named_parameters():
                if "splitlora_B" in name:
                    param.normal_()  # a trained B: with the zero init there would be nothing to fold
        split.base_model.end_task()
    split.save_pretrained(tmp_path / "split")
    assert (8, 32) in {tuple(v.shape) for k, v in split.state_dict().items() if "splitlora_old_A" in k}
    verify_checkpoint(tmp_path / "split")


@pytest.mark.parametrize(
    "name, changes, message",
    [
        ("splitlora", {"peft_type": "RIEMANNION"}, r"splitlora_A' is a SPLITLORA tensor .* peft_type 'RIEMANNION'"),
        ("riemannion", {"peft_type": "SPLITLORA"}, r"riemannion_A' is a RIEMANNION tensor .* 'SPLITLORA'"),
        ("splitlora", {"r": 8}, r"splitlora_A' has shape \(4, 32\), but the config's r=8 gives \(8, 32\)"),
        ("riemannion", {"r": 8}, r"riemannion_A' has shape \(32, 4\), but the config's r=8 gives \(32, 8\)"),
        ("pclr", {"pool_size": 16}, r"pclr_A_static' has shape \(8, 32\), but the config's pool_size=16 gives \(16,"),
    ],
)
def test_verify_catches_weights_that_do_not_match_the_config(name, changes, message, tmp_path):
    path = tmp_path / "ckpt"
    get_peft_model(tiny_bert(), ADAPTER_CONFIGS[name]()).save_pretrained(path)
    verify_checkpoint(path)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=message) as err:
        verify_checkpoint(path)
    assert str(path / "adapter_model.safetensors") in str(err.value)


def test_verify_catches_a_config_of_a_type_without_tensors(tmp_path):
    path = tmp_path / "ckpt"
    get_peft_model(tiny_bert(), LoraConfig(r=4, target_modules=["query"])).save_pretrained(path)
    _edit_config(path, peft_type="MORA")
    with pytest.raises(ValueError, match=r"lora_A.weight' is a ADALORA or LORA tensor .* peft_type 'MORA'"):
        verify_checkpoint(path)


LOAD_SCRIPT = """
import sys
from peft import PeftModel
from transformers import AutoModelForSequenceClassification

base, ckpt = sys.argv[1:]
try:
    PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base), ckpt)
except KeyError as err:
    print("without import:", repr(err))
import peft_ext
model = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base), ckpt)
print("with import: loaded", type(model.peft_config["default"]).__name__)
"""

#: What ``peft_ext_autoload.pth`` does at start-up (the wheel installs it: tests/test_wheel.py), then PEFT alone.
AUTOLOAD_SCRIPT = """
import importlib.util, sys
import peft_ext_autoload
peft_ext_autoload.install()
assert importlib.util.find_spec("peft") is not None and "peft_ext" not in sys.modules  # a probe imports nothing
from peft import PeftModel
from transformers import AutoModelForSequenceClassification

base, ckpt = sys.argv[1:]
model = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base), ckpt)
finders = [type(f).__name__ for f in sys.meta_path]
print("autoload: loaded", type(model.peft_config["default"]).__name__, "_AfterPeft" in finders)
"""


@pytest.mark.slow
def test_loading_in_a_fresh_process_needs_peft_ext_registered(tmp_path):
    """PEFT's own behaviour where nothing registers the types (the autoload turned off), ``import peft_ext`` as the
    fix, and the autoload hook doing it alone (README's troubleshooting section)."""
    base = tmp_path / "base"
    tiny_bert().save_pretrained(base)
    save_pretrained_atomic(get_peft_model(tiny_bert(), ADAPTER_CONFIGS["splitlora"]()), tmp_path / "ckpt")
    off = {**offline_env(), "PEFT_EXT_NO_AUTOLOAD": "1"}
    cmd = [sys.executable, "-c", LOAD_SCRIPT, str(base), str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=off, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == [
        "without import: KeyError('SPLITLORA')",
        "with import: loaded SplitLoRAConfig",
    ]
    cmd = [sys.executable, "-c", AUTOLOAD_SCRIPT, str(base), str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=offline_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "autoload: loaded SplitLoRAConfig False"  # and the finder is gone
    assert "kernels-community" not in proc.stderr  # the notices are dropped before peft imports bitsandbytes


def test_cli_verify_reports_and_says_how_to_load(tmp_path, capsys):
    path = save_pretrained_atomic(get_peft_model(tiny_bert(), ADAPTER_CONFIGS["pclr"]()), tmp_path / "ckpt")
    assert cli_main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: PCLR adapter, complete and consistent with its config" in out
    assert "to load: PCLR is a peft-ext adapter type: run `import peft_ext` before `PeftModel.from_pretrained" in out
    _edit_config(path, r=99, pool_size=4)
    assert cli_main(["verify", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pool_size=4 gives (4, 32)" in err
    lora = tmp_path / "lora"
    get_peft_model(tiny_bert(), LoraConfig(r=2, target_modules=["query"])).save_pretrained(lora)
    assert cli_main(["verify", str(lora)]) == 0
    assert "to load" not in capsys.readouterr().out, "PEFT's own types need no hint"


@pytest.mark.parametrize("name", [*sorted(ADAPTER_CONFIGS), "lora"])
def test_verify_against_the_base_model_checks_widths_and_targets(name, tmp_path):
    """Shapes only the base fixes (input widths) and the set of adapted layers, from a meta copy of the base."""
    make = ADAPTER_CONFIGS.get(name, lambda: LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))
    path = tmp_path / "ckpt"
    get_peft_model(tiny_bert(), make()).save_pretrained(path)
    tiny_bert().save_pretrained(tmp_path / "base32")
    tiny_bert(hidden_size=64).save_pretrained(tmp_path / "base64")
    for base in (tiny_bert(), str(tmp_path / "base32")):
        assert verify_checkpoint(path, base_model=base) == {str(path): name.upper()}
    with pytest.raises(ValueError, match=r"has shape \(.*\), but the config on the base model gives \(.*64") as err:
        verify_checkpoint(path, base_model=str(tmp_path / "base64"))
    assert str(path / "adapter_model.safetensors") in str(err.value)
    _edit_config(path, target_modules=["query", "key", "value"])
    first_key = r"base_model\.model\.bert\.encoder\.layer\.0\.attention\.self\.key"
    with pytest.raises(ValueError, match=rf"\d+ missing \(e\.g\. \['{first_key}"):
        verify_checkpoint(path, base_model=tiny_bert())


def test_cli_verify_checks_against_the_named_base(tmp_path, capsys):
    base = tmp_path / "base"
    tiny_bert().save_pretrained(base)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(base)  # so the config names the base folder
    path = save_pretrained_atomic(get_peft_model(model, ADAPTER_CONFIGS["splitlora"]()), tmp_path / "ckpt")
    assert cli_main(["verify", str(path)]) == 0
    assert f"consistent with its config and with base model {base}" in capsys.readouterr().out
    tiny_bert(hidden_size=64).save_pretrained(tmp_path / "wide")
    capsys.readouterr()  # transformers' save progress bar
    assert cli_main(["verify", str(path), "--base", str(tmp_path / "wide")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the config on the base model gives" in err[0]
    _edit_config(path, base_model_name_or_path=str(tmp_path / "gone"))
    assert cli_main(["verify", str(path)]) == 0
    assert "shapes the base model fixes: not checked" in capsys.readouterr().out


def test_verify_passes_an_adapter_made_on_a_head_class_of_a_bare_base(tmp_path, capsys):
    """The README's case: the base folder holds a bare encoder (``architectures: [BertModel]``, like MiniLM), the
    adapter was made on ``AutoModelForSequenceClassification`` of it with 3 labels and saves the new head; verify
    builds the class the adapter config names (``auto_mapping``) with the saved head's label count, and still fails
    for a real mismatch."""
    from transformers import AutoModelForSequenceClassification, BertModel

    base = tmp_path / "base"
    BertModel(tiny_bert().config).save_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=3)
    adapter = RiemannionConfig(r=2, target_modules=["query", "value"], modules_to_save=["classifier"])
    path = save_pretrained_atomic(get_peft_model(model, adapter), tmp_path / "ckpt")
    auto = json.loads((path / "adapter_config.json").read_text())["auto_mapping"]
    assert auto["base_model_class"] == "BertForSequenceClassification"
    capsys.readouterr()
    assert cli_main(["verify", str(path)]) == 0
    assert f"consistent with its config and with base model {base}" in capsys.readouterr().out
    tiny_bert(hidden_size=64).save_pretrained(tmp_path / "wide")
    capsys.readouterr()
    assert cli_main(["verify", str(path), "--base", str(tmp_path / "wide")]) == 2
    assert "the config on the base model gives" in capsys.readouterr().err
    _edit_config(path, target_modules=["query", "value", "key"])  # a config the saved tensors do not fit
    assert cli_main(["verify", str(path)]) == 2
    assert "missing" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["riemannion", "splitlora", "pclr", "mora"])
def test_a_saved_adapter_says_what_loading_it_needs(kind, tmp_path):
    """adapter_config.json of every peft-ext type carries a note that PEFT alone cannot load it (a reader who finds
    the folder learns to install and import peft_ext); loading passes the note through unchanged."""
    configs = {
        "riemannion": lambda: RiemannionConfig(r=2, target_modules=["query"]),
        "splitlora": lambda: SplitLoRAConfig(r=2, target_modules=["query"]),
        "pclr": lambda: PCLRConfig(target_modules=["query"], pool_size=8, ranks_schedule=[4], top_k=2),
        "mora": lambda: MoRAConfig(r=2, top_layers=1),
    }
    make = tiny_clip if kind == "mora" else tiny_bert
    get_peft_model(make(), configs[kind]()).save_pretrained(tmp_path)
    note = json.loads((tmp_path / "adapter_config.json").read_text())["loading_note"]
    assert "pip install peft-ext" in note and "`import peft_ext`" in note and "KeyError" in note
    loaded = PeftModel.from_pretrained(make(), tmp_path)
    assert loaded.peft_config["default"].loading_note == note


def test_the_sizes_checked_are_declared_by_each_config_class():
    """verify_checkpoint reads the sizes a type fixes from its registered config class (a new adapter type declares
    them where it is defined); PEFT's LoRA from the checkpoint module's own table; a type that fixes none: none."""
    from peft_ext.checkpoint import PEFT_SAVED_SIZES, saved_sizes

    for name, cls in (
        ("RIEMANNION", RiemannionConfig),
        ("SPLITLORA", SplitLoRAConfig),
        ("PCLR", PCLRConfig),
        ("MORA", MoRAConfig),
    ):
        assert saved_sizes(name) == cls.saved_sizes and cls.saved_sizes
        assert all(field in cls.__dataclass_fields__ for _, _, field in cls.saved_sizes), name
    assert saved_sizes("LORA") == PEFT_SAVED_SIZES["LORA"]
    assert saved_sizes("IA3") == () and saved_sizes("NOT_A_TYPE") == ()
    assert "saved_sizes" not in SplitLoRAConfig(r=2, target_modules=["query"]).to_dict()  # a class fact, not saved
