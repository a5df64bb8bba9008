"""SplitLoRA statistics at LLM scale: the Gram-based frequent-directions sketch (its certified error bound on
adversarial streams, through the tuner's task lifecycle) and the float32 end-of-task eigensolve, each against an
independent float64 reference."""

from __future__ import annotations

import math
import statistics
import time
from functools import partial

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_ext import SplitLoRAConfig
from peft_ext.tuners.splitlora import SplitLoRALayer, covariance
from peft_ext.tuners.splitlora.covariance import fd_append, fd_compress, fd_update
from peft_ext.tuners.splitlora.subspace import (
    choose_split,
    covariance_spectrum,
    minor_subspace_A,
    primary_dimension,
    sketch_spectrum,
)


def _decaying(rows: int, n: int, seed: int, power: float = 0.8, outliers: int = 0) -> torch.Tensor:
    """float64 tokens with a power-law spectrum (``sigma_i ~ i^-power``) in a random basis, plus ``outliers`` large
    channels (as in LLM inputs)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    sigma = torch.arange(1, n + 1, dtype=torch.float64) ** -power
    x = (torch.randn(rows, n, generator=g, dtype=torch.float64) * sigma) @ q.T
    x[:, :outliers] += 3 * torch.randn(rows, outliers, generator=g, dtype=torch.float64)
    return x


def _old_fd_update(sketch: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The earlier sketch, as the reference: a float64 thin SVD of sketch + every chunk of ``ell`` rows."""
    ell, total = sketch.shape[0], 0.0
    for start in range(0, rows.shape[0], ell):
        _, s, vh = torch.linalg.svd(torch.cat([sketch, rows[start : start + ell]]), full_matrices=False)
        sq = s.square()
        delta = float(sq[ell]) if sq.numel() > ell else 0.0
        sketch = (sq[:ell] - delta).clamp_min(0.0).sqrt()[:, None] * vh[:ell]
        total += delta
    return sketch, total


def _stream(data: torch.Tensor, ell: int, batch: int) -> tuple[torch.Tensor, float]:
    """What a layer does: append float32 batches to a (2 ell, n) buffer, compress it at the end of the task."""
    buffer, fill, total = torch.zeros(2 * ell, data.shape[1]), 0, 0.0
    for chunk in data.float().split(batch):
        fill, delta = fd_append(buffer, fill, chunk)
        total += delta
    sketch, delta = fd_compress(buffer, ell)
    return sketch, total + delta


def test_float32_sketch_is_certified_against_a_float64_covariance():
    n, ell = 96, 16
    data = _decaying(700, n, seed=7)
    truth = data.T @ data
    top = float(torch.linalg.eigvalsh(truth)[-1])
    sketch, total = _stream(data, ell, batch=37)
    sketch = sketch.double()
    gap = torch.linalg.eigvalsh(truth - sketch.T @ sketch)
    # float32 rounding of the Gram eigensolve: measured gap.max() 1.1e-5 * top *below* the bound; 1e-5 * top allowed
    tol = 1e-5 * top
    assert float(gap.min()) > -tol, "the sketch never overestimates"
    assert float(gap.max()) <= total + tol, "the accumulated shrinkage certifies the spectral error"
    assert float(gap.max()) > 0.5 * total, "the certificate is tight, not vacuous"
    # the frequent-directions guarantees: total <= (||A||_F^2 - ||B||_F^2) / l <= ||A - A_k||_F^2 / (l - k)
    assert total <= (float(data.square().sum()) - float(sketch.square().sum())) / ell + tol
    tail = torch.linalg.svdvals(data).square()
    for k in (0, 4, 8, 12):
        assert total <= float(tail[k:].sum()) / (ell - k) + tol, k

    # data of rank <= ell are kept exactly (up to float32 rounding), with no shrinkage
    g = torch.Generator().manual_seed(8)
    low = torch.randn(300, 6, generator=g, dtype=torch.float64) @ torch.randn(6, n, generator=g, dtype=torch.float64)
    sketch, total = _stream(low, 8, batch=50)
    truth = low.T @ low
    assert total < 1e-5 * float(truth.diagonal().sum())
    err = torch.linalg.matrix_norm(sketch.double().T @ sketch.double() - truth, 2)
    assert float(err) < 1e-5 * float(torch.linalg.matrix_norm(truth, 2))


def test_float32_sketch_has_the_spectrum_of_the_float64_svd_sketch():
    n, ell = 96, 16
    data = _decaying(700, n, seed=9)
    old, old_delta = _old_fd_update(torch.zeros(ell, n, dtype=torch.float64), data)
    new, new_delta = fd_update(torch.zeros(ell, n), data.float())  # the same chunks of ell rows, in float32
    old_sq = torch.linalg.svdvals(old).square()
    new_sq = torch.linalg.svdvals(new.double()).square()
    # measured: 6e-7 of the top eigenvalue (spectrum), 8e-7 (covariance); the certified delta is the shrinkage plus
    # the float32 rounding allowance of each of the 44 shrinks, 7e-5 relative here
    assert float((old_sq - new_sq).abs().max()) < 1e-5 * float(old_sq[0])
    assert 0 <= new_delta - old_delta < 2e-4 * old_delta
    err = torch.linalg.matrix_norm(old.T @ old - new.double().T @ new.double(), 2)
    assert float(err) < 1e-5 * float(old_sq[0])


def test_buffered_sketch_shrinks_once_per_ell_rows_whatever_the_batches(monkeypatch):
    n, ell = 40, 16
    data = _decaying(200, n, seed=10).float()
    calls = []
    original = covariance.fd_compress
    monkeypatch.setattr(covariance, "fd_compress", lambda *a: calls.append(1) or original(*a))
    buffers = []
    for batch in (5, 37, 200):
        buffer, fill = torch.zeros(2 * ell, n), 0
        for chunk in data.split(batch):
            fill, _ = fd_append(buffer, fill, chunk)
        buffers.append(buffer)
    # a full buffer is shrunk only when more rows arrive: after 2l rows, then every l rows: ceil((200 - 32) / 16)
    assert len(calls) == 3 * math.ceil((200 - 2 * ell) / ell)
    for other in buffers[1:]:
        assert torch.equal(other, buffers[0]), "the batch size does not change the sketch"
    with pytest.raises(ValueError, match=r"rows must have shape \(N, 40\)"):
        fd_append(torch.zeros(2 * ell, n), 0, torch.zeros(3, 41))


@pytest.mark.parametrize("n", [64, 256])
def test_float32_covariance_spectrum_keeps_the_split_and_minor_subspace(n):
    # n = 256 / 1024 / 2048 measured (docs/splitlora.md, "Cost at LLM scale"): same k*, largest principal angle
    # 3.5e-5 .. 1.1e-3 degrees; the tolerance is 1 degree
    data = _decaying(4 * n, n, seed=n, outliers=4)
    cov = (data.T @ data).float()  # the layer keeps float32 sums
    v64, u64, tr64 = covariance_spectrum(cov, torch.float64)
    v32, u32, tr32 = covariance_spectrum(cov)
    assert u32.dtype == v32.dtype == torch.float64 and tr32 == tr64  # the float64 interface of before
    for task, trade_off in ((0, 20.0), (2, 20.0), (0, 2.0)):
        k = choose_split(v64, task, trade_off, dim=n, total=tr64)
        assert choose_split(v32, task, trade_off, dim=n, total=tr32) == k
        p = primary_dimension(k, n)
        # principal angles between the minor subspaces equal those between their complements, the primary ones
        q32 = torch.linalg.qr(u32[:, :p].double()).Q
        sine = torch.linalg.matrix_norm(q32 - u64[:, :p] @ (u64[:, :p].T @ q32), 2)
        assert math.degrees(math.asin(min(float(sine), 1.0))) < 1.0, (task, trade_off)
        # the A the layer gets from the float32 basis is orthogonal to it to float64 precision
        a = minor_subspace_A(u32[:, :p], 4, 1.0, torch.Generator().manual_seed(0), torch.float64)
        assert float((a @ q32).norm()) < 1e-12


def test_float32_sketch_spectrum_keeps_the_split_and_primary_subspace():
    n, ell = 256, 32
    sketch, _ = _stream(_decaying(900, n, seed=11, outliers=3), ell, batch=64)
    trace = float(sketch.double().square().sum()) * 1.5  # the exact trace of the data exceeds the sketch's
    values, vectors, total = sketch_spectrum(sketch, trace)
    assert values.dtype == vectors.dtype == torch.float64 and vectors.shape == (n, ell) and total == trace
    _, s, vh = torch.linalg.svd(sketch.double(), full_matrices=False)  # the float64 SVD of before, as reference
    # measured 4e-7 of the top eigenvalue at n = 4096 and 14336 (docs/splitlora.md)
    assert float((values - s.square()).abs().max()) < 1e-5 * float(s[0] ** 2)
    for task, trade_off in ((0, 20.0), (0, 2.0)):
        k = choose_split(s.square(), task, trade_off, dim=n, total=trace)
        assert choose_split(values, task, trade_off, dim=n, total=total) == k
        p = primary_dimension(k, n)
        sine = torch.linalg.matrix_norm(vectors[:, :p] - vh[:p].T @ (vh[:p] @ vectors[:, :p]), 2)
        assert math.degrees(math.asin(min(float(sine), 1.0))) < 1.0, (task, trade_off)


# --- the certified bound, exactly: adversarial streams against a float64 reference ----------------------------------

WIDTH, ELL = 160, 24
STREAMS = ("heavy_tailed", "log_normal", "huge_then_tiny", "near_rank_deficient", "decaying")


def _adversarial(kind: str, rows: int, seed: int, n: int = WIDTH) -> torch.Tensor:
    """float64 rows whose norms vary widely or whose spectrum is nearly rank-deficient: the streams on which a
    float32 Gram's rounding error exceeded the shrinkage it certifies (by 1.2x on log-normal norms and 1e3x after a
    few huge rows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g, dtype=torch.float64)
    if kind == "heavy_tailed":  # Pareto row scales, tail index 1.2 (infinite variance)
        return x * torch.rand(rows, 1, generator=g, dtype=torch.float64).pow(-1 / 1.2)
    if kind == "log_normal":  # row norms spread over about 8 decades
        return x * torch.exp(3 * torch.randn(rows, 1, generator=g, dtype=torch.float64))
    if kind == "huge_then_tiny":
        x *= 1e-3
        x[:5] *= 1e5
        return x
    if kind == "near_rank_deficient":  # rank 20 < l plus noise far below it
        low = torch.randn(rows, 20, generator=g, dtype=torch.float64) @ torch.randn(20, n, generator=g).double()
        return low + 1e-5 * x
    return _decaying(rows, n, seed, power=1.0, outliers=3)


def _spectral_error(rows: torch.Tensor, sketch: torch.Tensor) -> tuple[float, float]:
    """``||X^T X - S^T S||_2`` in float64, and the float64 rounding of computing it (the reference's own)."""
    x, s = rows.to(torch.float64), sketch.to(torch.float64)
    gap = torch.linalg.eigvalsh(x.T @ x - s.T @ s)
    own = 4 * x.shape[1] * torch.finfo(torch.float64).eps * float(x.square().sum() + s.square().sum())
    return max(float(gap[-1]), -float(gap[0])), own


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", STREAMS)
def test_sketch_error_bound_holds_through_three_tasks(kind, dtype):
    """A layer's sketch (l = 24, width 160) after each of three tasks, against the exact covariance of the same rows
    (as the layer received them, float32 or bfloat16) in float64: the reported bound is never exceeded."""
    for seed in range(3):
        config = SplitLoRAConfig(r=2, target_modules=["lin"], statistics="sketch", sketch_rank=ELL)
        model = get_peft_model(_Probe().to(dtype), config)
        (layer,) = (m for m in model.modules() if isinstance(m, SplitLoRALayer))
        seen = []
        for task in range(3):
            data = _adversarial(kind, 300, seed=100 * seed + task).to(dtype)
            with torch.no_grad(), model.collect_statistics():
                for batch in data.split((7, 64, 100, 1, 128)):  # uneven batches: shrinks fall mid-batch
                    model(batch)
            model.end_task()
            seen.append(data)
            measured, own = _spectral_error(torch.cat(seen), layer.splitlora_sketch["default"])
            bound = float(layer.splitlora_sketch_error["default"])
            assert measured <= bound + own, f"{kind}, seed {seed}, task {task}: {measured:.6e} > {bound:.6e}"
            assert bound <= 2 * measured + 1e-6 * float(torch.cat(seen).double().square().sum()), "not vacuous"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", STREAMS)
def test_fd_compress_bound_holds_in_the_buffer_dtype_and_when_merging(kind, dtype):
    """The covariance functions on their own: streaming into a buffer of each dtype (a bfloat16 buffer keeps a bfloat16
    sketch, whose coarse rounding the bound must include) and merging two sketches as DDP does."""
    for seed in range(3):
        data = _adversarial(kind, 500, seed=seed).to(dtype)
        buffer, fill, total = torch.zeros(2 * ELL, WIDTH, dtype=dtype), 0, 0.0
        for chunk in data.split(37):
            fill, delta = fd_append(buffer, fill, chunk)
            total += delta
        sketch, delta = fd_compress(buffer, ELL)
        total += delta
        assert sketch.dtype == dtype
        measured, own = _spectral_error(data, sketch)
        assert measured <= total + own, f"{kind}, {dtype}, seed {seed}: {measured:.6e} > {total:.6e}"
        half_a, da = fd_update(torch.zeros(ELL, WIDTH, dtype=dtype), data[:250])
        half_b, db = fd_update(torch.zeros(ELL, WIDTH, dtype=dtype), data[250:])
        merged, dm = fd_compress(torch.cat([half_a, half_b]), ELL)
        measured, own = _spectral_error(data, merged)
        assert measured <= da + db + dm + own, f"merged, {kind}, {dtype}, seed {seed}"


def test_sketch_of_low_rank_data_reports_only_rounding():
    """Rank <= l: no shrinkage; the bound is the rounding allowance alone, and it still holds."""
    g = torch.Generator().manual_seed(5)
    data = (torch.randn(400, 6, generator=g) @ torch.randn(6, WIDTH, generator=g)).float()
    sketch, total = fd_update(torch.zeros(ELL, WIDTH), data)
    measured, own = _spectral_error(data, sketch)
    top = float(torch.linalg.matrix_norm(data.double(), 2)) ** 2
    assert measured <= total + own and total < 1e-5 * top


def test_spectra_reject_other_dtypes():
    with pytest.raises(TypeError, match=r"`dtype` must be torch.float32 or torch.float64, got torch.float16"):
        covariance_spectrum(torch.eye(3), torch.float16)
    with pytest.raises(TypeError, match=r"`dtype` must be torch.float32 or torch.float64, got torch.bfloat16"):
        sketch_spectrum(torch.eye(3), 3.0, torch.bfloat16)


# --- the measurements in docs/splitlora.md ("Cost at LLM scale"): python tests/test_splitlora_statistics.py ---------


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _per_batch_ms(n: int, ell: int, tokens: int) -> tuple[float, float, float]:
    """Median ms per batch of ``tokens`` rows: the dense update, the old FD (float64 SVD), the new FD."""
    g = torch.Generator().manual_seed(n)
    batches = [torch.randn(tokens, n, generator=g) * torch.logspace(0, -3, n) for _ in range(4)]
    turn = iter(range(10**9))
    cov = torch.zeros(n, n)
    dense = _median_ms(lambda: covariance.accumulate_covariance(cov, batches[next(turn) % 4]), 5)
    state = {"old": _old_fd_update(torch.zeros(ell, n, dtype=torch.float64), batches[0].double())[0]}

    def old() -> None:  # the old layer: a float64 copy of the batch, one SVD per chunk of ell rows
        state["old"] = _old_fd_update(state["old"], batches[next(turn) % 4].double())[0]

    buffer = torch.zeros(2 * ell, n)
    state["fill"] = fd_append(buffer, 0, torch.cat(batches[:2]))[0]  # full: every later batch costs one shrink

    def new() -> None:
        state["fill"] = fd_append(buffer, state["fill"], batches[next(turn) % 4])[0]

    return dense, _median_ms(old, 3), _median_ms(new, 5)


def _print_per_batch_cost(widths: tuple[int, ...] = (1024, 4096, 8192), ell: int = 256, tokens: int = 256) -> None:
    print("| in | dense update (ms) | old FD, float64 SVD (ms) | new FD, float32 Gram (ms) | new / dense |")
    print("|---|---:|---:|---:|---:|")
    for n in widths:
        dense, old_ms, new_ms = _per_batch_ms(n, ell, tokens)
        print(f"| {n} | {dense:.1f} | {old_ms:.1f} | {new_ms:.1f} | {new_ms / dense:.2f}x |", flush=True)


def _print_spectrum_accuracy(widths: tuple[int, ...] = (256, 1024, 2048)) -> None:
    print("| n | task t | a | k* float64 | k* float32 | largest principal angle (deg) |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in widths:
        data = _decaying(4 * n, n, seed=n, outliers=4)
        cov = (data.T @ data).float()
        v64, u64, total = covariance_spectrum(cov, torch.float64)
        v32, u32, _ = covariance_spectrum(cov)
        for task, trade_off in ((0, 20.0), (2, 20.0), (0, 2.0)):
            k64, k32 = (choose_split(v, task, trade_off, dim=n, total=total) for v in (v64, v32))
            p = primary_dimension(k64, n)
            q32 = torch.linalg.qr(u32[:, :p].double()).Q
            sine = float(torch.linalg.matrix_norm(q32 - u64[:, :p] @ (u64[:, :p].T @ q32), 2))
            angle = math.degrees(math.asin(min(sine, 1.0)))
            print(f"| {n} | {task} | {trade_off:g} | {k64} | {k32} | {angle:.1e} |", flush=True)


def _print_eigh_time(widths: tuple[int, ...] = (1024, 2048, 4096)) -> None:
    print("| n | eigh float64 (s) | eigh float32 (s) | float64 / float32 |")
    print("|---|---:|---:|---:|")
    for n in widths:
        x = torch.randn(n, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        cov = x @ x.T
        seconds = [
            _median_ms(partial(torch.linalg.eigh, cov.to(dtype)), 1) / 1e3 for dtype in (torch.float64, torch.float32)
        ]
        print(f"| {n} | {seconds[0]:.2f} | {seconds[1]:.2f} | {seconds[0] / seconds[1]:.1f}x |", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _print_per_batch_cost()
    _print_spectrum_accuracy()
    _print_eigh_time()


# --- token masks on flattened inputs and on encoder-decoders ------------------------------------------------------


def _masked_statistics(arch_name: str, batch: dict) -> tuple[dict[str, dict], dict[str, torch.Tensor], nn.Module]:
    """A SplitLoRA model of ``arch_name`` whose first task's statistics are ``batch`` (collected with no warning):
    ``task_state()``, the input each adapted module saw, and the model."""
    import warnings

    from .architectures import ARCHS

    arch = next(a for a in ARCHS if a.name == arch_name)
    model = get_peft_model(arch.model(), SplitLoRAConfig(r=2, target_modules="all-linear")).eval()
    inputs = {}
    for name, module in model.base_model.model.named_modules():
        if isinstance(module, SplitLoRALayer):
            module.register_forward_pre_hook(lambda m, args, name=name: inputs.setdefault(name, args[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "the token mask has shape ...": the mask was dropped
        with torch.no_grad(), model.collect_statistics():
            model(**batch)
    model.end_task()
    return model.task_state(), inputs, model


def _gram(model: nn.Module, key: str, tokens: int) -> torch.Tensor:
    return model.base_model.model.get_submodule(key).covariance("default") * tokens


def test_statistics_of_layers_fed_flattened_tokens_skip_padding():
    # OPT's MLP sees (batch x seq, d): the (batch, seq) mask is flattened the same way, not dropped
    ids = torch.randint(4, 96, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2], mask[2, :4] = 0, 0
    state, inputs, model = _masked_statistics("opt", {"input_ids": ids, "attention_mask": mask})
    for key in ("model.decoder.layers.0.fc1", "model.decoder.layers.0.fc2", "model.decoder.layers.0.self_attn.q_proj"):
        x = inputs[key].reshape(-1, inputs[key].shape[-1])
        real = x[mask.reshape(-1).bool()]
        assert state[key]["tokens"] == int(mask.sum()), key
        torch.testing.assert_close(_gram(model, key, state[key]["tokens"]), real.T @ real, atol=1e-4, rtol=1e-5)


def test_statistics_of_an_encoder_decoder_follow_each_stacks_mask():
    # T5 with as many decoder as encoder positions: the encoder's mask must not be applied to the decoder's tokens
    ids = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    labels = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    decoder_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    for extra, decoder_tokens in (({}, 10), ({"decoder_attention_mask": decoder_mask}, 9)):
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, **extra}
        state, inputs, model = _masked_statistics("t5", batch)
        tokens = {key: value["tokens"] for key, value in state.items()}
        assert (
            tokens["encoder.block.0.layer.0.SelfAttention.q"]
            == 8
            == tokens["encoder.block.1.layer.1.DenseReluDense.wi"]
        )
        assert tokens["decoder.block.0.layer.0.SelfAttention.q"] == decoder_tokens
        assert tokens["decoder.block.1.layer.2.DenseReluDense.wo"] == decoder_tokens
        assert tokens["decoder.block.0.layer.1.EncDecAttention.q"] == decoder_tokens
        # cross-attention keys and values read the encoder's output: its mask
        assert (
            tokens["decoder.block.0.layer.1.EncDecAttention.k"]
            == 8
            == tokens["decoder.block.1.layer.1.EncDecAttention.v"]
        )
        assert all(count > 0 for count in tokens.values())  # both stacks collect
        key = "decoder.block.0.layer.1.EncDecAttention.k"
        real = inputs[key][mask.bool()]
        torch.testing.assert_close(_gram(model, key, 8), real.T @ real, atol=1e-5, rtol=1e-5)
