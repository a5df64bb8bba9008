"""Optimizer warnings: DCTAdamW whose ``target_modules`` select nothing (it would silently train every
parameter with plain AdamW) warns once at construction, naming the targets and modules that exist."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from peft_ext.optim import DCTAdamW


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("targets", [["nope"], "nope.*"])
def test_dct_adamw_warns_once_when_target_modules_match_nothing(targets):
    net = _net()
    with pytest.warns(UserWarning) as caught:
        opt = DCTAdamW(net.named_parameters(), lr=1e-2, rank=2, target_modules=targets)
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the construction
    message = str(caught[0].message)
    assert f"`target_modules` {targets!r} (group 0) matches no parameter" in message
    assert "plain AdamW" in message and "the modules holding matrices are e.g. '0', '2', '4'" in message
    assert all(rank is None for _, _, rank in opt.projection_plan())  # what the warning says happens
    # steps do not warn again
    net(torch.randn(3, 8)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_dct_adamw_names_only_the_group_that_matches_nothing():
    net = _net()
    named = list(net.named_parameters())
    groups = [
        {"params": named[:2], "target_modules": ["0"]},
        {"params": named[2:], "target_modules": ["query"]},
    ]
    with pytest.warns(UserWarning, match=r"`target_modules` \['query'\] \(group 1\) matches no parameter") as caught:
        opt = DCTAdamW(groups, lr=1e-2, rank=2)
    assert len(caught) == 1 and "e.g. '2', '4'" in str(caught[0].message)
    assert [rank for _, _, rank in opt.projection_plan()] == [2, None, None, None, None, None]


@pytest.mark.parametrize("targets", [None, ["2"], r"[0-9]"])
def test_dct_adamw_does_not_warn_when_targets_match(targets):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DCTAdamW(_net().named_parameters(), lr=1e-2, rank=2, target_modules=targets)
