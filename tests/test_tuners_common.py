"""The pieces the tuners share (peft_ext.tuners._common): target checks, rank checks, adapter_names routing."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_ext import MoRAConfig, PCLRConfig, RiemannionConfig, SplitLoRAConfig
from peft_ext.models import tiny_bert, tiny_clip
from peft_ext.tuners._common import disable_bnb_cpu_repacking, require_linear_target

CONFIGS = {
    "riemannion": lambda: RiemannionConfig(r=4, target_modules=["query", "value"]),
    "splitlora": lambda: SplitLoRAConfig(r=4, target_modules=["query", "value"]),
    "pclr": lambda: PCLRConfig(target_modules=["query", "value"], pool_size=8, ranks_schedule=[4], top_k=2),
}


def test_require_linear_target_names_the_module_and_its_type():
    require_linear_target(nn.Linear(3, 3), "a.b", "X")  # no error
    with pytest.raises(ValueError, match=r"X supports torch.nn.Linear .* the target 'a.emb' is a Embedding"):
        require_linear_target(nn.Embedding(4, 3), "a.emb", "X")


def test_disable_bnb_cpu_repacking_leaves_plain_layers_alone():
    layer = nn.Linear(3, 3)
    before = layer.weight.detach().clone()
    disable_bnb_cpu_repacking(layer)
    assert torch.equal(layer.weight, before)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_non_linear_targets_are_refused_by_every_tuner(name):
    config = CONFIGS[name]()
    config.target_modules = ["word_embeddings"]
    with pytest.raises(ValueError, match="word_embeddings"):
        get_peft_model(tiny_bert(), config)


def test_mora_refuses_a_rank_above_the_projection_width():
    with pytest.raises(ValueError, match=r"`r`=100 is larger than the width 32 of .*Use r <= 32"):
        get_peft_model(tiny_clip(), MoRAConfig(r=100, top_layers=1))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_adapter_names_errors_name_what_exists(name):
    model = get_peft_model(tiny_bert(), CONFIGS[name]())
    ids = torch.randint(0, 100, (2, 5))
    with pytest.raises(ValueError, match="inference only"):
        model.train()(input_ids=ids, adapter_names=["default", "default"])
    model.eval()
    with pytest.raises(ValueError, match=r"unknown adapters \['other'\]; known: \['default'\] and '__base__'"):
        model(input_ids=ids, adapter_names=["default", "other"])
    with torch.no_grad():
        mixed = model(input_ids=ids, adapter_names=["__base__", "default"])[0]
        with model.disable_adapter():
            base = model(input_ids=ids)[0]
    torch.testing.assert_close(mixed[0], base[0])
