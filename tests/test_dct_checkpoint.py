"""DCTAdamW's checkpoints: state dicts of tensors and numbers that load with ``weights_only=True``, exact resume,
saved dtypes."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from peft_ext.optim import DCTAdamW

from .single_thread import single_thread  # noqa: F401  (fixture)

B1, B2 = 0.9, 0.999


# One torch thread: with two, torch's OpenMP threads spin-wait after every op while bitsandbytes' CPU kernels (linked
# against the system libgomp, a second OpenMP runtime) want the same cores; the 8-bit tests then ran up to 200x slower
# on the busy 2-core machine (docs/dct_adamw.md). Tiny tensors gain nothing from a second thread anyway.
pytestmark = pytest.mark.usefixtures("single_thread")


# ----------------------------------------------------------------------------------------------------------------
# checkpointing

OPTION_SETS = {
    "default": {"target_modules": ["0", "2"]},  # the 4-row head gets plain AdamW
    "everything": {  # layer 2 (40 x 48) takes plain AdamW with 8-bit moments
        "target_modules": ["0"],
        "column_bias_correction": True,
        "error_feedback": True,
        "error_feedback_8bit": True,
        "moments_8bit": True,
        "min_8bit_size": 256,
        "update_proj_gap": 3,
        "weight_decay": 0.01,
    },
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 4))


def _batches(n: int):
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(n)]


def _run(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_state_dict_holds_only_tensors_and_numbers_and_loads_weights_only(options):
    model = _model()
    opt = DCTAdamW(model.named_parameters(), lr=1e-2, rank=8, **options)
    _run(model, opt, _batches(4))
    sd = opt.state_dict()
    for per_param in sd["state"].values():
        for key, value in per_param.items():
            assert isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool), (key, value)
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh = DCTAdamW(_model().named_parameters(), lr=1e-2, rank=8, **options)
    fresh.load_state_dict(loaded)
    for (_, a), (_, b) in zip(opt.state.items(), fresh.state.items()):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key]


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_resumed_run_is_identical_to_an_uninterrupted_one(options, tmp_path):
    batches = _batches(9)
    model = _model()
    opt = DCTAdamW(model.named_parameters(), lr=1e-2, rank=8, **options)
    _run(model, opt, batches)

    first = _model()
    opt1 = DCTAdamW(first.named_parameters(), lr=1e-2, rank=8, **options)
    _run(first, opt1, batches[:4])
    torch.save({"model": first.state_dict(), "optimizer": opt1.state_dict()}, tmp_path / "ckpt.pt")
    del first, opt1

    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = _model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    opt2 = DCTAdamW(resumed.named_parameters(), lr=1e-2, rank=8, **options)
    opt2.load_state_dict(checkpoint["optimizer"])
    _run(resumed, opt2, batches[4:])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_bf16_parameters_keep_exact_indices_and_scales_through_load():
    p = nn.Parameter(torch.randn(600, 300).bfloat16())
    opt = DCTAdamW([p], lr=1e-3, rank=260, moments_8bit=True, min_8bit_size=256)
    p.grad = torch.randn(600, 300).bfloat16()
    opt.step()
    state = opt.state[p]
    assert state["indices"].max() > 256, "indices above 256 are not representable in bf16"
    fresh = DCTAdamW([nn.Parameter(p.detach().clone())], lr=1e-3, rank=260, moments_8bit=True, min_8bit_size=256)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    loaded = next(iter(fresh.state.values()))
    assert loaded["indices"].dtype == torch.int64 and torch.equal(loaded["indices"], state["indices"])
    assert loaded["exp_avg_absmax"].dtype == torch.float32
    assert torch.equal(loaded["exp_avg_absmax"], state["exp_avg_absmax"])
    assert loaded["exp_avg_q"].dtype == torch.uint8
