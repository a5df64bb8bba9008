"""Worker of tests/test_dct_ddp.py: run by ``torchrun --nproc_per_node 2`` (gloo, CPU); writes ``rank{R}.pt``.

1. DDP: a small MLP trained with DCT-AdamW (rank 4, refresh every step, error feedback), each rank on its own half
   of every batch. Records every refreshed selection and the final parameters.
2. Index sync without DDP: each rank feeds a *different* gradient to a bare parameter, once with ``sync_indices``
   left to auto (on, since the process group is up) and once with it off.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from peft_ext.optim.dct import dct_matrix, dct_select
from peft_ext.optim.dct_adamw import DCTAdamW

STEPS, BATCH = 8, 16
OPTIONS = {"lr": 1e-2, "rank": 4, "error_feedback": True, "target_modules": ["0", "2"]}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 3))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, BATCH, 24, generator=gen), torch.randint(0, 3, (STEPS, BATCH), generator=gen)


def train(model: nn.Module, shard: slice) -> list[dict[str, list[int]]]:
    """Train on ``shard`` of every batch; return the selected indices of each projected matrix after each step."""
    opt = DCTAdamW(model.named_parameters(), **OPTIONS)
    names = {p: n.removeprefix("module.") for n, p in model.named_parameters()}
    xs, ys = make_data()
    history = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
        opt.step()
        history.append({names[p]: s["indices"].tolist() for p, s in opt.state.items() if "indices" in s})
    return history


def gradient_for(rank: int) -> torch.Tensor:
    """A 32 x 16 gradient whose DCT energy is on columns {1, 2, 3} (rank 0) or {7, 8, 9} (rank 1)."""
    coeffs = torch.zeros(32, 16)
    coeffs[:, [1, 2, 3] if rank == 0 else [7, 8, 9]] = 1.0
    return coeffs @ dct_matrix(16)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = BATCH // world
    model = DistributedDataParallel(make_model())
    history = train(model, slice(rank * per_rank, (rank + 1) * per_rank))

    synced = {}
    for label, flag in (("auto", None), ("off", False)):
        p = nn.Parameter(torch.zeros(32, 16))
        opt = DCTAdamW([p], lr=1e-2, rank=3, sync_indices=flag)
        p.grad = gradient_for(rank)
        opt.step()
        synced[label] = opt.state[p]["indices"].tolist()
    local = dct_select(gradient_for(rank), 3)[0].tolist()

    torch.save(
        {
            "world": world,
            "history": history,
            "params": {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()},
            "synced": synced,
            "local": local,
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
