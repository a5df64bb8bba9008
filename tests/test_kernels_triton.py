"""The Triton kernels against their torch references, on CPU and, where there is one, on a GPU.

Three kinds of test:

- ``interp``: every kernel run by Triton's CPU interpreter against the torch reference (forward, all gradients,
  dtypes, odd sizes, repeated indices, K = N, K = 1). Triton decides at import time whether ``@triton.jit`` builds
  interpreted functions, so these run in a subprocess with ``TRITON_INTERPRET=1`` (``test_interpreter_suite``); run
  ``TRITON_INTERPRET=1 pytest tests/test_kernels_triton.py -k interp_`` to see them one by one.
- ``compile``: every kernel compiled to a cubin for sm_80 and sm_90 with ``triton.compile``, no GPU needed.
- ``gpu``: the kernels on CUDA tensors, against the references, and the dispatch; skipped without a GPU.
Plus CPU checks of the retraction's CholeskyQR2 algorithm and the dispatch, which need neither.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peft_ext.kernels import dispatch as dispatch_module
from peft_ext.kernels import rank_pool_gather, rank_pool_gather_loop
from peft_ext.kernels.retraction import batched_retraction, cholesky_qr2, choose_retraction, retract
from peft_ext.manifolds.fixed_rank import FixedRankPoint, proju, random_point, retr

triton = pytest.importorskip("triton", reason="triton is only installed on Linux x86-64")
# the project's own kernel modules are imported plainly: with triton present, an error in them fails, never skips
from peft_ext.kernels import triton_rank_pool, triton_retraction  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(
    not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess of test_interpreter_suite"
)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)

# (batch, tokens or None for 2-D x, in, N, out, K); the last case spans several tiles in every dimension
CASES = {
    "odd": (3, 5, 7, 11, 6, 4),
    "k_eq_n_2d": (4, None, 9, 5, 3, 5),
    "k1": (2, 3, 5, 13, 17, 1),
    "multi_tile": (2, 70, 67, 40, 130, 20),
}
# kernel vs an fp32 loop on the same (rounded) inputs, relative to the largest reference value
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _inputs(batch, tokens, n_in, n_rank, n_out, k, dtype, seed=0, repeats=False, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, n_in) if tokens is None else (batch, tokens, n_in)
    x = torch.randn(shape, generator=gen).to(dtype)
    A = (torch.randn(n_rank, n_in, generator=gen) / n_in**0.5).to(dtype)  # rank-major, passed transposed (PCLR)
    B = torch.randn(n_rank, n_out, generator=gen).to(dtype)
    if repeats:
        idx = torch.randint(0, n_rank, (batch, k), generator=gen)
    else:
        idx = torch.stack([torch.randperm(n_rank, generator=gen)[:k] for _ in range(batch)])
    gates = (torch.rand(batch, k, generator=gen) > 0.3).to(dtype)
    return [t.to(device) for t in (x, A, B, idx, gates)]


def _close(got, want, dtype):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * max(want.float().abs().max().item(), 1.0), f"max error {err:.3g}"


def _check_gather(fn, x, A, B, idx, gates, scale, dtype):
    """Forward and dx, dA, dB of ``fn`` against the fp32 loop oracle run on the same (rounded) inputs."""
    gen = torch.Generator().manual_seed(7)
    out_shape = (*x.shape[:-1], B.shape[1])
    w = torch.randn(out_shape, generator=gen).to(x.device)
    results = []
    for f, cast in ((fn, dtype), (rank_pool_gather_loop, torch.float32)):
        leaves = [t.to(cast).clone().requires_grad_(True) for t in (x, A, B)]
        g = None if gates is None else gates.to(cast)
        y = f(leaves[0], leaves[1].mT, leaves[2], idx, scale, g)
        (y.float() * w).sum().backward()
        results.append([y] + [t.grad for t in leaves])
    got, want = results
    assert got[0].dtype == dtype and got[0].shape == want[0].shape
    for name, a, b in zip(("y", "dx", "dA", "dB"), got, want):
        assert a.shape == b.shape, name
        _close(a, b, dtype)


# --- interpreter (subprocess) ---------------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_interp_rank_pool_matches_reference(case, dtype):
    x, A, B, idx, gates = _inputs(*CASES[case], dtype=dtype)
    _check_gather(triton_rank_pool.triton_rank_pool_gather, x, A, B, idx, gates, 0.7, dtype)
    _check_gather(triton_rank_pool.triton_rank_pool_gather, x, A, B, idx, None, 1.3, dtype)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interp_repeated_indices_accumulate(dtype):
    x, A, B, idx, gates = _inputs(4, 3, 6, 5, 4, 6, dtype=dtype, repeats=True, seed=1)
    idx[0] = torch.tensor([2, 2, 2, 0, 1, 1])  # one sample selects rank 2 three times
    idx[:, -1] = 4  # every sample selects rank 4: its dA/dB sum over all of them
    _check_gather(triton_rank_pool.triton_rank_pool_gather, x, A, B, idx, gates, 0.5, dtype)


@interp
def test_interp_dispatch_sends_gates_with_grad_and_empty_inputs_to_reference(monkeypatch):
    calls = []
    fused = triton_rank_pool.triton_rank_pool_gather
    spy = dispatch_module.RankPoolKernel("spy", lambda *a: calls.append(1) or fused(*a), lambda x: True)
    monkeypatch.setattr(dispatch_module, "_FAST_KERNEL", spy)
    x, A, B, idx, gates = _inputs(*CASES["odd"], dtype=torch.float32)
    torch.testing.assert_close(
        rank_pool_gather(x, A.mT, B, idx, 0.7, gates), rank_pool_gather_loop(x, A.mT, B, idx, 0.7, gates)
    )
    assert calls == [1]
    gates.requires_grad_(True)
    y = rank_pool_gather(x, A.mT, B, idx, 0.7, gates)
    y.sum().backward()
    assert gates.grad is not None and calls == [1]
    torch.testing.assert_close(y, rank_pool_gather_loop(x, A.mT, B, idx, 0.7, gates.detach()))
    assert rank_pool_gather(x[:0], A.mT, B, idx[:0], 0.7).shape == (0, *y.shape[1:]) and calls == [1]
    with pytest.raises(ValueError, match="gates that require a gradient"):
        fused(x, A.mT, B, idx, 0.7, gates)
    with pytest.raises(ValueError, match="non-empty"):
        fused(x[:0], A.mT, B, idx[:0], 0.7)


@interp
@pytest.mark.parametrize("batch,rows,cols", [(3, 37, 10), (1, 300, 32), (2, 5, 5)])
def test_interp_gram_and_matmul_small(batch, rows, cols):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, rows, cols, generator=gen)
    y = torch.randn(batch, rows, cols, generator=gen)
    m = torch.randn(batch, cols, cols, generator=gen)
    torch.testing.assert_close(triton_retraction.gram(x), x.mT @ x, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(triton_retraction.gram(x, y), x.mT @ y, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(triton_retraction.matmul_small(x, m), x @ m, atol=1e-4, rtol=1e-5)


@interp
@pytest.mark.parametrize("lr", [0.1, 1e-4, 0.0])
def test_interp_retraction_triton_matches_qr(lr):
    point, u = _retraction_problem(4, 50, 30, 5, lr)
    _check_retraction(retract(point, u, 0.99, method="triton"), retr(point, u, 0.99))


@pytest.mark.slow
def test_interpreter_suite():
    """Runs the ``interp`` tests above in a child with ``TRITON_INTERPRET=1``."""
    if INTERPRET:
        pytest.skip("already inside the interpreter run")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "interp_", __file__]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


# --- ahead-of-time compilation for sm_80 / sm_90, no GPU needed ---------------------------------------------------

_TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _compile_specs(dtype):
    """(kernel, pointer element types, constexprs) for every kernel, as the launchers call them."""
    t = _TL[dtype]
    precision = "ieee" if dtype == torch.float32 else "tf32"
    rank_pool = {"BLOCK_T": 64, "BLOCK_K": 64, "PRECISION": precision, "DOT_F32": False}
    specs = [
        (
            triton_rank_pool._shrink_kernel,
            {"x_ptr": t, "w_ptr": t, "idx_ptr": "i64", "gate_ptr": t, "h_ptr": "fp32"},
            {**rank_pool, "BLOCK_D": 64, "HAS_GATES": True},
        ),
        (
            triton_rank_pool._expand_kernel,
            {"h_ptr": "fp32", "w_ptr": t, "idx_ptr": "i64", "y_ptr": t},
            {**rank_pool, "BLOCK_O": 128},
        ),
        (
            triton_rank_pool._wgrad_kernel,
            {"p_ptr": "fp32", "q_ptr": t, "idx_ptr": "i64", "out_ptr": "fp32"},
            {**rank_pool, "BLOCK_C": 128},
        ),
    ]
    if dtype == torch.float32:
        square = {"BLOCK_M": 64, "BLOCK_C": 32, "PRECISION": "ieee"}
        specs += [
            (triton_retraction._gram_kernel, {"x_ptr": "fp32", "y_ptr": "fp32", "g_ptr": "fp32"}, square),
            (triton_retraction._matmul_small_kernel, {"x_ptr": "fp32", "m_ptr": "fp32", "o_ptr": "fp32"}, square),
        ]
    return specs


@pytest.mark.skipif(INTERPRET, reason="@triton.jit builds interpreted functions under TRITON_INTERPRET=1")
@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_compile_for_sm80_and_sm90(dtype, cc):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for kernel, pointers, constexprs in _compile_specs(dtype):
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in pointers:
                signature[name] = "*" + pointers[name]
            else:
                signature[name] = "fp32" if name == "scale" else "i32"
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32))
        assert len(compiled.asm["cubin"]) > 0, kernel.__name__
        assert f"sm_{cc}" in compiled.asm["ptx"], kernel.__name__


# --- CPU: the retraction algorithm and the dispatch -----------------------------------------------------------------


def _retraction_problem(batch, m, n, r, lr, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    A = torch.stack([random_point(m, n, r, generator=gen).A for _ in range(batch)])
    B = torch.stack([random_point(m, n, r, 0.3, generator=gen).B for _ in range(batch)])
    point = FixedRankPoint.from_factors(A.to(device), B.to(device))
    # a step of rank 2r, like an orthogonalized Riemannion direction
    U, V = torch.randn(batch, m, 2 * r, generator=gen), torch.randn(batch, n, 2 * r, generator=gen)
    return point, proju(point, U.to(device), V.to(device)) * lr


def _check_retraction(got, want, atol=2e-6):
    # factors are defined up to a rotation of the r-dimensional core: compare X = A B^T and A's orthonormality
    torch.testing.assert_close(got.A @ got.B.mT, want.A @ want.B.mT, atol=atol, rtol=1e-4)
    eye = torch.eye(got.A.shape[-1], device=got.A.device)
    torch.testing.assert_close(got.A.mT @ got.A, eye.expand_as(got.A.mT @ got.A), atol=1e-5, rtol=0)
    torch.testing.assert_close(got.B_R @ got.B_R.mT, want.B_R @ want.B_R.mT, atol=1e-4, rtol=0)


@pytest.mark.parametrize("lr", [0.1, 1e-4])
def test_cholqr2_retraction_matches_qr(lr):
    point, u = _retraction_problem(4, 50, 30, 5, lr)
    _check_retraction(retract(point, u, 0.99, method="cholqr2"), retr(point, u, 0.99))


def test_cholqr2_falls_back_on_degenerate_steps():
    point, u = _retraction_problem(3, 40, 20, 4, 0.1)
    u.A_dot[1] = 0  # a zero A_dot: its Gram matrix is singular, so that entry is redone with Householder QR
    u.B_dot[2, :, :2] = 0
    _check_retraction(retract(point, u, 1.0, method="cholqr2"), retr(point, u, 1.0))
    Q, R, ok = cholesky_qr2(u.A_dot)
    assert not ok[1] and ok[0] and torch.isfinite(Q).all() and torch.isfinite(R).all()


def test_batched_retraction_groups_by_shape_and_writes_in_place():
    gen = torch.Generator().manual_seed(3)
    adapters, wants = [], []
    for m, n in [(12, 8), (10, 8), (12, 8), (10, 8), (9, 6)]:
        p = random_point(m, n, 3, generator=gen)
        u = proju(p, torch.randn(m, 6, generator=gen), torch.randn(n, 6, generator=gen)) * 0.05
        wants.append(retr(p, u, 0.98))
        adapters.append((p.A.clone(), p.B.clone(), u.A_dot, u.B_dot))
    batched_retraction(adapters, x_scale=0.98, method="cholqr2")
    for (A, B, _, _), want in zip(adapters, wants):
        torch.testing.assert_close(A @ B.mT, want.A @ want.B.mT, atol=1e-6, rtol=1e-5)


def test_auto_on_cpu_is_the_reference(monkeypatch):
    point, u = _retraction_problem(2, 20, 10, 3, 0.1)
    assert choose_retraction(point.A) == "qr"
    got, want = retract(point, u, 0.9), retr(point, u, 0.9)
    assert torch.equal(got.A, want.A) and torch.equal(got.B, want.B)  # CPU Riemannion numbers are unchanged
    with pytest.raises(ValueError, match="method"):
        retract(point, u, method="svd")


def test_rank_pool_kernel_registers_lazily_and_leaves_cpu_on_torch(monkeypatch):
    monkeypatch.setattr(dispatch_module, "_FAST_KERNEL", None)
    monkeypatch.setattr(dispatch_module, "_AUTOLOAD_TRIED", False)
    x, A, B, idx, gates = _inputs(*CASES["odd"], dtype=torch.float32)
    y = rank_pool_gather(x, A.mT, B, idx, 0.7, gates)  # CPU: no import attempt, torch path
    assert dispatch_module._FAST_KERNEL is None and not dispatch_module._AUTOLOAD_TRIED
    torch.testing.assert_close(y, rank_pool_gather_loop(x, A.mT, B, idx, 0.7, gates))
    kernel = dispatch_module.load_rank_pool_kernel()
    assert kernel is not None and kernel.name == "triton" and not kernel.supports(x)


# --- GPU ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [*CASES, "pclr_like"])
def test_gpu_rank_pool_matches_reference(case, dtype):
    shape = (4, 128, 512, 256, 384, 64) if case == "pclr_like" else CASES[case]
    x, A, B, idx, gates = _inputs(*shape, dtype=dtype, device="cuda")
    _check_gather(triton_rank_pool.triton_rank_pool_gather, x, A, B, idx, gates, 0.25, dtype)
    idx[:, 0] = 3  # a rank shared by every sample
    _check_gather(triton_rank_pool.triton_rank_pool_gather, x, A, B, idx, None, 0.25, dtype)


@pytest.mark.gpu
@needs_cuda
def test_gpu_dispatch_uses_triton_then_torch_when_forced(monkeypatch):
    monkeypatch.setattr(dispatch_module, "_FAST_KERNEL", None)
    monkeypatch.setattr(dispatch_module, "_AUTOLOAD_TRIED", False)
    x, A, B, idx, gates = _inputs(*CASES["odd"], dtype=torch.float32, device="cuda")
    rank_pool_gather(x, A.mT, B, idx, 0.7, gates)
    assert dispatch_module._FAST_KERNEL is not None and dispatch_module._FAST_KERNEL.name == "triton"
    calls = []
    real = dispatch_module._FAST_KERNEL
    spy = dispatch_module.RankPoolKernel("spy", lambda *a: calls.append(1) or real.fn(*a), real.supports)
    monkeypatch.setattr(dispatch_module, "_FAST_KERNEL", spy)
    rank_pool_gather(x, A.mT, B, idx, 0.7, gates)
    monkeypatch.setenv(dispatch_module.KERNEL_ENV_VAR, "torch")
    rank_pool_gather(x, A.mT, B, idx, 0.7, gates)
    assert calls == [1]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lr", [0.1, 1e-4])
def test_gpu_retraction_triton_matches_qr(lr):
    point, u = _retraction_problem(8, 1024, 640, 16, lr, device="cuda")
    assert choose_retraction(point.A) == "triton"
    _check_retraction(retract(point, u, 0.99, method="triton"), retr(point, u, 0.99), atol=1e-5)
