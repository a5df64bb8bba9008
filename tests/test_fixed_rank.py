"""Fixed-rank geometry in factored form against the dense m x n definitions (against geoopt's: test_geoopt.py)."""

from __future__ import annotations

import pytest
import torch

from peft_ext.manifolds import (
    FixedRankManifold,
    FixedRankPoint,
    TangentVector,
    egrad2rgrad,
    inner,
    ortho_dense,
    ortho_lowrank,
    orthogonalize,
    proju,
    proju_dense,
    random_point,
    retr,
    retr_dense,
    right_basis,
    stack_bases,
    tangent_factors,
    tangent_to_dense,
    to_dense,
    transp,
)

from .allocations import assert_no_allocation_of, record_allocations
from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

M, N, R = 9, 7, 3
F64 = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _point(seed: int = 0, m: int = M, n: int = N, r: int = R) -> FixedRankPoint:
    """A point with distinct singular values (B is not orthonormal), in float64."""
    g = _gen(seed)
    A = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=F64)).Q
    B = torch.randn(n, r, generator=g, dtype=F64)
    return FixedRankPoint.from_factors(A, B)


def _tangent(x: FixedRankPoint, seed: int = 1) -> TangentVector:
    g = _gen(seed)
    U = torch.randn(x.A.shape[0], 5, generator=g, dtype=F64)
    V = torch.randn(x.B.shape[0], 5, generator=g, dtype=F64)
    return proju(x, U, V)


def test_right_basis_is_an_orthonormal_basis_of_span_b():
    x = _point()
    torch.testing.assert_close(x.B_R.T @ x.B_R, torch.eye(R, dtype=F64))
    torch.testing.assert_close(x.B_R @ (x.B_R.T @ x.B), x.B)  # span(B_R) contains B
    assert torch.equal(right_basis(x.B), x.B_R)  # deterministic: forward pass and optimizer agree


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_right_basis_of_a_stack_equals_each_matrix_own_bit_for_bit(dtype):
    # the optimizer computes B_R for a stack of adapters and hands each layer its slice; odd sizes are where a
    # batched QR would round differently from the single-matrix one
    gen = torch.Generator().manual_seed(0)
    B = torch.randn(4, 17, 3, generator=gen, dtype=dtype)
    stacked = right_basis(B)
    for i in range(4):
        assert torch.equal(stacked[i], right_basis(B[i].clone())), i
    assert stacked.stride() == torch.linalg.qr(B).Q.stride()  # laid out like a batched QR's Q (matmuls round alike)
    assert torch.equal(stack_bases(list(stacked.unbind(0))), stacked)


def test_projection_of_a_low_rank_matrix_equals_the_dense_projection():
    x = _point()
    g = _gen(2)
    U, V = torch.randn(M, 4, generator=g, dtype=F64), torch.randn(N, 4, generator=g, dtype=F64)
    u = proju(x, U, V)
    torch.testing.assert_close(tangent_to_dense(x, u), proju_dense(x.A, x.B, U @ V.T))
    torch.testing.assert_close(x.A.T @ u.A_dot, torch.zeros(R, R, dtype=F64), atol=1e-12, rtol=0)
    # a projection: projecting the result again changes nothing
    again = proju(x, *tangent_factors(x, u))
    torch.testing.assert_close(tangent_to_dense(x, again), tangent_to_dense(x, u))


def test_riemannian_gradient_from_the_two_products_equals_the_dense_projection_of_g():
    x = _point()
    G = torch.randn(M, N, generator=_gen(3), dtype=F64)
    grad = egrad2rgrad(x, G @ x.B_R, G.T @ x.A)
    torch.testing.assert_close(tangent_to_dense(x, grad), proju_dense(x.A, x.B, G))
    # and it is the steepest direction: <grad, xi> = <G, xi> for every tangent xi
    xi = _tangent(x)
    torch.testing.assert_close(inner(x, grad, xi), (G * tangent_to_dense(x, xi)).sum())


def test_inner_product_equals_the_frobenius_product_of_dense_tangents():
    x = _point()
    u, v = _tangent(x, 1), _tangent(x, 2)
    torch.testing.assert_close(inner(x, u, v), (tangent_to_dense(x, u) * tangent_to_dense(x, v)).sum())
    torch.testing.assert_close(FixedRankManifold.norm(x, u), tangent_to_dense(x, u).norm())


@pytest.mark.parametrize("x_scale", [1.0, 0.7])
def test_retraction_is_the_best_rank_r_approximation(x_scale):
    x = _point()
    u = _tangent(x) * 0.3
    y = retr(x, u, x_scale=x_scale)
    expected = retr_dense(x_scale * to_dense(x) + tangent_to_dense(x, u), R)
    torch.testing.assert_close(to_dense(y), expected)
    torch.testing.assert_close(y.A.T @ y.A, torch.eye(R, dtype=F64))
    s = torch.linalg.svdvals(to_dense(y))
    assert s[R - 1] > 1e-3 * s[0] and (s[R:] < 1e-12 * s[0]).all(), s  # rank exactly r


def test_retraction_is_first_order():
    """||R(X + t xi) - (X + t xi)|| = O(t^2): the error shrinks 100x when t shrinks 10x."""
    x = _point()
    xi = _tangent(x)
    errors = []
    for t in (1e-1, 1e-2, 1e-3):
        y = retr(x, xi * t)
        errors.append((to_dense(y) - (to_dense(x) + t * tangent_to_dense(x, xi))).norm().item())
    assert errors[0] > 1e-6, errors  # nonzero: the tangent step really leaves the manifold
    for big, small in zip(errors, errors[1:]):
        assert 60 < big / small < 160, errors
    assert errors[-1] / 1e-3**2 < 2 * errors[0] / 1e-1**2  # err / t^2 stays bounded


def test_retraction_of_zero_step_keeps_the_point():
    x = _point()
    zero = TangentVector(torch.zeros_like(x.A), torch.zeros_like(x.B))
    torch.testing.assert_close(to_dense(retr(x, zero)), to_dense(x))


def test_orthogonalization_sets_nonzero_singular_values_to_one():
    g = _gen(4)
    U, V = torch.randn(M, 4, generator=g, dtype=F64), torch.randn(N, 4, generator=g, dtype=F64)
    Uo, Vo = ortho_lowrank(U, V)
    dense = Uo @ Vo.T
    torch.testing.assert_close(dense, ortho_dense(U @ V.T))
    s = torch.linalg.svdvals(dense)
    torch.testing.assert_close(s[:4], torch.ones(4, dtype=F64))
    assert (s[4:] < 1e-12).all()


def test_orthogonalization_of_factors_that_are_not_tall_factors_no_qr(monkeypatch):
    """Square factors (the factored step's 2r x 2r triangular cores, signs as they come) and wide ones go into the SVD
    as they are, with the result of the QR route (whose Q is exactly diag(+-1) for triangular factors) and the dense
    one."""
    g = _gen(12)
    T_L = torch.linalg.qr(torch.randn(3, 20, 6, generator=g)).R  # 6 x 6 upper triangular, diagonal of either sign
    T_R = torch.linalg.qr(torch.randn(3, 20, 6, generator=g)).R
    qr_route = ortho_lowrank(torch.cat([T_L, torch.zeros(3, 2, 6)], -2), torch.cat([T_R, torch.zeros(3, 2, 6)], -2))
    real_qr, calls = torch.linalg.qr, []
    monkeypatch.setattr(torch.linalg, "qr", lambda *a, **k: calls.append(a[0].shape) or real_qr(*a, **k))
    Uo, Vo = ortho_lowrank(T_L, T_R)
    assert calls == []
    want = qr_route[0][..., :6, :] @ qr_route[1][..., :6, :].mT
    torch.testing.assert_close(Uo @ Vo.mT, want, rtol=0, atol=1e-6)
    wide = torch.randn(4, 6, generator=g, dtype=F64), torch.randn(N, 6, generator=g, dtype=F64)
    Uo, Vo = ortho_lowrank(*wide)
    assert calls == [(N, 6)]  # only the tall factor is factored
    torch.testing.assert_close(Uo @ Vo.T, ortho_dense(wide[0] @ wide[1].T))


def test_orthogonalization_keeps_zero_singular_values_zero():
    g = _gen(5)
    U = torch.randn(M, 2, generator=g, dtype=F64) @ torch.randn(2, 4, generator=g, dtype=F64)  # rank 2 in 4 columns
    V = torch.randn(N, 4, generator=g, dtype=F64)
    Uo, Vo = ortho_lowrank(U, V)
    s = torch.linalg.svdvals(Uo @ Vo.T)
    torch.testing.assert_close(s[:2], torch.ones(2, dtype=F64))
    assert (s[2:] < 1e-10).all(), s
    zero = ortho_lowrank(torch.zeros(M, 4, dtype=F64), torch.zeros(N, 4, dtype=F64))
    assert torch.equal(zero[0] @ zero[1].T, torch.zeros(M, N, dtype=F64))


def test_riemannion_direction_equals_dense_projection_of_dense_ortho():
    x = _point()
    u = _tangent(x)
    d = orthogonalize(x, u)
    expected = proju_dense(x.A, x.B, ortho_dense(tangent_to_dense(x, u)))
    torch.testing.assert_close(tangent_to_dense(x, d), expected)
    # the re-projection matters: the polar factor of a tangent vector is not tangent in general
    assert (ortho_dense(tangent_to_dense(x, u)) - expected).norm() > 1e-3


def test_transport_is_the_projection_onto_the_new_tangent_space():
    x = _point()
    u = _tangent(x)
    y = retr(x, _tangent(x, 7) * 0.2)
    v = transp(x, y, u)
    torch.testing.assert_close(tangent_to_dense(y, v), proju_dense(y.A, y.B, tangent_to_dense(x, u)))


def test_manifold_object_speaks_geoopt_vocabulary():
    x, manifold = _point(), FixedRankManifold()
    G = torch.randn(M, N, generator=_gen(8), dtype=F64)
    u = manifold.egrad2rgrad(x, G @ x.B_R, G.T @ x.A)
    y = manifold.retr(x, u * 0.1)
    for a, b in [
        (tangent_to_dense(x, u), proju_dense(x.A, x.B, G)),
        (tangent_to_dense(x, manifold.proju(x, *tangent_factors(x, u))), tangent_to_dense(x, u)),
        (to_dense(y), to_dense(retr(x, u * 0.1))),
        (tangent_to_dense(y, manifold.transp(x, y, u)), tangent_to_dense(y, transp(x, y, u))),
        (tangent_to_dense(x, manifold.ortho(x, u)), tangent_to_dense(x, orthogonalize(x, u))),
    ]:
        torch.testing.assert_close(a, b)


def test_factored_operations_never_allocate_an_m_by_n_matrix():
    m, n, r = 300, 200, 4
    x = random_point(m, n, r, 0.1, generator=_gen(10))
    G_BR, Gt_A = torch.randn(m, r), torch.randn(n, r)

    def run() -> None:
        u = egrad2rgrad(x, G_BR, Gt_A)
        d = orthogonalize(x, u)
        y = retr(x, d * -0.01, x_scale=0.99)
        transp(x, y, u)
        inner(x, u, d)

    recorder = record_allocations(run, existing=[x.A, x.B, x.B_R, G_BR, Gt_A])
    # nothing larger than the (m x 2r) tall factors; an m x n matrix would be 60000 elements
    assert_no_allocation_of(recorder, max(m, n) * 2 * r + 1, "the factored geometry")


def test_random_point_has_the_requested_singular_values_and_rejects_bad_ranks():
    x = random_point(12, 8, 3, 0.25, generator=_gen(11), dtype=F64)
    torch.testing.assert_close(torch.linalg.svdvals(to_dense(x))[:3], torch.full((3,), 0.25, dtype=F64))
    with pytest.raises(ValueError, match=r"rank r must be in \[1, min\(m, n\)\] = \[1, 8\], got r=9"):
        random_point(12, 8, 9)
    with pytest.raises(ValueError, match=r"A \(m x r\) and B \(n x r\) with the same r"):
        FixedRankPoint.from_factors(torch.zeros(5, 2), torch.zeros(4, 3))
