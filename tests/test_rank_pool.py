"""The rank-pool gather references against the per-sample loop oracle: values, dtypes, repeats and gradients."""

from __future__ import annotations

import pytest
import torch

from peft_ext.kernels import (
    KERNEL_ENV_VAR,
    RankPoolKernel,
    rank_pool_gather,
    rank_pool_gather_stores,
    register_rank_pool_kernel,
)
from peft_ext.kernels.rank_pool import (
    choose_reference,
    rank_pool_gather_indexed,
    rank_pool_gather_loop,
    rank_pool_gather_masked,
    rank_pool_gather_shared,
)

VARIANTS = {"indexed": rank_pool_gather_indexed, "masked": rank_pool_gather_masked}


def _inputs(batch, tokens, n_in, n_rank, n_out, k, dtype=torch.float32, seed=0, repeats=False):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, n_in) if tokens is None else (batch, tokens, n_in)
    x = torch.randn(shape, generator=gen).to(dtype)
    A = torch.randn(n_in, n_rank, generator=gen).to(dtype)
    B = torch.randn(n_rank, n_out, generator=gen).to(dtype)
    if repeats:
        idx = torch.randint(0, n_rank, (batch, k), generator=gen)
    else:
        idx = torch.stack([torch.randperm(n_rank, generator=gen)[:k] for _ in range(batch)])
    return x, A, B, idx


def _naive(x, A, B, idx, scale, gates=None):
    """Independent of the module: a double loop over samples and selected ranks, rank-1 terms in float64."""
    x3 = x.double() if x.dim() == 3 else x.double().unsqueeze(1)
    out = torch.zeros(x3.shape[0], x3.shape[1], B.shape[1], dtype=torch.float64)
    for b in range(x3.shape[0]):
        for j, i in enumerate(idx[b].tolist()):
            g = 1.0 if gates is None else float(gates[b, j])
            out[b] += g * scale * torch.outer(x3[b] @ A[:, i].double(), B[i].double())
    return out if x.dim() == 3 else out.squeeze(1)


@pytest.mark.parametrize(
    "batch,tokens,n_in,n_rank,n_out,k",
    [(3, 5, 7, 11, 6, 4), (4, None, 9, 5, 3, 5), (2, 3, 5, 13, 17, 1), (5, 1, 1, 3, 1, 2)],
    ids=["odd", "k_eq_n_2d", "k1", "width1"],
)
@pytest.mark.parametrize("variant", ["indexed", "masked", "loop", "auto"])
def test_matches_naive(variant, batch, tokens, n_in, n_rank, n_out, k):
    x, A, B, idx = _inputs(batch, tokens, n_in, n_rank, n_out, k)
    y = rank_pool_gather(x, A, B, idx, 0.7, method=variant)
    torch.testing.assert_close(y.double(), _naive(x, A, B, idx, 0.7), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["indexed", "masked"])
def test_repeated_indices_and_gates(variant):
    x, A, B, idx = _inputs(4, 3, 6, 5, 4, 6, repeats=True, seed=1)
    idx[0] = torch.tensor([2, 2, 2, 0, 1, 1])  # a rank selected three times counts three times
    gates = (torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) > 0.4).float()
    y = VARIANTS[variant](x, A, B, idx, 0.5, gates)
    torch.testing.assert_close(y.double(), _naive(x, A, B, idx, 0.5, gates), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y, rank_pool_gather_loop(x, A, B, idx, 0.5, gates), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["indexed", "masked"])
def test_bf16_close_to_fp32(variant):
    x, A, B, idx = _inputs(3, 4, 16, 12, 8, 5)
    ref = rank_pool_gather_loop(x, A, B, idx, 0.25)
    y = VARIANTS[variant](x.bfloat16(), A.bfloat16(), B.bfloat16(), idx, 0.25)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=0.15, rtol=0.05)


@pytest.mark.parametrize("variant", ["indexed", "masked"])
def test_gradients_accumulate_over_shared_ranks(variant):
    x, A, B, idx = _inputs(4, 3, 6, 7, 5, 3, seed=3)
    idx[:, 0] = 4  # every sample uses rank 4: its dA/dB column/row must sum over all of them
    idx[1, 1] = 4
    grads = []
    for fn in (VARIANTS[variant], rank_pool_gather_loop):
        leaves = [t.clone().requires_grad_(True) for t in (x, A, B)]
        w = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(9))
        (fn(*leaves, idx, 1.3) * w).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # unselected ranks get exactly zero gradient
    unused = sorted(set(range(7)) - set(idx.flatten().tolist()))
    assert unused and grads[0][1][:, unused].abs().max() == 0 and grads[0][2][unused].abs().max() == 0
    # analytic check of one column: dL/dA[:, 4] = scale * sum_b sum_occurrences x_b^T (g_b B[4]^T)
    assert grads[0][1][:, 4].abs().sum() > 0


@pytest.mark.parametrize("tokens", [None, 4])
def test_shared_index_set_equals_the_gather_with_it_repeated_values_and_gradients(tokens):
    # every sample selects the same ranks (PCLR routing a batch as one stored task), a repeat and a zero gate included
    x, A, B, _ = _inputs(5, tokens, 6, 7, 4, 3, seed=4)
    index, gate = torch.tensor([4, 1, 4]), torch.tensor([1.0, 0.0, 1.0])
    repeated, gates = index.expand(5, -1), gate.expand(5, -1)
    results = []
    for fn, args in ((rank_pool_gather_shared, (index, 0.6, gate)), (rank_pool_gather, (repeated, 0.6, gates))):
        leaves = [t.clone().requires_grad_(True) for t in (x, A, B)]
        y = fn(*leaves, *args)
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
        results.append([y.detach(), *(t.grad for t in leaves)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[0][0].double(), _naive(x, A, B, repeated, 0.6, gates), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"`index` must be \(K,\)"):
        rank_pool_gather_shared(x, A, B, repeated, 0.6)


@pytest.mark.parametrize(
    "tokens,n_rank,frozen,k,scale",
    [(6, 9, 5, 4, 0.6), (None, 40, 30, 3, 1.0), (6, 9, 0, 4, 1.0), (6, 9, 9, 2, 0.6), (1, 9, 5, 4, 1.0)],
    ids=["both", "rows", "no_frozen", "no_trainable", "masked_path"],
)
def test_two_stores_equal_the_gather_over_their_concatenation(tokens, n_rank, frozen, k, scale):
    # PCLR's pool: frozen ranks (no gradient) first, trainable ones after; repeats and a zero gate included. The
    # gathered path runs but for masked_path (one token, a small pool: the cost model's masked reference)
    x, A, B, idx = _inputs(4, tokens, 6, n_rank, 5, k, seed=6, repeats=True)
    gates = torch.ones(idx.shape)
    gates[1, 0] = 0.0
    probe = torch.randn(4, *([tokens] if tokens else []), 5, generator=torch.Generator().manual_seed(7))
    results = []
    for two_stores in (True, False):
        x_, A_t, B_t = (t.clone().requires_grad_(True) for t in (x, A.mT[frozen:], B[frozen:]))
        if two_stores:
            y = rank_pool_gather_stores(x_, (A.mT[:frozen], B[:frozen]), (A_t, B_t), idx, scale, gates)
        else:
            y = rank_pool_gather(
                x_, torch.cat([A.mT[:frozen], A_t]).mT, torch.cat([B[:frozen], B_t]), idx, scale, gates
            )
        (y * probe).sum().backward()
        results.append([y.detach(), x_.grad, A_t.grad, B_t.grad])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(results[0][0].double(), _naive(x, A, B, idx, scale, gates), atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # no graph: the same values
        y = rank_pool_gather_stores(x, (A.mT[:frozen], B[:frozen]), (A.mT[frozen:], B[frozen:]), idx, scale, gates)
    torch.testing.assert_close(y, results[0][0], atol=0, rtol=0)
    with pytest.raises(ValueError, match="the stores do not fit together"):
        rank_pool_gather_stores(x, (A.mT[:frozen, :-1], B[:frozen]), (A.mT[frozen:], B[frozen:]), idx, scale)


def test_choose_reference_by_pool_size_and_k():
    assert choose_reference(tokens=32, n_ranks=8, k=8, width_in=64, width_out=64) == "masked"
    assert choose_reference(tokens=32, n_ranks=256, k=8, width_in=64, width_out=64) == "indexed"
    # single-token rows: copying K ranks per sample outweighs a dense pass over a small pool
    assert choose_reference(tokens=1, n_ranks=16, k=8, width_in=64, width_out=64) == "masked"


def test_dispatch_env_var_and_registered_kernel(monkeypatch):
    x, A, B, idx = _inputs(2, 3, 4, 6, 5, 2)
    calls = []

    def fake(*args):
        calls.append(1)
        return rank_pool_gather_indexed(*args)

    register_rank_pool_kernel(RankPoolKernel("fake", fake, supports=lambda t: True))
    try:
        monkeypatch.setenv(KERNEL_ENV_VAR, "torch")
        rank_pool_gather(x, A, B, idx, 1.0)
        assert calls == []
        monkeypatch.setenv(KERNEL_ENV_VAR, "triton")
        rank_pool_gather(x, A, B, idx, 1.0)
        assert calls == [1]
        register_rank_pool_kernel(RankPoolKernel("cuda-only", fake, supports=lambda t: t.is_cuda))
        y = rank_pool_gather(x, A, B, idx, 1.0)  # falls back to torch on CPU without an error
        assert calls == [1]
        torch.testing.assert_close(y, rank_pool_gather_loop(x, A, B, idx, 1.0))
        # the two-store entry point (PCLR's) hands a usable fast kernel the concatenated pool
        register_rank_pool_kernel(RankPoolKernel("fake", fake, supports=lambda t: True))
        y = rank_pool_gather_stores(x, (A.mT[:4], B[:4]), (A.mT[4:], B[4:]), idx, 1.0)
        assert calls == [1, 1]
        torch.testing.assert_close(y, rank_pool_gather_loop(x, A, B, idx, 1.0))
        monkeypatch.setenv(KERNEL_ENV_VAR, "cuda")
        with pytest.raises(ValueError, match="PEFT_EXT_KERNELS"):
            rank_pool_gather(x, A, B, idx, 1.0)
    finally:
        register_rank_pool_kernel(None)


def test_errors_name_the_value():
    x, A, B, idx = _inputs(2, 3, 4, 6, 5, 2)
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        rank_pool_gather(x, A, B, idx + 5, 1.0)
    with pytest.raises(ValueError, match="width"):
        rank_pool_gather(x[..., :3], A, B, idx, 1.0)
    with pytest.raises(TypeError, match="int64"):
        rank_pool_gather(x, A, B, idx.float(), 1.0)
    with pytest.raises(ValueError, match="method"):
        rank_pool_gather(x, A, B, idx, 1.0, method="fast")


# -- float64 gradcheck with the routing held fixed (indices and 0/1 gates are constants of the gather) ----------------


@pytest.mark.parametrize("tokens,gated", [(6, False), (6, True), (None, True)], ids=["tokens", "gated", "rows"])
def test_two_store_gather_backward_passes_gradcheck(tokens, gated):
    # the hand-written backward of the one-node path (_StoresGather): x and the trainable store against finite
    # differences in float64, repeats in the indices (a rank selected twice sums its two slots' gradients)
    n_rank = 14 if tokens else 40  # one token per sample: the cost model takes the masked reference below ~30 ranks
    x, A, B, idx = _inputs(3, tokens, 5, n_rank, 4, 5, dtype=torch.float64, seed=11, repeats=True)
    assert choose_reference(tokens or 1, n_rank, 5, 5, 4) == "indexed"
    gates = None
    if gated:
        gates = torch.ones(idx.shape, dtype=torch.float64)
        gates[0, 1] = gates[2, 4] = 0.0
    frozen = (A.mT[:6].contiguous(), B[:6].contiguous())
    x_, A_t, B_t = (t.clone().requires_grad_(True) for t in (x, A.mT[6:].contiguous(), B[6:].contiguous()))
    y = rank_pool_gather_stores(x_, frozen, (A_t, B_t), idx, 0.7, gates)
    node = y.grad_fn if tokens else y.grad_fn.next_functions[0][0]  # (batch, in) inputs: squeezed after the node
    assert type(node).__name__.startswith("_StoresGather"), node  # the hand-written node, not a recorded graph

    def gather(x_, A_t, B_t):
        return rank_pool_gather_stores(x_, frozen, (A_t, B_t), idx, 0.7, gates)

    assert torch.autograd.gradcheck(gather, (x_, A_t, B_t), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("variant", ["indexed", "masked"])
@pytest.mark.parametrize("tokens", [4, None])
def test_reference_gathers_pass_gradcheck(variant, tokens):
    # the torch references (what every path but the one-node gather and the fused kernels runs), all three inputs
    x, A, B, idx = _inputs(3, tokens, 5, 9, 4, 4, dtype=torch.float64, seed=12, repeats=True)
    gates = torch.ones(idx.shape, dtype=torch.float64)
    gates[1, 2] = 0.0
    inputs = tuple(t.clone().requires_grad_(True) for t in (x, A, B))
    assert torch.autograd.gradcheck(
        lambda x_, A_, B_: VARIANTS[variant](x_, A_, B_, idx, 1.3, gates), inputs, eps=1e-6, atol=1e-7, rtol=1e-5
    )
