"""SplitLoRA's cheaper statistics are the same statistics: the lower-triangle update against the full one, and the
shared product of modules fed one input against each module's own inputs (through ``collect_statistics``)."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_ext import SplitLoRAConfig
from peft_ext.tuners.splitlora import SplitLoRALayer
from peft_ext.tuners.splitlora.covariance import (
    accumulate_covariance,
    accumulate_covariance_lower,
    symmetrize_lower_,
)


@pytest.mark.parametrize("n", [1, 7, 64, 100, 256, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lower_triangle_update_equals_the_full_one(n, dtype):
    g = torch.Generator().manual_seed(n)
    batches = [torch.randn(int(m), n, generator=g, dtype=dtype) * 3 for m in (5, 33, 1)]
    full = torch.zeros(n, n, dtype=dtype)
    # junk above the diagonal must never leak into the result
    lower = full.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("nan"))
    for rows in batches:
        accumulate_covariance(full, rows)
        accumulate_covariance_lower(lower, rows)
        symmetrize_lower_(lower)  # idempotent: mirroring between batches changes nothing
    exact = sum(rows.double().T @ rows.double() for rows in batches)
    scale = float(exact.diagonal().max())  # off-diagonal sums cancel: absolute rounding on the diagonal's scale
    tol = {"rtol": 0.0, "atol": (1e-5 if dtype == torch.float32 else 1e-13) * scale}
    torch.testing.assert_close(lower.double(), exact, **tol)
    torch.testing.assert_close(lower, full, **tol)
    assert torch.equal(lower, lower.T)


def test_lower_triangle_update_leaves_the_upper_blocks_alone():
    n = 300  # blocks of 64: the entries above the diagonal blocks are never written
    cov = torch.zeros(n, n)
    accumulate_covariance_lower(cov, torch.randn(10, n))
    assert torch.equal(cov[:64, 64:], torch.zeros(64, n - 64))
    assert bool(cov[64:, :64].abs().gt(0).all())
    with pytest.raises(ValueError, match=r"rows must have shape \(N, 300\), got \(10, 3\)"):
        accumulate_covariance_lower(cov, torch.randn(10, 3))


class _Fan(nn.Module):
    """``a`` and ``b`` read the same tensor, ``c`` a different one of the same width (so width alone must not make it
    share), ``d`` the same tensor as ``c`` but only after ``e``, which reads another tensor."""

    def __init__(self, n: int = 24) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(n, n) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + self.b(x)
        y = torch.tanh(h)
        h = h + self.c(y)
        z = self.e(h)
        return z + self.d(y)


@pytest.mark.parametrize("statistics", ["dense", "sketch"])
def test_shared_inputs_sum_each_modules_own_inputs(statistics):
    torch.manual_seed(0)
    targets = ["a", "b", "c", "d", "e"]
    model = get_peft_model(_Fan(), SplitLoRAConfig(r=2, target_modules=targets, statistics=statistics, sketch_rank=8))
    layers = {name.rsplit(".", 1)[-1]: m for name, m in model.named_modules() if isinstance(m, SplitLoRALayer)}
    seen: dict[str, torch.Tensor] = {}
    for key, layer in layers.items():
        layer.register_forward_pre_hook(
            lambda m, args, key=key: seen.__setitem__(key, seen.get(key, 0) + args[0].double().T @ args[0].double())
        )
    with torch.no_grad():
        batches = [torch.randn(6, 24) for _ in range(4)]
        with model.collect_statistics():
            for x in batches:
                model(x)
        model.end_task()
    for key, layer in layers.items():
        assert int(layer.splitlora_tokens["default"]) == 24, key
        if statistics == "dense":
            torch.testing.assert_close(layer.splitlora_cov["default"].double(), seen[key], rtol=1e-5, atol=1e-5)
            assert torch.equal(layer.splitlora_cov["default"], layer.splitlora_cov["default"].T), key
        else:  # 24 rows, rank <= 24 > 8: the sketch is within its certified error of the module's own inputs
            sketch = layer.splitlora_sketch["default"].double()
            error = torch.linalg.matrix_norm(seen[key] - sketch.T @ sketch, 2)
            assert float(error) <= float(layer.splitlora_sketch_error["default"]) * (1 + 1e-6) + 1e-9, key
            torch.testing.assert_close(layer.splitlora_energy["default"], seen[key].trace(), rtol=1e-5, atol=1e-6)
