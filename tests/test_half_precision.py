"""Half precision beyond the tuner contract: the optimizers and task cycles on bfloat16 / float16 adapters, against
float32 runs of the same thing, and the dtypes that are refused (tests/tuner_contract.py has the per-adapter checks:
forward, merge, training and 4-bit bases in half precision)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_ext import PCLRConfig, RiemannionConfig, SplitLoRAConfig
from peft_ext.kernels import retract
from peft_ext.manifolds import FixedRankPoint, TangentVector, ortho_lowrank, proju, random_point, right_basis, to_dense
from peft_ext.models import tiny_llama
from peft_ext.optim import DCTAdamW, create_riemannion_optimizer
from peft_ext.tuners.pclr import PCLRLayer
from peft_ext.tuners.riemannion import find_adapters, initialize_loi

from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

HALF = [torch.bfloat16, torch.float16]


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _orthonormality_error(A: torch.Tensor) -> float:
    A = A.detach().double()
    return (A.mT @ A - torch.eye(A.shape[1], dtype=A.dtype)).abs().max().item()


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_fixed_rank_geometry_in_half_precision(dtype):
    """QR / SVD / Cholesky of half-precision factors run in float32 (CPU has no half kernels for them) and return the
    input's dtype; the results are float32's rounded."""
    point = random_point(40, 24, 3, generator=torch.Generator().manual_seed(0))
    step = proju(point, torch.randn(40, 2) * 0.1, torch.randn(24, 2) * 0.1)
    half = FixedRankPoint.from_factors(point.A.to(dtype), point.B.to(dtype))
    assert half.B_R.dtype == dtype and _orthonormality_error(half.B_R) <= 2 * _eps(dtype)
    assert torch.allclose(half.B_R.float(), point.B_R, atol=4 * _eps(dtype))
    U, V = ortho_lowrank(point.A, point.B)
    U_h, V_h = ortho_lowrank(half.A, half.B)
    assert U_h.dtype == V_h.dtype == dtype
    assert torch.allclose((U_h.float() @ V_h.float().T), U @ V.T, atol=8 * _eps(dtype))
    half_step = TangentVector(step.A_dot.to(dtype), step.B_dot.to(dtype))
    expected = to_dense(retract(point, step, 0.9, method="qr"))
    for method in ("qr", "cholqr2"):
        new = retract(half, half_step, 0.9, method=method)
        assert new.A.dtype == new.B.dtype == dtype and _orthonormality_error(new.A) <= 2 * _eps(dtype)
        assert (to_dense(new).float() - expected).norm() <= 4 * _eps(dtype) * expected.norm()


def _teacher_task() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A base MLP and data from the same MLP with a rank-2 change of its first weight: what a rank-2 adapter fits."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 8))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=gen)
    delta = torch.randn(48, 2, generator=gen) @ torch.randn(2, 32, generator=gen) * 0.3
    with torch.no_grad():
        y = base[2](torch.tanh(x @ (base[0].weight + delta).T + base[0].bias))
    return base, x, y


def _riemannion_run(dtype: torch.dtype, autocast: bool, steps: int = 12):
    base, x, y = _teacher_task()
    model = get_peft_model(
        base.to(dtype), RiemannionConfig(r=2, target_modules=["0"]), autocast_adapter_dtype=autocast
    )
    optimizer = create_riemannion_optimizer(model, lr=0.05)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (model(x.to(dtype)).float() - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, optimizer, losses


@pytest.mark.parametrize(
    "dtype, autocast", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)], ids=str
)
def test_riemannion_optimizer_on_half_adapters(dtype, autocast):
    """Steps on bf16 / fp16 adapters: A stays orthonormal to the dtype's precision, the momentum is float32, and the
    loss curve is the float32 one to half-precision accuracy (autocast=True: float32 adapters on a bf16 base)."""
    _, _, reference = _riemannion_run(torch.float32, autocast=False)
    model, optimizer, losses = _riemannion_run(dtype, autocast)
    (ref,) = find_adapters(model)
    want = torch.float32 if autocast else dtype
    assert ref.A.dtype == ref.B.dtype == want
    # rounding an orthonormal A to the dtype moves A^T A by at most eps (float32: the retraction's own accuracy)
    assert _orthonormality_error(ref.A) <= (2 * _eps(want) if want != torch.float32 else 1e-5)
    state = optimizer.state[ref.A]
    assert state["momentum_A"].dtype == state["momentum_B"].dtype == torch.float32
    # the layer's cached B_R (float32 QR, cast) is the basis of the stored B, as a fresh computation gives it
    assert torch.equal(ref.layer.get_right_basis(ref.adapter_name), right_basis(ref.B.detach()))
    assert losses[-1] < 0.7 * losses[0]
    assert abs(losses[-1] - reference[-1]) <= 0.01 * reference[-1], (losses[-1], reference[-1])


def test_riemannion_resumes_half_precision_runs_exactly():
    """load_state_dict keeps the float32 momentum and AdamW moments of bf16 parameters (torch would cast them to
    bf16), so a resumed run equals the uninterrupted one."""

    def build():
        base, x, y = _teacher_task()
        config = RiemannionConfig(r=2, target_modules=["0"], modules_to_save=["2"])
        model = get_peft_model(base.to(torch.bfloat16), config, autocast_adapter_dtype=False)
        return model, create_riemannion_optimizer(model, lr=0.05), x.to(torch.bfloat16), y

    def step(model, optimizer, x, y):
        optimizer.zero_grad()
        (model(x).float() - y).pow(2).mean().backward()
        optimizer.step()

    model, optimizer, x, y = build()
    for _ in range(2):
        step(model, optimizer, x, y)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    resumed, resumed_optimizer, _, _ = build()
    resumed.load_state_dict(saved[0])
    resumed_optimizer.load_state_dict(saved[1])
    dtypes = {
        key: value.dtype for state in resumed_optimizer.state.values() for key, value in state.items() if key != "step"
    }
    assert dtypes and set(dtypes.values()) == {torch.float32}, dtypes
    step(model, optimizer, x, y)
    step(resumed, resumed_optimizer, x, y)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_riemannion_aux_adamw_keeps_float32_moments_for_half_parameters():
    """A float16 head trained by the optimizer's AdamW: float32 moments, so small gradients do not underflow to
    0 / 0 (torch's AdamW with float16 moments turns them into inf)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 2)).to(torch.float16)
    model = get_peft_model(
        base, RiemannionConfig(r=2, target_modules=["0"], modules_to_save=["1"]), autocast_adapter_dtype=False
    )
    optimizer = create_riemannion_optimizer(model, lr=0.01)
    x = torch.randn(8, 16).to(torch.float16)
    for _ in range(2):
        optimizer.zero_grad()
        (model(x).float().pow(2).mean() * 1e-3).backward()  # gradients around 1e-4: g^2 underflows in float16
        optimizer.step()
    head = model.base_model.model[1].modules_to_save["default"].weight
    assert head.dtype == torch.float16 and torch.isfinite(head).all()
    assert optimizer.state[head]["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_loi_on_half_adapters(dtype):
    """LOI on a half-precision model: the output is unchanged, A is orthonormal to the dtype's precision, and the
    estimated singular values of the weight gradient are float32's up to half-precision rounding (the singular
    vectors themselves are not compared: near-equal singular values make them ill-conditioned)."""

    def loi(dtype: torch.dtype):
        base, x, y = _teacher_task()
        config = RiemannionConfig(r=2, target_modules=["0"])
        model = get_peft_model(base.to(dtype), config, autocast_adapter_dtype=False)
        before = model(x.to(dtype))
        result = initialize_loi(
            model, [{"x": x.to(dtype)}], loss_fn=lambda m, b: (m(b["x"]).float() - y).pow(2).mean()
        )
        assert torch.equal(model(x.to(dtype)), before)
        (ref,) = find_adapters(model)
        return ref, result.singular_values["base_model.model.0"]

    _, reference = loi(torch.float32)
    ref, values = loi(dtype)
    assert ref.A.dtype == dtype and ref.B.dtype == dtype
    assert _orthonormality_error(ref.A) <= 2 * _eps(dtype)
    assert torch.allclose(values.float(), reference, rtol=0.05), (values, reference)


def _dct_run(dtype: torch.dtype, steps: int = 6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 64), nn.Tanh(), nn.Linear(64, 4))
    init = [p.detach().clone() for p in model.parameters()]
    model.to(dtype)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(128, 48, generator=gen), torch.randn(128, 4, generator=gen)
    optimizer = DCTAdamW(model.named_parameters(), lr=1e-2, rank=4)
    for _ in range(steps):
        optimizer.zero_grad()
        (model(x.to(dtype)).float() - y).pow(2).mean().backward()
        optimizer.step()
    moves = [p.detach().float() - p0.to(dtype).float() for p, p0 in zip(model.parameters(), init)]
    return model, optimizer, moves


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_dct_adamw_on_a_half_model(dtype):
    """DCT-AdamW on a bf16 / fp16 model: float32 moments, the same DCT columns as float32, and each matrix moves as
    in the float32 run to half-precision accuracy."""
    _, _, reference = _dct_run(torch.float32)
    model, optimizer, moves = _dct_run(dtype)
    state = optimizer.state[model[0].weight]
    assert "indices" in state, "the first weight must be projected"
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert optimizer.state[model[0].bias]["exp_avg_sq"].dtype == torch.float32
    tol = {torch.bfloat16: 0.1, torch.float16: 0.02}[dtype]
    for move, move32 in zip(moves, reference):
        assert (move - move32).norm() <= tol * move32.norm()


def test_splitlora_cycle_on_a_bf16_model_keeps_float32_statistics():
    """autocast_adapter_dtype=False on a bf16 base: B, A and the folded factors are bf16, the statistics float32;
    end_task (eigendecomposition in float64) folds the task without changing the output."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(torch.bfloat16)
    config = SplitLoRAConfig(r=2, target_modules=["0", "2"], init_weights=False)
    model = get_peft_model(base, config, autocast_adapter_dtype=False)
    layer = model.base_model.model[0]
    assert layer.splitlora_B["default"].dtype == layer.splitlora_A["default"].dtype == torch.bfloat16
    assert layer.splitlora_cov["default"].dtype == torch.float32
    x = torch.randn(64, 32).to(torch.bfloat16)
    with torch.no_grad(), model.base_model.collect_statistics():
        before = model(x)
    model.base_model.end_task()
    assert layer.splitlora_cov["default"].dtype == torch.float32 and layer.splitlora_tokens["default"] == 64
    assert layer.splitlora_old_B["default"].dtype == layer.splitlora_A["default"].dtype == torch.bfloat16
    # folding B A into the bf16 old factors is exact (they are stacked, not summed)
    assert torch.equal(model(x), before)
    # model.to casts every floating buffer, the running sums included: the next end_task restores their dtypes
    model.to(torch.bfloat16)
    assert layer.splitlora_energy["default"].dtype == torch.bfloat16
    with torch.no_grad(), model.base_model.collect_statistics():
        model(x)
    model.base_model.end_task()
    assert layer.splitlora_cov["default"].dtype == torch.float32
    assert layer.splitlora_energy["default"].dtype == torch.float64


def test_pclr_prototypes_stay_float32_without_autocast():
    model = tiny_llama(vocab_size=64, hidden_size=32).to(torch.bfloat16)
    config = PCLRConfig(target_modules=["q_proj", "v_proj"], pool_size=8, ranks_schedule=[4], top_k=2)
    model = get_peft_model(model, config, autocast_adapter_dtype=False)
    owners = [m for m in model.modules() if isinstance(m, PCLRLayer) and m.owns_keys("default")]
    assert owners
    for layer in owners:
        assert layer.pclr_prototypes["default"].dtype == torch.float32
        assert layer.pclr_A["default"].dtype == layer.pclr_keys["default"].dtype == torch.bfloat16


# -- bad input -------------------------------------------------------------------------------------------------------


def test_float8_adapter_is_refused_before_forward_or_merge():
    model = get_peft_model(nn.Sequential(nn.Linear(8, 8)), RiemannionConfig(r=2, target_modules=["0"]))
    layer = model.base_model.model[0]
    weight = layer.base_layer.weight.detach().clone()
    for params in (layer.riemannion_A, layer.riemannion_B, layer.riemannion_Z):
        params["default"] = nn.Parameter(params["default"].detach().to(torch.float8_e4m3fn))
    message = r"Riemannion: parameter 'riemannion_A\.default' has dtype torch\.float8_e4m3fn; .*float32, bfloat16"
    with pytest.raises(TypeError, match=message):
        model(torch.randn(2, 8))
    with pytest.raises(TypeError, match=message):
        model.merge_adapter()
    assert torch.equal(layer.base_layer.weight, weight) and not layer.merged


def test_float8_base_without_autocast_is_refused_when_the_adapter_is_created():
    """PEFT's autocast upcasts float8 adapters to float32 (that works); without it they would be float8."""
    base = nn.Sequential(nn.Linear(8, 8)).to(torch.float8_e4m3fn)
    get_peft_model(base, SplitLoRAConfig(r=2, target_modules=["0"]))  # autocast: float32 adapter, accepted
    message = r"Riemannion: parameter 'riemannion_A\.default' has dtype torch\.float8_e4m3fn"
    with pytest.raises(TypeError, match=message):
        get_peft_model(
            nn.Sequential(nn.Linear(8, 8)).to(torch.float8_e4m3fn),
            RiemannionConfig(r=2, target_modules=["0"]),
            autocast_adapter_dtype=False,
        )


def test_optimizers_refuse_unsupported_dtypes_naming_the_parameter():
    odd = nn.Parameter(torch.zeros(4, 4).to(torch.float8_e5m2), requires_grad=False)
    with pytest.raises(TypeError, match=r"DCTAdamW: parameter 'odd' has dtype torch\.float8_e5m2"):
        DCTAdamW([("odd", odd)], lr=1e-3, rank=2)
    model = get_peft_model(
        nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), RiemannionConfig(r=2, target_modules=["0"])
    )
    model.base_model.model[1].weight = nn.Parameter(torch.zeros(2, 8, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"Riemannion: parameter '.*1\.weight' has dtype torch\.complex64"):
        create_riemannion_optimizer(model, lr=1e-3)


def test_float64_is_not_refused():
    """float64 adapters are not a half-precision case but must keep working (no invented restriction)."""
    base, x, y = _teacher_task()
    model = get_peft_model(base.double(), RiemannionConfig(r=2, target_modules=["0"]))
    optimizer = create_riemannion_optimizer(model, lr=0.05)
    (model(x.double()) - y.double()).pow(2).mean().backward()
    optimizer.step()
    (ref,) = find_adapters(model)
    assert ref.A.dtype == torch.float64 and _orthonormality_error(ref.A) < 1e-12
