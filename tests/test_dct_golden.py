"""DCT-AdamW's family against committed trajectories (``tests/golden/dct_family.json``): a tiny MLP trained for 12
steps with each variation of basis (DCT, coordinates, power iteration), update rule (projected, channel), moment
rotation, error feedback, 8-bit state and per-column bias correction must end at the recorded parameters.

The file was recorded before the optimizers' variations became objects (:mod:`peft_ext.optim.bases`,
:mod:`peft_ext.optim.update_rules`), so this pins that refactor and any later one. On the recording machine the match
is bitwise; the tolerance (a relative 1e-5) only absorbs another CPU's rounding, far below what a changed mechanism
moves (turning the moment rotation off moves the weights by about 4e-2). Regenerating is one explicit command, after
which the change gets a line in CHANGELOG.md saying why::

    python -m tests.test_dct_golden
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from peft_ext.optim import DCTAdamW, SubspaceAdamW

GOLDEN = Path(__file__).resolve().parent / "golden" / "dct_family.json"
STEPS = 12
RTOL, ATOL = 1e-5, 1e-7

_EIGHT_BIT = {"min_8bit_size": 16, "quant_blocksize": 64}

#: case name -> (optimizer class, options); every case trains the same model on the same batches.
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "dct-default": (DCTAdamW, {}),
    "dct-gap2-ef-cbc-wd": (
        DCTAdamW,
        {"update_proj_gap": 2, "error_feedback": True, "column_bias_correction": True, "weight_decay": 0.05},
    ),
    "dct-norotate-scale": (DCTAdamW, {"update_proj_gap": 2, "rotate_moments": False, "scale": 2.0}),
    "dct-8bit": (DCTAdamW, {"moments_8bit": True, "error_feedback": True, "error_feedback_8bit": True, **_EIGHT_BIT}),
    "coordinates-channel": (DCTAdamW, {"basis": "coordinates", "update": "channel", "update_proj_gap": 2}),
    "coordinates-projected-ef": (
        DCTAdamW,
        {"basis": "coordinates", "update_proj_gap": 3, "error_feedback": True},
    ),
    "dct-channel": (DCTAdamW, {"update": "channel"}),
    "subspace-default": (SubspaceAdamW, {}),
    "subspace-gap2": (SubspaceAdamW, {"update_proj_gap": 2}),
    "subspace-channel-norotate": (
        SubspaceAdamW,
        {"update_proj_gap": 3, "update": "channel", "rotate_moments": False, "norm_growth_limit": None},
    ),
}


def run_case(name: str) -> dict[str, torch.Tensor]:
    """The parameters after :data:`STEPS` steps of case ``name``."""
    cls, options = CASES[name]
    torch.manual_seed(0)
    # a 12 x 8 weight (projected from the right), a 5 x 12 one (from the left) and two biases (plain AdamW)
    model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 8-bit CPU notes; not what this test is about
        optimizer = cls(model.named_parameters(), lr=1e-2, rank=3, **options)
    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(STEPS, 6, 8, generator=gen), torch.randint(0, 5, (STEPS, 6), generator=gen)
    for t in range(STEPS):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xs[t]), ys[t]).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_trajectory_matches_the_golden_run(name):
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == sorted(CASES), "tests/golden/dct_family.json and CASES list different cases"
    got = run_case(name)
    for key, want in golden[name].items():
        expected = torch.tensor(want, dtype=torch.float32).reshape(got[key].shape)
        torch.testing.assert_close(got[key], expected, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{name} {k}: {m}")


def _update() -> None:
    # 9 significant digits round-trip a float32 exactly
    data = {
        name: {k: [float(f"{x:.9g}") for x in v.flatten().tolist()] for k, v in run_case(name).items()}
        for name in sorted(CASES)
    }
    GOLDEN.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes, {len(data)} cases)")


if __name__ == "__main__":
    _update()
