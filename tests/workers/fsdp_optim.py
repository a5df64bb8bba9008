"""Worker of tests/test_fsdp_optim.py: the Riemannion and DCT-AdamW optimizers on FSDP2 shards (gloo, CPU).

Run as ``torchrun --standalone --nproc_per_node=2 tests/workers/fsdp_optim.py OUT_DIR``; every rank writes
``rank{R}.pt``. Each case is a function ``case(part, shard)``: ``shard=True`` puts the model under
``fully_shard`` on a 2-process CPU mesh and trains on this rank's half (``part``) of every global batch; the test
runs the same function in one process with ``part=slice(None)``, ``shard=False`` and compares. FSDP2 averages the
gradients over the processes, so with equal halves both see the gradient of the whole batch.

Cases: Riemannion adapters (LOI after sharding, then the Riemannion optimizer) on a tiny Llama; LoRA with an uneven
row count (r = 5) + DCT-AdamW; DCT-AdamW on a plain MLP whose first weight has 45 rows (23 + 22 per rank). The
optimizer steps are split in two halves with a save / load of every rank's own state in between (a fresh model and
optimizer continue), so the comparison also covers an exact resume.

Also: the Riemannion run again with the per-tensor reference of the step's bucketed gather and write-back (must be
equal bit for bit), ``full_tensors`` / ``write_full_tensors_`` against ``full_tensor`` / ``write_full_`` on padded
shards, and the collectives of a Riemannion step for 1 and for 14 adapters (``count_collectives``).
"""

from __future__ import annotations

import io
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn

from peft_ext import RiemannionConfig
from peft_ext.distributed import (
    count_collectives,
    full_tensor,
    full_tensors,
    is_dtensor,
    local_part,
    write_full_,
    write_full_tensors_,
)
from peft_ext.models import tiny_llama
from peft_ext.optim import DCTAdamW, create_riemannion_optimizer
from peft_ext.tuners.riemannion import find_adapters, initialize_loi

STEPS, ROWS, SEQ, VOCAB = 4, 8, 8, 128  # ROWS: the global batch; each of 2 ranks gets ROWS // 2


def tokens(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(n)]


def shard_model(model: nn.Module, blocks: list[nn.Module]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this process's optimizer-state tensors."""
    return sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )


def reload(optimizer: torch.optim.Optimizer) -> dict:
    """This rank's optimizer state, saved and loaded back as a checkpoint would be (weights_only)."""
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def train_resumed(
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]],
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    batches: list[Any],
    resume: bool = True,
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """Half the steps, save this rank's parameters (its shards) and optimizer state, build afresh, load, finish
    (``resume=False``: the same steps without the save / load).

    Returns the resumed model and optimizer and the optimizer-state bytes after the first half."""
    model, optimizer = build()
    half = len(batches) // 2

    def steps(model: nn.Module, optimizer: torch.optim.Optimizer, xs: list[Any]) -> None:
        for x in xs:
            optimizer.zero_grad()
            loss_of(model, x).backward()
            optimizer.step()

    steps(model, optimizer, batches[:half])
    saved_params = {n: local_part(p).detach().clone() for n, p in model.named_parameters()}
    saved_buffers = {n: b.clone() for n, b in model.named_buffers()}
    saved_state, state_bytes = reload(optimizer), moment_bytes(optimizer)
    if not resume:
        steps(model, optimizer, batches[half:])
        return model, optimizer, state_bytes
    model, optimizer = build()
    with torch.no_grad():
        for n, p in model.named_parameters():
            local_part(p).copy_(saved_params[n])
        for n, b in model.named_buffers():
            b.copy_(saved_buffers[n])
    optimizer.load_state_dict(saved_state)
    steps(model, optimizer, batches[half:])
    return model, optimizer, state_bytes


def whole_state(model: nn.Module, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters() if keep(n)}


def riemannion(part: slice, shard: bool, resume: bool = True) -> dict:
    """LOI (after sharding) and Riemannion steps on a tiny Llama, every attention and MLP projection adapted."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = get_peft_model(tiny_llama(), RiemannionConfig(r=2, target_modules=targets))
        if shard:
            shard_model(model, list(model.base_model.model.model.layers))
        initialize_loi(model, [{"input_ids": x[part], "labels": x[part]} for x in tokens(1, 2)])
        return model, create_riemannion_optimizer(model, lr=0.05)

    def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x[part], labels=x[part]).loss

    model, optimizer, state_bytes = train_resumed(build, loss_of, tokens(2, STEPS), resume)
    with torch.no_grad():
        points = {
            ref.layer_name: full_tensor(ref.A.detach()) @ full_tensor(ref.B.detach()).mT
            for ref in find_adapters(model)
        }
        logits = model(input_ids=tokens(99, 1)[0][:2]).logits  # every rank the same 2 rows
    contiguous = all(local_part(p).is_contiguous() for p in model.parameters())
    return {"points": points, "logits": logits, "contiguous": contiguous, "state_bytes": state_bytes}


def lora_dct(part: slice, shard: bool) -> dict:
    """LoRA (r = 5: A has 5 rows, 3 + 2 per rank) on a tiny Llama, trained with DCT-AdamW."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        config = LoraConfig(r=5, lora_alpha=10, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
        model = get_peft_model(tiny_llama(), config)
        if shard:
            shard_model(model, list(model.base_model.model.model.layers))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # one process chooses the right projection itself; an FSDP2 shard gets it from side="auto"
        side = "auto" if shard else "right"
        return model, DCTAdamW(named, lr=1e-2, rank=4, error_feedback=True, side=side)

    def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x[part], labels=x[part]).loss

    model, optimizer, state_bytes = train_resumed(build, loss_of, tokens(3, STEPS))
    indices = {n: optimizer.state[p]["indices"].tolist() for n, p in model.named_parameters() if p in optimizer.state}
    return {"state": whole_state(model, lambda n: "lora_" in n), "indices": indices, "state_bytes": state_bytes}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 45), nn.Tanh(), nn.Linear(45, 16), nn.Tanh(), nn.Linear(16, 3))


def full_dct(part: slice, shard: bool, resume: bool = True, **extra: Any) -> dict:
    """DCT-AdamW on a plain MLP (no PEFT): weights of 45 (uneven: 23 + 22) and 16 rows projected, the rest AdamW.
    ``extra``: more optimizer options (the power-iteration basis and APOLLO's channel update)."""
    gen = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(STEPS, 16, 24, generator=gen), torch.randint(0, 3, (STEPS, 16), generator=gen)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp()
        if shard:
            shard_model(model, [model[0], model[2]])
        # the 16 x 45 weight is wider than tall: "auto" projects it from the left in one process
        options = {"lr": 1e-2, "rank": 6, "target_modules": ["0", "2"], "side": "auto" if shard else "right"}
        return model, DCTAdamW(model.named_parameters(), **options, **extra)

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        # the 16 rows split 8 + 8; ``part`` is in units of the global batch of ROWS = 8, so scale it
        rows = slice(None) if part == slice(None) else slice(2 * part.start, 2 * part.stop)
        return F.cross_entropy(model(xs[step][rows]), ys[step][rows])

    model, optimizer, state_bytes = train_resumed(build, loss_of, list(range(STEPS)), resume)
    first = model[0].weight
    projected = optimizer.state[first]
    return {
        "state": whole_state(model, lambda n: True),
        "indices": projected["indices"].tolist() if "indices" in projected else projected["basis"].tolist(),
        "state_bytes": state_bytes,
        "first_moment_rows": projected["exp_avg"].shape[0],
    }


def full_power_channel(part: slice, shard: bool, resume: bool = True) -> dict:
    """``full_dct`` with the power-iteration basis (refreshed every 2 steps: the ``G^T G B`` sum over row shards)
    and APOLLO's channel-scaled update with its norm-growth limiter (a norm over row shards)."""
    return full_dct(part, shard, resume, basis="power", update="channel", update_proj_gap=2)


CASES = {
    "riemannion": riemannion,
    "lora_dct": lora_dct,
    "full_dct": full_dct,
    "full_power_channel": full_power_channel,
}


def nonfinite_on_one_rank(rank: int) -> dict:
    """A NaN in rank 1's rows of one gradient: with ``skip`` every rank must skip the step (or all would diverge)."""
    skipped = {}
    model = mlp()
    shard_model(model, [model[0], model[2]])
    dct = DCTAdamW(model.named_parameters(), lr=1e-2, rank=4, nonfinite="skip")
    peft_model = get_peft_model(tiny_llama(num_layers=1), RiemannionConfig(r=2, target_modules=["q_proj"]))
    shard_model(peft_model, list(peft_model.base_model.model.model.layers))
    riem = create_riemannion_optimizer(peft_model, lr=0.05, nonfinite="skip")
    for label, net, optimizer, loss in (
        ("dct", model, dct, lambda: model(torch.randn(4, 24)).sum()),
        ("riemannion", peft_model, riem, lambda: peft_model(input_ids=tokens(0, 1)[0], labels=tokens(0, 1)[0]).loss),
    ):
        before = [local_part(p).detach().clone() for p in net.parameters()]
        loss().backward()
        if rank == 1:
            grad = next(local_part(p.grad) for p in net.parameters() if p.grad is not None and p.ndim == 2)
            grad.view(-1)[0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer.step()
        unchanged = all(torch.equal(local_part(p).detach(), b) for p, b in zip(net.parameters(), before))
        skipped[label] = {"unchanged": unchanged, "skipped": int(optimizer.skipped_steps)}
    return skipped


@contextmanager
def per_tensor_gathers() -> Iterator[None]:
    """Riemannion's step with the per-tensor reference of its bucketed gather and write-back: ``full_tensor`` and
    ``write_full_`` of each tensor, as the step did before ``full_tensors`` / ``write_full_tensors_``."""
    from peft_ext.optim import riemannion as module

    def write(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        for t, value in zip(tensors, values):
            write_full_(t, value)

    saved = module.full_tensors, module.write_full_tensors_
    module.full_tensors, module.write_full_tensors_ = (lambda ts: [full_tensor(t) for t in ts]), write
    try:
        yield
    finally:
        module.full_tensors, module.write_full_tensors_ = saved


def bucketed_gather() -> dict:
    """``full_tensors`` / ``write_full_tensors_`` against the per-tensor ``full_tensor`` / ``write_full_`` on shards
    that FSDP2 pads: uneven rows (45 = 23 + 22), a one-row tensor (rank 1 holds nothing), no rows, a 3-D tensor and
    mixed dtypes, next to a replicated DTensor and a plain tensor; and the collectives of one gather."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(7)
    wholes = [
        torch.randn(45, 3, generator=g),
        torch.randn(1, 4, generator=g).bfloat16(),
        torch.randn(5, generator=g).double(),
        torch.randn(0, 3, generator=g),
        torch.randn(7, 2, 3, generator=g).half(),
    ]
    tensors = [distribute_tensor(w, mesh, [Shard(0)]) for w in wholes]
    tensors += [distribute_tensor(wholes[0], mesh, [Replicate()]), torch.randn(3, 3, generator=g)]
    with count_collectives() as counted:
        gathered = full_tensors(tensors)
    expected = [full_tensor(t) for t in tensors]
    same = [torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(gathered, expected)]
    # write new whole values back both ways; every rank's shards must hold the same bits either way
    values = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in tensors]
    copies = [
        distribute_tensor(w, mesh, t.placements) if is_dtensor(t) else w.clone() for w, t in zip(expected, tensors)
    ]
    write_full_tensors_(tensors, values)
    for t, value in zip(copies, values):
        write_full_(t, value)
    written = [torch.equal(local_part(a), local_part(b)) for a, b in zip(tensors, copies)]
    return {
        "same": same,
        "written": written,
        "collectives": counted.names,
        "local_rows": local_part(tensors[1]).shape[0],
    }


def riemannion_collectives() -> dict[int, list[int]]:
    """Collectives per Riemannion step on FSDP2 shards, for 1 adapter and for 14 (two steps each: the first creates
    the momentum)."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    counts = {}
    for layers, modules in ((1, ["q_proj"]), (2, targets)):
        model = get_peft_model(tiny_llama(num_layers=layers), RiemannionConfig(r=2, target_modules=modules))
        shard_model(model, list(model.base_model.model.model.layers))
        optimizer = create_riemannion_optimizer(model, lr=0.05)
        calls = []
        for x in tokens(4, 2):
            optimizer.zero_grad()
            model(input_ids=x[:4], labels=x[:4]).loss.backward()
            with count_collectives() as counted:
                optimizer.step()
            calls.append(counted.calls)
        counts[len(find_adapters(model))] = calls
    return counts


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = ROWS // world
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    results = {name: case(part, shard=True) for name, case in CASES.items()}
    # the same runs without the save / load in the middle: a resumed run must continue bit for bit
    results["uninterrupted"] = {
        name: CASES[name](part, shard=True, resume=False) for name in ("riemannion", "full_dct", "full_power_channel")
    }
    results["nonfinite"] = nonfinite_on_one_rank(rank)
    with per_tensor_gathers():
        results["per_tensor_gathers"] = {"riemannion": riemannion(part, shard=True, resume=False)}
    results["bucketed_gather"] = bucketed_gather()
    results["riemannion_collectives"] = riemannion_collectives()
    torch.save({"world": world, **results}, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
