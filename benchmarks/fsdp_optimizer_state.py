"""Optimizer state per rank under FSDP2 (``fully_shard``, 2 ranks, gloo on CPU) and Riemannion's gather cost.

1. Full fine-tuning of a tiny Llama (every attention and MLP projection projected; embeddings, norms and the LM head
   get AdamW inside the optimizer): optimizer-state bytes per rank for AdamW, DCT-AdamW and GaLore-AdamW, against one
   process holding the whole model. DCT-AdamW projects each rank's rows on the same DCT columns (the column scores
   are all-reduced), so its moments are split by rows like AdamW's. GaLore's projector is an SVD of the whole
   gradient matrix; on FSDP2 shards it either fails or would need the full matrix gathered every refresh: the table
   shows what happens when it is tried.
2. Riemannion (all projections adapted): the optimizer step gathers each adapter's factors and gradients
   (``(m + n) x r`` each) from the shards. Time per ``step()`` in one process and on 2 ranks, and the bytes the
   gathers move per step.

Usage (about a minute on a 2-core CPU; starts its own 2 processes, no torchrun needed)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_optimizer_state.py --json runs/benchmarks/fsdp_state.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peft_ext.distributed import local_part  # noqa: E402
from peft_ext.models import tiny_llama  # noqa: E402
from peft_ext.optim import DCTAdamW, create_riemannion_optimizer  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HIDDEN, LAYERS, VOCAB, RANK, STEPS = 256, 2, 512, 32, 6


def make_model() -> nn.Module:
    return tiny_llama(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, seed=0).train()


def batches(part: slice, n: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (8, 32), generator=g)[part] for _ in range(n)]


def shard(model: nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this process holds in optimizer state (a DTensor counts its local shard), GaLore's projector included."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                total += local_part(value).numel() * value.element_size()
            elif hasattr(value, "ortho_matrix") and torch.is_tensor(value.ortho_matrix):
                total += value.ortho_matrix.numel() * value.ortho_matrix.element_size()
    return total


def build_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "AdamW":
        return torch.optim.AdamW([p for _, p in named], lr=1e-3)
    if name == "DCT-AdamW":
        return DCTAdamW(named, lr=1e-3, rank=RANK, target_modules=PROJECTIONS)
    from galore_torch import GaLoreAdamW

    projected = [p for n, p in named if p.ndim == 2 and any(f".{t}." in f".{n}" for t in PROJECTIONS)]
    rest = [p for n, p in named if all(p is not q for q in projected)]
    groups = [{"params": rest}]
    groups.append({"params": projected, "rank": RANK, "update_proj_gap": 200, "scale": 1.0, "proj_type": "std"})
    return GaLoreAdamW(groups, lr=1e-3, no_deprecation_warning=True)


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def measure_state(name: str, part: slice, sharded: bool) -> dict[str, Any]:
    """Two full fine-tuning steps with ``name``; the optimizer-state bytes afterwards, or the error it raised."""
    model = make_model()
    if sharded:
        shard(model)
    try:
        optimizer = build_optimizer(name, model)
        for x in batches(part, 2):
            optimizer.zero_grad()
            lm_loss(model, x).backward()
            optimizer.step()
    except Exception as err:  # report what a user would see
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:140]}"}
    return {"bytes": state_bytes(optimizer), "projector": projector_layout(optimizer)}


def projector_layout(optimizer: torch.optim.Optimizer) -> str:
    """How GaLore's first projector is held: a replicated DTensor means every rank ran the SVD on the whole matrix,
    which DTensor all-gathered for it."""
    for state in optimizer.state.values():
        ortho = getattr(state.get("projector"), "ortho_matrix", None)
        if ortho is not None:
            placements = getattr(ortho, "placements", None)
            return f"{tuple(ortho.shape)} {placements}" if placements is not None else f"{tuple(ortho.shape)} whole"
    return ""


def measure_riemannion(part: slice, sharded: bool) -> dict[str, Any]:
    """Time per Riemannion ``step()`` (median over STEPS) and the bytes its gathers move per step."""
    from peft import get_peft_model

    from peft_ext import RiemannionConfig
    from peft_ext.tuners.riemannion import find_adapters

    model = get_peft_model(make_model(), RiemannionConfig(r=RANK // 2, target_modules=PROJECTIONS))
    if sharded:
        shard(model)
    optimizer = create_riemannion_optimizer(model, lr=1e-3)
    times = []
    for x in batches(part):
        optimizer.zero_grad()
        lm_loss(model, x).backward()
        if sharded:
            dist.barrier()
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    # per adapter the step gathers A, B and the gradients of Z and B whole; each process receives the other's rows
    refs = find_adapters(model)
    whole = sum(4 * (ref.A.numel() + ref.Z.numel() + 2 * ref.B.numel()) for ref in refs)
    world = dist.get_world_size() if sharded else 1
    return {
        "step_s": statistics.median(times[1:]),
        "gathered_bytes": whole * (world - 1) // world,
        "factor_bytes": whole,
        "adapters": len(refs),
    }


OPTIMIZERS = ("AdamW", "DCT-AdamW", "GaLore-AdamW")


def _worker(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    per = 8 // world
    part = slice(rank * per, (rank + 1) * per)
    result = {name: measure_state(name, part, sharded=True) for name in OPTIMIZERS}
    result["riemannion"] = measure_riemannion(part, sharded=True)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _fmt(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    one = {name: measure_state(name, slice(None), sharded=False) for name in OPTIMIZERS}
    one["riemannion"] = measure_riemannion(slice(None), sharded=False)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, str(Path(tmp) / "store"), tmp), nprocs=2, join=True)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(2)]

    print(f"tiny Llama: hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}; rank {RANK}; FSDP2, 2 ranks (gloo, CPU)\n")
    how = {
        "AdamW": "elementwise: each rank its rows",
        "DCT-AdamW": "DCT of each rank's own rows; only the column scores are all-reduced",
        "GaLore-AdamW": "SVD of the whole gradient: DTensor all-gathers it on every rank (projector {})",
    }
    print("| optimizer | 1 process | rank 0 | rank 1 | rank 0 / 1 process | subspace on shards |")
    print("|---|---:|---:|---:|---:|---|")
    for name in OPTIMIZERS:
        cells = [name, _fmt(one[name]["bytes"]) if "bytes" in one[name] else one[name]["error"]]
        if all("bytes" in r[name] for r in ranks):
            cells += [_fmt(r[name]["bytes"]) for r in ranks]
            cells.append(f"{ranks[0][name]['bytes'] / one[name]['bytes']:.2f}")
            cells.append(how[name].format(ranks[0][name].get("projector", "")))
        else:
            error = next(r[name]["error"] for r in ranks if "error" in r[name])
            cells += [f"fails: `{error}`", "", "", "needs the whole matrix (SVD)"]
        print("| " + " | ".join(cells) + " |")
    r1, r2 = one["riemannion"], ranks[0]["riemannion"]
    print(
        f"\nRiemannion step ({r1['adapters']} adapters, r = {RANK // 2}): whole factors + gradients "
        f"{_fmt(r2['factor_bytes'])}, gathered per rank per step {_fmt(r2['gathered_bytes'])}\n"
    )
    print("| | 1 process | 2 ranks (FSDP2) |")
    print("|---|---:|---:|")
    print(f"| `step()` time (median) | {r1['step_s'] * 1e3:.1f} ms | {r2['step_s'] * 1e3:.1f} ms |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"one_process": one, "ranks": ranks}, indent=2, default=str))


if __name__ == "__main__":
    main()
