"""Kernel benchmark: the rank-pool gather and the batched Riemannion retraction, fast path vs reference.

Run (CPU: small sizes by default, under a minute on 2 shared cores; CUDA: the issue's sizes)::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.kernel_speed            # CPU: torch references only
    python -m benchmarks.kernel_speed --device cuda                          # GPU: adds the Triton kernels

Prints two tables.

1. Rank-pool gather ``y[b] = scale * (x[b] A[:, S_b]) B[S_b, :]``, forward and forward+backward, for the per-sample
   loop, the gather-based (``indexed``) and masked-dense references and (CUDA) the Triton kernel. CUDA defaults: pool
   N=256, K=64, batch 32 x 512 tokens, width 4096, bf16. Speedup is against the reference ``rank_pool_gather``
   would pick without the kernel (:func:`peft_ext.kernels.choose_reference`). Bandwidth counts the bytes the
   forward must move at least: read ``x``, write ``y``, read each sample's K ranks of A and B once; fraction of the
   device's peak (from its name, or ``--peak-gbps``).
2. Retraction of every adapter of a Llama-3-8B-shaped model (32 layers x q/k/v/o/gate/up/down, r=16), grouped by
   shape, by :func:`peft_ext.kernels.batched_retraction` with each method, against a measured step-time estimate:
   32 x the forward+backward (input gradient only; base weights frozen) of one layer's seven projection matmuls on
   the benchmark's token batch. That excludes attention, norms and the rest of the optimizer, so it is a lower bound
   on the step time and the ratio is an upper bound. CPU defaults shrink widths by 8 and use 4 layers.

Targets on an H100/H200 (``--check`` prints PASS/FAIL): kernel speedup >= 3x, bandwidth >= 60% of peak, retraction
< 10% of the step estimate. docs/kernels.md records the figures.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from benchmarks._lib.cli import benchmark_parser
from benchmarks._lib.tables import markdown_table
from benchmarks._lib.timing import median_time
from peft_ext.kernels import (
    batched_retraction,
    choose_reference,
    rank_pool_gather_indexed,
    rank_pool_gather_loop,
    rank_pool_gather_masked,
)
from peft_ext.manifolds.fixed_rank import FixedRankPoint, proju

# HBM peak by device-name fragment, GB/s (vendor data sheets)
PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0}
PEAK_GBPS |= {"A100-SXM4-80GB": 2039.0, "A100 80GB PCIe": 1935.0, "A100": 1555.0, "L40S": 864.0, "A10G": 600.0}

# Llama-3-8B projections as (out, in): q, k, v, o, gate, up, down
LLAMA_8B = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]


def timeit(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in seconds (synchronized on CUDA)."""
    sync = partial(torch.cuda.synchronize, device) if device.type == "cuda" else None
    return median_time(fn, repeats, warmup=warmup, sync=sync)


def peak_gbps(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


def gather_table(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.batch, args.tokens, args.width, device=device, dtype=dtype, generator=gen)
    A = torch.randn(args.pool, args.width, device=device, dtype=dtype, generator=gen) / args.width**0.5
    B = torch.randn(args.pool, args.width, device=device, dtype=dtype, generator=gen) / args.pool**0.5
    idx = torch.argsort(torch.rand(args.batch, args.pool, device=device, generator=gen), dim=1)[:, : args.k]
    gates = torch.ones(args.batch, args.k, device=device, dtype=dtype)
    scale = 2.0 / args.k
    methods: dict[str, Callable] = {"loop": rank_pool_gather_loop}
    methods |= {"indexed": rank_pool_gather_indexed, "masked": rank_pool_gather_masked}
    if device.type == "cuda":
        from peft_ext.kernels.triton_rank_pool import triton_rank_pool_gather

        methods["triton"] = triton_rank_pool_gather
    reference = choose_reference(args.tokens, args.pool, args.k, args.width, args.width)
    itemsize = x.element_size()
    min_bytes = itemsize * (2 * x.numel() + args.batch * args.k * 2 * args.width)
    peak = peak_gbps(device, args.peak_gbps)

    xg, Ag, Bg = (t.clone().requires_grad_(True) for t in (x, A, B))
    dy = torch.randn_like(x)
    rows, results = [], {}
    for name, fn in methods.items():
        with torch.no_grad():
            fwd = timeit(lambda fn=fn: fn(x, A.mT, B, idx, scale, gates), device, args.repeats)

        def step(fn=fn):
            xg.grad = Ag.grad = Bg.grad = None
            fn(xg, Ag.mT, Bg, idx, scale, gates).backward(dy)

        fwd_bwd = timeit(step, device, args.repeats)
        results[name] = fwd
        results[name + "_fwd_bwd"] = fwd_bwd
        rows.append((name, fwd, fwd_bwd))
    ref_fwd, ref_both = results[reference], results[reference + "_fwd_bwd"]
    print(
        f"\nRank-pool gather on {device.type} ({_device_name(device)}), {args.dtype}: batch {args.batch} x "
        f"{args.tokens} tokens, width {args.width}, N={args.pool}, K={args.k}; reference = {reference} "
        f"(choose_reference); minimum forward traffic {min_bytes / 1e6:.1f} MB"
    )
    cells = []
    for name, fwd, both in rows:
        gbps = min_bytes / fwd / 1e9
        frac = f"{100 * gbps / peak:.0f}%" if peak else "n/a"
        cells.append(
            [name, f"{1e3 * fwd:.2f}", f"{1e3 * both:.2f}", f"{ref_fwd / fwd:.2f}x", f"{ref_both / both:.2f}x"]
            + [f"{gbps:.1f}", frac]
        )
    head = ["method", "fwd ms", "fwd+bwd ms", f"fwd speedup vs {reference}", "fwd+bwd speedup", "fwd GB/s"]
    print(markdown_table([*head, "% of peak"], cells, align="l" * 7))
    if "triton" in results:
        results["speedup"] = ref_fwd / results["triton"]
        results["speedup_fwd_bwd"] = ref_both / results["triton_fwd_bwd"]
        results["bandwidth_fraction"] = (min_bytes / results["triton"] / 1e9 / peak) if peak else float("nan")
    return results


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _adapters(args: argparse.Namespace, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator(device=device).manual_seed(1)
    out = []
    for _ in range(args.layers):
        for m, n in LLAMA_8B:
            m, n = m // args.shrink, n // args.shrink
            A = torch.linalg.qr(torch.randn(m, args.rank, device=device, generator=gen))[0]
            B = torch.randn(n, args.rank, device=device, generator=gen) * 0.01
            point = FixedRankPoint.from_factors(A, B)
            U = torch.randn(m, 2 * args.rank, device=device, generator=gen)
            V = torch.randn(n, 2 * args.rank, device=device, generator=gen)
            u = proju(point, U, V) * 1e-4
            out.append((A, B, u.A_dot, u.B_dot))
    return out


def retraction_table(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    adapters = _adapters(args, device)
    methods = ["qr", "cholqr2"] + (["triton"] if device.type == "cuda" else [])
    times = {}
    for method in methods:
        work = [(A.clone(), B.clone(), Ad, Bd) for A, B, Ad, Bd in adapters]
        times[method] = timeit(lambda work=work, method=method: batched_retraction(work, 0.999, method), device, 3, 1)

    dtype = getattr(torch, args.dtype)
    tokens = args.batch * args.tokens
    weights = [torch.randn(m // args.shrink, n // args.shrink, device=device, dtype=dtype) * 0.01 for m, n in LLAMA_8B]
    x = torch.randn(tokens, max(w.shape[1] for w in weights), device=device, dtype=dtype)
    dys = [torch.randn(tokens, w.shape[0], device=device, dtype=dtype) for w in weights]

    def layer() -> None:
        for w, dy in zip(weights, dys):
            x[:, : w.shape[1]] @ w.mT  # forward
            dy @ w  # input gradient (frozen base weight: no weight gradient)

    step = args.layers * timeit(layer, device, 3, 1)
    n_adapters = len(adapters)
    print(
        f"\nRetraction of {n_adapters} adapters (Llama-3-8B shapes / {args.shrink}, {args.layers} layers, "
        f"r={args.rank}, fp32) vs step estimate {1e3 * step:.1f} ms = {args.layers} x fwd+bwd of one layer's 7 "
        f"projections on {tokens} tokens ({args.dtype})"
    )
    cells = [[method, f"{1e3 * t:.2f}", f"{100 * t / step:.1f}%"] for method, t in times.items()]
    print(markdown_table(["method", "retraction ms", "% of step estimate"], cells, align="lll"))
    best = "triton" if "triton" in times else "qr"
    return {"retraction": times[best], "step": step, "retraction_fraction": times[best] / step}


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--pool", type=int, default=None, help="pool size N")
    parser.add_argument("--k", type=int, default=None, help="ranks per sample K")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--rank", type=int, default=16, help="Riemannion rank r")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the retraction model")
    parser.add_argument("--shrink", type=int, default=None, help="divide the Llama-8B widths by this")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--peak-gbps", type=float, default=None, help="device memory bandwidth peak, GB/s")
    parser.add_argument("--check", action="store_true", help="print PASS/FAIL against the issue's targets")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    defaults = {
        "batch": 32 if gpu else 8,
        "tokens": 512 if gpu else 64,
        "width": 4096 if gpu else 512,
        "pool": 256 if gpu else 64,
        "k": 64 if gpu else 16,
        "dtype": "bfloat16" if gpu else "float32",
        "layers": 32 if gpu else 4,
        "shrink": 1 if gpu else 8,
        "repeats": 20 if gpu else 3,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    start = time.perf_counter()
    gather = gather_table(args, device)
    retraction = retraction_table(args, device)
    print(f"\n(total {time.perf_counter() - start:.1f} s)")
    if args.check:
        if not gpu:
            print("CHECK skipped: the targets are for a CUDA device")
            return
        checks = [
            ("speedup >= 3x (forward, vs reference)", gather["speedup"], gather["speedup"] >= 3),
            ("bandwidth >= 60% of peak", gather["bandwidth_fraction"], gather["bandwidth_fraction"] >= 0.6),
            (
                "retraction < 10% of step estimate",
                retraction["retraction_fraction"],
                retraction["retraction_fraction"] < 0.1,
            ),
        ]
        for label, value, ok in checks:
            print(f"CHECK {'PASS' if ok else 'FAIL'}: {label}: {value:.3g}")


if __name__ == "__main__":
    main()
