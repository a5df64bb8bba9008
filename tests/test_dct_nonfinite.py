"""The shared non-finite policy (:mod:`peft_ext.optim.nonfinite`) as DCT-AdamW's family uses it: one argument name
(``nonfinite``), one exception type that both ``FloatingPointError`` and ``ValueError`` clauses catch, and a
skipped-step count that is saved with the state."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from peft_ext.optim import DCTAdamW, NonFiniteGradientError, SubspaceAdamW
from peft_ext.optim.nonfinite import nonfinite_policy


def _stepped(optimizer_cls=DCTAdamW, bad: bool = False, **options):
    p = nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
    opt = optimizer_cls([("w", p)], lr=0.1, rank=2, **options)
    p.grad = torch.randn(6, 4)
    if bad:
        p.grad[0, 0] = float("nan")
    return p, opt


def test_the_policy_has_one_name():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'nonfinite_grad' \(did you mean 'nonfinite'"):
        _stepped(nonfinite_grad="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _stepped(nonfinite="skip")[1].nonfinite == "skip"


def test_bad_policies_are_named():
    message = r"`nonfinite` must be one of \('raise', 'skip'\), got 'ignore'"
    with pytest.raises(ValueError, match=message):
        nonfinite_policy("ignore")
    with pytest.raises(ValueError, match=message):
        SubspaceAdamW([nn.Parameter(torch.randn(4, 4))], nonfinite="ignore")


@pytest.mark.parametrize("former", [FloatingPointError, ValueError])
def test_one_exception_type_caught_by_both_former_except_clauses(former):
    p, opt = _stepped(bad=True)
    with pytest.raises(former) as caught:
        opt.step()
    assert type(caught.value) is NonFiniteGradientError
    assert "non-finite gradient (inf or nan) in `w` (shape (6, 4)); nothing was updated" in str(caught.value)
    assert "nonfinite='skip'" in str(caught.value) and not opt.state[p]


def test_the_skip_count_is_saved_and_restored():
    p, opt = _stepped(optimizer_cls=SubspaceAdamW, nonfinite="skip", bad=True)
    with pytest.warns(UserWarning, match=r"skipping this optimizer step .*1 skipped so far"):
        opt.step()
    with pytest.warns(UserWarning, match="2 skipped so far"):
        opt.step()
    assert opt.skipped_steps == 2
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    assert [g["skipped_steps"] for g in saved["param_groups"]] == [2]
    fresh = SubspaceAdamW([("w", p)], lr=0.1, rank=2, nonfinite="skip")
    fresh.load_state_dict(saved)
    assert fresh.skipped_steps == 2
    # a state saved before the count existed loads as 0
    del saved["param_groups"][0]["skipped_steps"]
    fresh.load_state_dict(saved)
    assert fresh.skipped_steps == 0
    fresh.skipped_steps = 5
    assert fresh.state_dict()["param_groups"][0]["skipped_steps"] == 5
