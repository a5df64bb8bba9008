"""Atomic adapter saving and checkpoint verification with clear errors (peft_ext.checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_ext import PCLRConfig, RiemannionConfig, SplitLoRAConfig, save_pretrained_atomic, verify_checkpoint
from peft_ext.models import tiny_bert

CONFIGS = {
    "riemannion": lambda: RiemannionConfig(r=4, target_modules=["query", "value"]),
    "splitlora": lambda: SplitLoRAConfig(r=4, target_modules=["query", "value"]),
    "pclr": lambda: PCLRConfig(target_modules=["query", "value"], pool_size=8, ranks_schedule=[4], top_k=2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_atomic_save_round_trips_and_verifies(name, tmp_path):
    model = get_peft_model(tiny_bert(), CONFIGS[name]())
    path = save_pretrained_atomic(model, tmp_path / "ckpt")
    assert verify_checkpoint(path) == {str(path): name.upper()}
    loaded = PeftModel.from_pretrained(tiny_bert(), path)
    ids = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids)[0], model.eval()(input_ids=ids)[0])
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "no temporary directory is left behind"


def test_a_failing_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    model = get_peft_model(tiny_bert(), CONFIGS["splitlora"]())
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
    model = get_peft_model(tiny_bert(), CONFIGS["pclr"]())
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
    model = get_peft_model(tiny_bert(), CONFIGS["riemannion"]())
    model.add_adapter("second", CONFIGS["riemannion"]())
    model.save_pretrained(tmp_path / "ckpt")
    found = verify_checkpoint(tmp_path / "ckpt")
    assert sorted(found.values()) == ["RIEMANNION", "RIEMANNION"] and any(k.endswith("second") for k in found)
