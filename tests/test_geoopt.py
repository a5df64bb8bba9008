"""geoopt on Riemannion: the fixed-rank geometry against geoopt's Stiefel manifold, the fixed-rank manifold as a
geoopt manifold against the dense definitions and the Riemannion optimizer's step, and geoopt's RiemannianAdam
training a Riemannion adapter through ``riemannian_parameters``."""

from __future__ import annotations

import ast
from pathlib import Path

import geoopt
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import peft_ext
import peft_ext.manifolds as manifolds
from peft_ext import RiemannionConfig
from peft_ext.manifolds import (
    STIEFEL,
    FactoredFixedRank,
    TangentVector,
    egrad2rgrad,
    geoopt_manifold,
    proju_dense,
    retr,
    retr_dense,
    tangent_to_dense,
    to_dense,
    transp,
)
from peft_ext.optim import create_riemannion_optimizer
from peft_ext.tuners.riemannion import find_adapters, geoopt_params, riemannian_parameters

from .helpers import ContractMLP
from .single_thread import single_thread  # noqa: F401  (fixture)
from .test_fixed_rank import F64, M, N, R, _gen, _point, _tangent

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_package_exports_the_geoopt_names_on_first_use():
    assert set(manifolds._GEOOPT_NAMES) == set(geoopt_manifold.__all__)
    assert set(geoopt_manifold.__all__) <= set(manifolds.__all__)
    assert manifolds.FactoredFixedRank is geoopt_manifold.FactoredFixedRank
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        manifolds.nope  # noqa: B018
    # only geoopt_manifold and the Riemannion tuner's geoopt_params import geoopt, and only geoopt_params imports
    # geoopt_manifold: `import peft_ext` stays without it
    importers = set()
    for path in Path(peft_ext.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
            if any(name.split(".")[0] == "geoopt" or "geoopt_manifold" in name for name in names):
                importers.add(path.name)
    assert importers == {"geoopt_manifold.py", "geoopt_params.py"}, importers
    assert riemannian_parameters is geoopt_params.riemannian_parameters


# -- the fixed-rank geometry against geoopt's Stiefel manifold -------------------------------------------------------


def test_left_factor_of_the_riemannian_gradient_is_the_horizontal_part_of_geoopts_stiefel_projection():
    x = _point()
    G = torch.randn(M, N, generator=_gen(9), dtype=F64)
    grad = egrad2rgrad(x, G @ x.B_R, G.T @ x.A)
    assert STIEFEL.check_point_on_manifold(x.A)
    assert STIEFEL.check_vector_on_tangent(x.A, grad.A_dot)  # A_dot is tangent to St(m, r) at A
    torch.testing.assert_close(STIEFEL.proju(x.A, grad.A_dot), grad.A_dot)
    horizontal = STIEFEL.proju(x.A, G @ x.B_R)
    horizontal = horizontal - x.A @ (x.A.T @ horizontal)
    torch.testing.assert_close(grad.A_dot, horizontal)


def test_retraction_along_the_column_space_agrees_with_geoopts_stiefel_retraction():
    """For xi = A_dot B_R^T, X + xi has rank r, so R(X + xi) = X + xi and span(A_new) = span(qf(A + A_dot R^-T))."""
    x = _point()
    R_B = torch.linalg.qr(x.B).R  # B = B_R R_B, the sign convention does not matter for the span
    B_R = x.B @ torch.linalg.inv(R_B)
    A_dot = _tangent(x).A_dot * 0.5
    y = retr(x, TangentVector(A_dot, torch.zeros_like(x.B)))
    torch.testing.assert_close(to_dense(y), to_dense(x) + A_dot @ B_R.T)  # exact: nothing to truncate
    Q = STIEFEL.retr(x.A, A_dot @ torch.linalg.inv(R_B).T)
    assert STIEFEL.check_point_on_manifold(y.A) and STIEFEL.check_point_on_manifold(Q)
    torch.testing.assert_close(y.A @ y.A.T, Q @ Q.T)


def test_transport_of_the_left_factor_is_geoopts_stiefel_transport_in_the_new_right_basis():
    """With B_dot = 0, transp's A_dot at y is (I - A_y A_y^T) A_dot (B_R^T B_R_y): the horizontal part of geoopt's
    Stiefel transport (a projection onto T_{A_y} St) times the change of right basis."""
    x = _point()
    y = retr(x, _tangent(x, 7) * 0.2)
    A_dot = _tangent(x, 3).A_dot
    moved = transp(x, y, TangentVector(A_dot, torch.zeros_like(x.B)))
    stiefel = STIEFEL.transp(x.A, y.A, A_dot)
    assert STIEFEL.check_vector_on_tangent(y.A, stiefel)
    horizontal = stiefel - y.A @ (y.A.T @ stiefel)
    torch.testing.assert_close(moved.A_dot, horizontal @ (x.B_R.T @ y.B_R))
    assert (moved.A_dot - horizontal).norm() > 1e-3 * horizontal.norm()  # the basis change matters


# -- FactoredFixedRank: the fixed-rank manifold as a geoopt manifold -------------------------------------------------


def _packed(manifold: FactoredFixedRank, seed: int = 0) -> torch.Tensor:
    x = _point(seed)
    return manifold.pack_point(x.A, x.B)


def _dense(manifold: FactoredFixedRank, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The m x n matrix of the packed tangent vector ``u`` at the packed point ``x``."""
    return tangent_to_dense(manifold._point(x), TangentVector(*manifold.unpack_tensor(u)))


def test_factored_fixed_rank_is_the_dense_geometry_under_geoopts_names():
    manifold = FactoredFixedRank(M)
    packed = _packed(manifold)
    x = _point()
    assert manifold.check_point_on_manifold(packed)
    # egrad2rgrad takes the gradient of the packed tensor, as a geoopt optimizer hands it over
    G = torch.randn(M, N, generator=_gen(4), dtype=F64)
    leaf = packed.clone().requires_grad_()
    A, B = manifold.unpack_tensor(leaf)
    (G * (A @ B.T)).sum().backward()  # dL/dX = G
    rgrad = manifold.egrad2rgrad(packed, leaf.grad)
    assert manifold.check_vector_on_tangent(packed, rgrad)
    torch.testing.assert_close(_dense(manifold, packed, rgrad), proju_dense(x.A, x.B, G))
    # proju of a packed [a; b] projects the matrix a B_R^T + A b^T; tangent vectors are fixed points
    ambient = torch.randn_like(packed)
    a, b = manifold.unpack_tensor(ambient)
    projected = manifold.proju(packed, ambient)
    assert not manifold.check_vector_on_tangent(packed, ambient)
    assert manifold.check_vector_on_tangent(packed, projected)
    dense = _dense(manifold, packed, projected)
    torch.testing.assert_close(dense, proju_dense(x.A, x.B, a @ x.B_R.T + x.A @ b.T))
    torch.testing.assert_close(manifold.proju(packed, projected), projected)
    # retraction: the best rank-r approximation; transport: re-projection; inner: Frobenius of the m x n matrices
    step = 0.3 * rgrad
    new = manifold.retr(packed, step)
    y = manifold._point(new)
    assert manifold.check_point_on_manifold(new)
    torch.testing.assert_close(to_dense(y), retr_dense(to_dense(x) + 0.3 * proju_dense(x.A, x.B, G), R))
    moved = manifold.transp(packed, new, projected)
    torch.testing.assert_close(_dense(manifold, new, moved), proju_dense(y.A, y.B, dense))
    torch.testing.assert_close(manifold.inner(packed, rgrad, projected), (proju_dense(x.A, x.B, G) * dense).sum())
    assert manifold.inner(packed, rgrad, keepdim=True).shape == (1, 1)
    # projx: the same matrix, A orthonormal again
    off = manifold.pack_point(x.A * 1.5, x.B)
    assert not manifold.check_point_on_manifold(off)
    back = manifold.projx(off)
    assert manifold.check_point_on_manifold(back)
    torch.testing.assert_close(to_dense(manifold._point(back)), 1.5 * to_dense(x))


def _single_layer(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(N, M)).to(F64)
    return get_peft_model(base, RiemannionConfig(r=R, target_modules=["0"], init_scale=0.5))


def test_geoopt_riemannian_sgd_on_factored_fixed_rank_takes_the_riemannlora_steps():
    """geoopt's loop (egrad2rgrad, then retr) on the packed point = peft_ext's RiemannLoRA (the manifold SGD, no
    momentum) on the adapter, step for step: two implementations of one geometry, one driven by geoopt."""
    model = _single_layer()
    ref = find_adapters(model)[0]
    base = ref.layer.get_base_layer()
    X0 = (ref.layer.riemannion_X0_A["default"] @ ref.layer.riemannion_X0_B["default"].T).detach()
    manifold = FactoredFixedRank(M)
    point = geoopt.ManifoldParameter(manifold.pack_point(ref.A.detach(), ref.B.detach()), manifold=manifold)
    g = _gen(5)
    batches = [(torch.randn(16, N, generator=g, dtype=F64), torch.randn(16, M, generator=g, dtype=F64))] * 5
    ours = create_riemannion_optimizer(model, lr=0.2, variant="sgd", momentum=0.0)
    theirs = geoopt.optim.RiemannianSGD([point], lr=0.2)
    for x, target in batches:
        ours.zero_grad()
        ((model(x) - target) ** 2).mean().backward()
        ours.step()
        theirs.zero_grad()
        A, B = manifold.unpack_tensor(point)
        weight = base.weight + A @ B.T - X0
        ((x @ weight.T + base.bias - target) ** 2).mean().backward()
        theirs.step()
        A, B = manifold.unpack_tensor(point.detach())
        torch.testing.assert_close(A @ B.T, ref.A @ ref.B.T, rtol=1e-9, atol=1e-12)
        assert manifold.check_point_on_manifold(point, atol=1e-10)
    assert (A @ B.T - X0).norm() > 0.1  # it moved


def test_geoopt_riemannian_adam_on_factored_fixed_rank_fits_a_rank_r_target_on_the_manifold():
    manifold = FactoredFixedRank(M)
    target = to_dense(_point(3))
    point = geoopt.ManifoldParameter(_packed(manifold), manifold=manifold)
    optimizer = geoopt.optim.RiemannianAdam([point], lr=0.2)
    # RiemannianAdam's second moment of a manifold parameter is one scalar: steps of about lr in Frobenius norm,
    # so a linear decay lets it settle
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 200)
    losses = []
    for _ in range(200):
        optimizer.zero_grad()
        A, B = manifold.unpack_tensor(point)
        loss = ((A @ B.T - target) ** 2).sum()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        assert manifold.check_point_on_manifold(point, atol=1e-10)
    assert losses[-1] < 1e-4 * losses[0], (losses[0], losses[-1])


def test_factored_fixed_rank_errors_say_what_is_valid():
    with pytest.raises(ValueError, match=r"`m` \(rows of the matrix, of A\) must be a positive integer, got 0"):
        FactoredFixedRank(0)
    manifold = FactoredFixedRank(M)
    with pytest.raises(ValueError, match=r"must have shape \(\.\.\., m \+ n, r\) with n >= 1 and 1 <= r <= min"):
        geoopt.ManifoldParameter(torch.zeros(M + 2, 3), manifold=manifold)
    with pytest.raises(ValueError, match=r"packs A \(m x r\) with m=9"):
        manifold.pack_point(torch.zeros(4, 2), torch.zeros(5, 2))
    with pytest.raises(NotImplementedError, match="no exponential map; use retr"):
        manifold.expmap(_packed(manifold), torch.zeros(M + N, R, dtype=F64))
    sample = manifold.random(N, R, dtype=F64)
    assert sample.shape == (M + N, R) and manifold.check_point_on_manifold(sample)


# -- riemannian_parameters: geoopt's optimizers on a Riemannion adapter ----------------------------------------------


def MLP() -> nn.Module:  # noqa: N802  (stands for the class it builds)
    return ContractMLP((10, 24, 16, 3))


def _model(**config) -> nn.Module:
    torch.manual_seed(0)
    options = {"r": 3, "target_modules": ["lin0", "lin1"], "init_scale": 0.5, **config}
    return get_peft_model(MLP(), RiemannionConfig(**options))


def _teacher_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and the outputs of the MLP with a rank-2 change of ``lin0``: an adapter of rank 3 can fit them."""
    teacher = MLP()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        teacher.lin0.weight += torch.randn(24, 2, generator=g) @ torch.randn(2, 10, generator=g) * 0.3
        return [(x, teacher(x)) for x in (torch.randn(16, 10, generator=g) for _ in range(4))]


def test_riemannian_adam_trains_a_riemannion_adapter_on_its_manifold():
    model = _model()
    keys = set(model.state_dict())
    params = riemannian_parameters(model)
    refs = find_adapters(model)
    # A of each adapter on geoopt's Stiefel manifold, in the model; B Euclidean; the zero probes and the frozen base
    # left out
    assert [id(p) for p in params] == [id(p) for ref in refs for p in (ref.A, ref.B)]
    assert all(isinstance(ref.A, geoopt.ManifoldParameter) and ref.A.manifold is STIEFEL for ref in refs)
    assert not any(isinstance(ref.B, geoopt.ManifoldParameter) for ref in refs)
    assert set(model.state_dict()) == keys  # saves and loads as before
    start = [(ref.A.detach().clone(), ref.B.detach().clone()) for ref in refs]
    X0 = [ref.layer.riemannion_X0_A["default"].clone() for ref in refs]
    optimizer = geoopt.optim.RiemannianAdam(params, lr=1e-2)
    batches = _teacher_batches()

    def loss_now() -> float:
        with torch.no_grad():
            return sum(nn.functional.mse_loss(model(x), y).item() for x, y in batches) / len(batches)

    before = loss_now()
    for _ in range(10):
        for x, y in batches:
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            model.zero_grad()
            for ref in refs:
                gram = ref.A.detach().T @ ref.A.detach()
                torch.testing.assert_close(gram, torch.eye(3), atol=1e-5, rtol=0)
                assert not ref.Z.any()
    after = loss_now()
    assert after < 0.2 * before, (before, after)  # only the adapters learn (the head is frozen); measured 0.1x
    for ref, (A, B), X0_A in zip(refs, start, X0):
        assert (ref.A - A).norm() > 1e-2 and (ref.B - B).norm() > 1e-2
        assert torch.equal(ref.layer.riemannion_X0_A["default"], X0_A)
    # the point is a Riemannion point: the Riemannion optimizer takes over from here
    create_riemannion_optimizer(model, lr=1e-3)


def test_riemannian_parameters_include_heads_and_are_stable_across_calls():
    model = _model(modules_to_save=["head"])
    params = riemannian_parameters(model)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    named = {id(p): name for name, p in model.named_parameters()}
    assert [named[id(p)] for p in params] == [name for name in trainable if "riemannion_Z" not in name]
    assert any("head" in named[id(p)] for p in params)
    assert [id(p) for p in riemannian_parameters(model)] == [id(p) for p in params]


def test_riemannian_parameters_of_one_adapter_leave_the_others_out():
    model = _model()
    model.add_adapter("other", RiemannionConfig(r=2, target_modules=["lin0"], init_scale=0.5))
    params = riemannian_parameters(model, "default")
    assert {id(p) for p in params} == {id(p) for ref in find_adapters(model, "default") for p in (ref.A, ref.B)}
    other = find_adapters(model, "other")[0]
    assert not isinstance(other.A, geoopt.ManifoldParameter)


def test_riemannian_parameters_errors_name_what_would_be_valid():
    with pytest.raises(ValueError, match=r"MLP has no Riemannion adapter; add one with get_peft_model"):
        riemannian_parameters(MLP())
    lora = get_peft_model(MLP(), LoraConfig(r=2, target_modules=["lin0"]))
    with pytest.raises(ValueError, match=r"has no Riemannion adapter; add one"):
        riemannian_parameters(lora)
    model = _model()
    with pytest.raises(ValueError, match=r"has no Riemannion adapter named 'nope'; valid names: \['default'\]"):
        riemannian_parameters(model, "nope")
    for ref in find_adapters(model):
        ref.A.requires_grad_(False)
    with pytest.raises(ValueError, match=r"no trainable Riemannion adapter \(adapters \['default'\]\); activate"):
        riemannian_parameters(model)
    model = _model()
    ref = find_adapters(model)[0]
    with torch.no_grad():
        ref.A.mul_(2.0)
    with pytest.raises(ValueError, match=r"adapter 'default' of .*lin0: riemannion_A is not orthonormal \(max"):
        riemannian_parameters(model)
    model = _model()
    model.to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"torch.bfloat16 factors; geoopt's Stiefel retraction \(QR\) needs float32"):
        riemannian_parameters(model)
