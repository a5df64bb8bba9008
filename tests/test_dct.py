"""The DCT utilities behind DCT-AdamW: the matrix, Makhoul's FFT algorithm, subspace selection and projection."""

from __future__ import annotations

import math

import pytest
import torch

from peft_ext.optim import dct
from peft_ext.optim.dct import (
    FFT_MIN_SIZE,
    clear_dct_cache,
    dct2,
    dct2_fft,
    dct2_matmul,
    dct_cache_bytes,
    dct_matrix,
    dct_scores,
    dct_select,
    project,
    project_back,
    projection_side,
    resolve_dct_method,
)

from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")  # small transforms; see tests/single_thread.py


def formula_matrix(n: int) -> torch.Tensor:
    """docs/methods.md (DCT-AdamW), entry by entry in float64 (independent of the vectorized, range-reduced
    builder)."""
    q = torch.empty(n, n, dtype=torch.float64)
    for k in range(n):
        for j in range(n):
            q[k, j] = math.sqrt(2 / n) * math.cos(math.pi * k * (2 * j + 1) / (2 * n))
    q[0] /= math.sqrt(2)
    return q


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13])
def test_dct_matrix_follows_the_formula(n):
    assert torch.allclose(dct_matrix(n, torch.float64), formula_matrix(n), atol=1e-14)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 385, 1024])
def test_dct_matrix_is_orthonormal(n):
    q64 = dct_matrix(n, torch.float64)
    eye = torch.eye(n, dtype=torch.float64)
    assert (q64 @ q64.T - eye).abs().max() < 1e-12
    assert (q64.T @ q64 - eye).abs().max() < 1e-12
    q32 = dct_matrix(n)
    assert (q32 @ q32.T - eye.float()).abs().max() < 2e-5


def test_dct_of_a_constant_is_its_mean_times_sqrt_n():
    x = torch.full((9,), 2.0, dtype=torch.float64)
    out = dct2_matmul(x)
    assert out[0].item() == pytest.approx(2.0 * 3.0)
    assert out[1:].abs().max() < 1e-13


def test_dct_matrix_is_cached_per_size_dtype_and_device():
    clear_dct_cache()
    assert dct_cache_bytes() == 0
    a = dct_matrix(16)
    assert dct_matrix(16) is a, "one matrix per size must be shared by all layers"
    assert dct_matrix(16, torch.float64) is not a
    assert dct_matrix(17) is not a
    assert dct_cache_bytes() == 16 * 16 * 4 + 16 * 16 * 8 + 17 * 17 * 4
    clear_dct_cache()
    assert dct_cache_bytes() == 0 and dct_matrix(16) is not a


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 15, 16, 33, 64, 127, 384, 385, 1000])
def test_makhoul_fft_equals_the_matrix_dct(n):
    x64 = torch.randn(6, n, dtype=torch.float64)
    assert (dct2_fft(x64) - dct2_matmul(x64)).abs().max() < 1e-12
    if n <= 128:  # the entry-by-entry reference is a Python double loop
        assert (dct2_fft(x64) - x64 @ formula_matrix(n).T).abs().max() < 1e-12
    x32 = x64.float()
    scale = x32.abs().max()
    assert (dct2_fft(x32) - dct2_matmul(x32)).abs().max() < 1e-5 * scale * math.sqrt(n)


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_dct_along_any_dim(dim):
    x = torch.randn(5, 6, 7, dtype=torch.float64)
    expected = torch.movedim(torch.movedim(x, dim, -1) @ dct_matrix(x.shape[dim], torch.float64).T, -1, dim)
    for method in ("matmul", "fft"):
        assert torch.allclose(dct2(x, dim=dim, method=method), expected, atol=1e-12)


def test_half_precision_input_is_transformed_in_fp32():
    x = torch.randn(4, 32)
    for method in ("matmul", "fft"):
        out = dct2(x.bfloat16(), method=method)
        assert out.dtype == torch.float32
        assert torch.allclose(out, dct2(x.bfloat16().float(), method=method), atol=1e-5)


def test_auto_method_switches_to_fft_at_the_threshold():
    assert resolve_dct_method("auto", FFT_MIN_SIZE - 1) == "matmul"
    assert resolve_dct_method("auto", FFT_MIN_SIZE) == "fft"
    assert resolve_dct_method("matmul", 10_000) == "matmul"
    assert resolve_dct_method("fft", 2) == "fft"


def planted(rows: int, n: int, columns: list[int], noise: float = 1e-3, seed: int = 0) -> torch.Tensor:
    """An (rows x n) gradient whose DCT-II energy sits on ``columns`` (rows of Q), plus small dense noise."""
    gen = torch.Generator().manual_seed(seed)
    q = dct_matrix(n, torch.float64)
    coeffs = noise * torch.randn(rows, n, generator=gen, dtype=torch.float64)
    coeffs[:, columns] += torch.randn(rows, len(columns), generator=gen, dtype=torch.float64).sign() * (
        1 + torch.rand(rows, len(columns), generator=gen, dtype=torch.float64)
    )
    return coeffs @ q  # S = G Q^T = coeffs


@pytest.mark.parametrize("method", ["matmul", "fft"])
def test_selection_finds_planted_columns_right_side(method):
    cols = [3, 17, 40, 41]
    g = planted(96, 48, cols)
    assert projection_side(g.shape) == "right"
    indices, low = dct_select(g, 4, method=method)
    assert indices.tolist() == cols
    assert indices.dtype == torch.int64
    q = dct_matrix(48, torch.float64)
    assert torch.allclose(low, g @ q[indices].T, atol=1e-12), "the low-rank gradient is G Q[I]^T"


@pytest.mark.parametrize("method", ["matmul", "fft"])
def test_selection_finds_planted_rows_left_side(method):
    rows = [0, 9, 30]
    g = planted(80, 32, rows, seed=1).T.contiguous()  # (32, 80): R < C, so rows are scored
    assert projection_side(g.shape) == "left"
    indices, low = dct_select(g, 3, method=method)
    assert indices.tolist() == rows
    q = dct_matrix(32, torch.float64)
    assert torch.allclose(low, q[indices] @ g, atol=1e-12), "the low-rank gradient is Q[I] G"


def test_selection_is_sorted_and_matches_topk_of_l1_scores():
    g = torch.randn(40, 24, dtype=torch.float64)
    indices, _ = dct_select(g, 7)
    scores = (g @ dct_matrix(24, torch.float64).T).abs().sum(0)
    assert indices.tolist() == sorted(torch.topk(scores, 7).indices.tolist())


def test_selection_norm_changes_what_is_picked():
    # Column 2 has one large coefficient (L1 = L2 = 10); column 5 has twelve of 3 (L1 = 36, L2 = 10.4, max = 3).
    coeffs = torch.zeros(12, 8, dtype=torch.float64)
    coeffs[0, 2] = 10.0
    coeffs[:, 5] = 3.0
    g = coeffs @ dct_matrix(8, torch.float64)
    assert dct_select(g, 1, norm=1)[0].tolist() == [5]
    assert dct_select(g, 1, norm=2)[0].tolist() == [5]
    assert dct_select(g, 1, norm=math.inf)[0].tolist() == [2]
    coeffs[0, 2] = 11.0  # L2 of column 2 now beats column 5's 10.39; L1 still prefers 5
    g = coeffs @ dct_matrix(8, torch.float64)
    assert dct_select(g, 1, norm=1)[0].tolist() == [5]
    assert dct_select(g, 1, norm=2)[0].tolist() == [2]


def test_scores_are_the_column_norms_of_the_transform():
    g = torch.randn(10, 6, dtype=torch.float64)
    coeffs, scores = dct_scores(g, "left", norm=2)
    assert torch.allclose(coeffs, dct_matrix(10, torch.float64) @ g, atol=1e-12)
    assert torch.allclose(scores, coeffs.norm(dim=1))


@pytest.mark.parametrize("shape", [(20, 8), (8, 20)])
def test_projection_round_trip(shape):
    g = torch.randn(*shape, dtype=torch.float64)
    side = projection_side(shape)
    n = min(shape)
    q = dct_matrix(n, torch.float64)
    full = project_back(project(g, q, side), q, side)
    assert torch.allclose(full, g, atol=1e-12), "with every basis vector the projection is lossless"
    basis = q[torch.tensor([1, 4, 6])]
    low = project(g, basis, side)
    assert low.shape == ((shape[0], 3) if side == "right" else (3, shape[1]))
    back = project_back(low, basis, side)
    assert torch.allclose(project(back, basis, side), low, atol=1e-12), "projecting twice changes nothing"
    residual = g - back
    assert project(residual, basis, side).abs().max() < 1e-12, "the residual is orthogonal to the subspace"


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="positive integer, got 0"):
        dct_matrix(0)
    with pytest.raises(TypeError, match="must be an int"):
        dct_matrix(2.5)
    with pytest.raises(TypeError, match="floating-point dtype"):
        dct_matrix(4, torch.int64)
    with pytest.raises(ValueError, match="one of"):
        resolve_dct_method("svd", 8)
    with pytest.raises(ValueError, match="one of"):
        dct2(torch.randn(3, 4), method="svd")
    with pytest.raises(TypeError, match="floating-point"):
        dct2_fft(torch.arange(4))
    with pytest.raises(TypeError, match="floating-point"):
        dct2_matmul(torch.arange(4))
    g = torch.randn(10, 6)
    with pytest.raises(ValueError, match=r"in \[1, 6\].*got 0"):
        dct_select(g, 0)
    with pytest.raises(ValueError, match=r"in \[1, 6\].*got 7"):
        dct_select(g, 7)
    with pytest.raises(TypeError, match="must be an int"):
        dct_select(g, 2.0)
    with pytest.raises(ValueError, match="2-D"):
        dct_select(torch.randn(10), 2)
    with pytest.raises(ValueError, match="positive number"):
        dct_select(g, 2, norm=0)
    with pytest.raises(ValueError, match="`side`"):
        dct_select(g, 2, side="top")
    with pytest.raises(ValueError, match="`side`"):
        project(g, torch.eye(6), "top")
    with pytest.raises(ValueError, match="2-D shape"):
        projection_side((2, 3, 4))


def test_module_exports_what_it_documents():
    for name in dct.__all__:
        assert hasattr(dct, name), name
