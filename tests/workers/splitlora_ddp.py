"""Worker for ``test_splitlora_ddp.py``: two SplitLoRA tasks under DistributedDataParallel (gloo, CPU).

Run as ``torchrun --standalone --nproc_per_node=2 tests/workers/splitlora_ddp.py OUT_DIR``. Each rank trains on and
collects statistics from its own, differently sized shard; it saves what it chose (``k*``, ``A``, the running
statistics) and the exact inputs each adapted module saw, so the test can rebuild the global statistics.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import get_peft_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from peft_ext import SplitLoRAConfig
from peft_ext.tuners.splitlora import SplitLoRALayer

TASKS = 2
SHARD_ROWS = (37, 53)  # uneven shards: the all-reduced mean must be token-weighted, not an average of rank means


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.narrow = nn.Linear(16, 40)  # 16 <= dense_max_features: dense statistics
        self.wide = nn.Linear(40, 3)  # 40 > dense_max_features: frequent-directions sketch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(torch.tanh(self.narrow(x)))


CONFIG = dict(r=2, target_modules=["narrow", "wide"], trade_off=3.0, dense_max_features=20, sketch_rank=6)


def shard(task: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s data for ``task``: its own scale and direction mix, so the ranks' statistics differ."""
    g = torch.Generator().manual_seed(100 * task + rank)
    x = torch.randn(SHARD_ROWS[rank], 16, generator=g) * torch.linspace(3.0, 0.2, 16) * (1 + rank)
    x = x @ torch.linalg.qr(torch.randn(16, 16, generator=g)).Q
    y = torch.randn(SHARD_ROWS[rank], 3, generator=g)
    return x, y


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = get_peft_model(Net(), SplitLoRAConfig(**CONFIG))
    # SplitLoRA's buffers (A, the old delta, the running statistics) are identical on every rank by construction;
    # DDP's default would re-send them, covariances included, on every forward (torch < 2.13: broadcast_buffers).
    ddp = DistributedDataParallel(model, forward_sync_buffers=False)
    layers = {m._splitlora_seed_key: m for m in model.modules() if isinstance(m, SplitLoRALayer)}
    record = {"tasks": []}
    for task in range(TASKS):
        model.begin_task()
        x, y = shard(task, rank)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for _ in range(3):  # DDP averages B's gradients, so B stays identical on every rank
            loss = (ddp(x) - y).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        seen: dict[str, list[torch.Tensor]] = {key: [] for key in layers}
        handles = [
            layer.register_forward_pre_hook(lambda mod, args, rows=seen[key]: rows.append(args[0].detach().clone()))
            for key, layer in layers.items()
        ]
        with torch.no_grad(), model.collect_statistics():
            for chunk in x.split(10):  # a different number of batches per rank: no collective may run per forward
                model(chunk)
        for handle in handles:
            handle.remove()
        splits = model.end_task()
        record["tasks"].append(
            {
                "inputs": {key: torch.cat(rows) for key, rows in seen.items()},
                "splits": {key: (s.k_star, s.primary) for key, s in splits.items()},
                "A": {key: layer.splitlora_A["default"].clone() for key, layer in layers.items()},
                "covariance": {key: layer.covariance("default").clone() for key, layer in layers.items()},
                "tokens": {key: int(layer.splitlora_tokens["default"]) for key, layer in layers.items()},
                "error": {key: layer.statistics_error("default") for key, layer in layers.items()},
                "kind": {key: layer.statistics_kind("default") for key, layer in layers.items()},
            }
        )
    torch.save(record, out_dir / f"rank{rank}.pt")
    dist.barrier()
    del ddp  # tearing the group down under a live DDP reducer can hang gloo at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
