"""Worker of tests/test_distributed.py: Riemannion (+ LOI), DCT-AdamW, SplitLoRA, PCLR and MoRA under DDP (gloo, CPU).

Run as ``torchrun --standalone --nproc_per_node=2 tests/workers/distributed.py OUT_DIR`` (or through
``accelerate launch --config_file tests/accelerate_cpu.yaml tests/workers/distributed.py OUT_DIR``; with
``DDP_METHODS=splitlora,...`` only those methods run). Every rank
trains on its own half of each global batch and writes ``rank{R}.pt``; the test runs the same functions in one
process on the whole batches (``part=slice(None)``, no wrapper) and compares.

Everything that decides the result is data-dependent and computed outside the DDP forward/backward on purpose: LOI's
gradient products, PCLR's prototypes, contribution scores and distillation, SplitLoRA's statistics. The ranks also
seed their random generators differently before PCLR's ``begin_task`` and task draws, so only the broadcast from
rank 0 keeps them identical.

PCLR trains with SGD, and its distillation's AdamW is swapped for SGD too: Adam divides by the root of the second
moment, so a gradient entry that is zero up to rounding (1e-9 in one process, -1e-9 summed over two) becomes a step of
about ``lr`` either way; with Adam, one process and two agree only to the order of ``lr``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import get_peft_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from peft_ext import MoRAConfig, PCLRConfig, RiemannionConfig, SplitLoRAConfig
from peft_ext.distributed import world_size
from peft_ext.models import tiny_bert, tiny_clip, tiny_llama
from peft_ext.optim import DCTAdamW, create_riemannion_optimizer
from peft_ext.tuners.riemannion import find_adapters, initialize_loi
from tests.helpers import pclr_lm_step

STEPS, ROWS, SEQ, VOCAB = 3, 8, 8, 128  # ROWS: the global batch; each of 2 ranks gets ROWS // 2
Wrap = Callable[[nn.Module], nn.Module]


def tokens(seed: int, n: int, low: int = 0, high: int = VOCAB) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (ROWS, SEQ), generator=g) for _ in range(n)]


def probe() -> torch.Tensor:
    return tokens(99, 1)[0][:2]


def _adapter_state(model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items() if prefix in n}


def riemannion(part: slice, wrap: Wrap) -> dict:
    """LOI on this part of two calibration batches, then Riemannion steps on a tiny Llama (q_proj, v_proj)."""
    model = get_peft_model(tiny_llama(), RiemannionConfig(r=2, target_modules=["q_proj", "v_proj"]))
    initialize_loi(model, [{"input_ids": x[part], "labels": x[part]} for x in tokens(1, 2)])
    refs = find_adapters(model)
    loi = {ref.layer_name: (ref.A @ ref.B.mT).detach().clone() for ref in refs}
    optimizer = create_riemannion_optimizer(model, lr=0.05, aux_lr=1e-3)
    net = wrap(model)
    for x in tokens(2, STEPS):
        loss = net(input_ids=x[part], labels=x[part]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return {
            "loi": loi,
            "points": {ref.layer_name: (ref.A @ ref.B.mT).clone() for ref in refs},
            "state": _adapter_state(model, "riemannion_"),
            "logits": model(input_ids=probe()).logits,
        }


def dct_adamw(part: slice, wrap: Wrap) -> dict:
    """Full fine-tuning of a tiny BERT classifier with DCT-AdamW (query/value projected, the rest AdamW)."""
    model = tiny_bert()  # eval mode: no dropout, so one process and two see the same function
    net = wrap(model)
    optimizer = DCTAdamW(net.named_parameters(), lr=1e-2, rank=4, target_modules=["query", "value"])
    labels = torch.arange(ROWS) % 3
    history = []
    for x in tokens(3, STEPS):
        loss = F.cross_entropy(net(input_ids=x[part]).logits, labels[part])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(sorted(s["indices"].tolist() for s in optimizer.state.values() if "indices" in s))
    with torch.no_grad():
        return {"history": history, "state": _adapter_state(model, ""), "logits": model(input_ids=probe()).logits}


def splitlora(part: slice, wrap: Wrap) -> dict:
    """Two SplitLoRA tasks on a tiny BERT: train, collect statistics on this part, end_task (all-reduced)."""
    model = get_peft_model(tiny_bert(), SplitLoRAConfig(r=2, target_modules=["query", "value"], trade_off=3.0))
    net = wrap(model)
    labels = torch.arange(ROWS) % 3
    splits = []
    for task in range(2):
        model.begin_task()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        data = tokens(10 + task, STEPS, low=40 * task, high=40 * task + 60)
        for x in data:
            loss = F.cross_entropy(net(input_ids=x[part]).logits, labels[part])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad(), model.collect_statistics():
            for x in data:
                model(input_ids=x[part])
        splits.append({key: (s.k_star, s.primary) for key, s in model.end_task().items()})
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
    return {"splits": splits, "state": _adapter_state(model, "splitlora_"), "logits": logits}


def pclr_config(targets: list[str]) -> PCLRConfig:
    """The PCLR adapter of the distributed tests: 6 ranks per task, a quarter compressed by contribution."""
    return PCLRConfig(
        target_modules=targets,
        pool_size=16,
        ranks_schedule=[6],
        top_k=4,
        alpha=4.0,
        shared_r=2,
        compress_schedule=[0.25],
        compress_rule="contribution",
    )


def pclr_cycle(model: nn.Module, net: nn.Module, part: slice, rank: int, lr: float) -> dict:
    """Two PCLR tasks: prototype, begin_task, SGD steps of ``net`` (the model or its wrapper) at ``lr``, end_task with
    contribution compression and integration (input routing after task 0, task routing after task 1; its AdamW
    swapped for SGD). Returns the prototypes, task draws and task states."""
    record = {"prototypes": []}
    for task in range(2):
        batches = [{"input_ids": x[part]} for x in tokens(20 + task, STEPS, low=50 * task, high=50 * task + 70)]
        proto = model.query_prototype(batches)
        record["prototypes"].append(proto)
        torch.manual_seed(100 + task + 1000 * rank)  # the ranks' generators differ: begin_task must broadcast
        model.begin_task(task, proto)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
        for batch in batches:
            pclr_lm_step(net, model, batch["input_ids"], optimizer)
        routing = "input" if task == 0 else "tasks"
        generator = torch.Generator().manual_seed(7 + 1000 * rank)
        with mock.patch.object(torch.optim, "AdamW", _sgd):
            result = model.end_task(
                task, proto, batches, integrate_lr=0.5, integrate_routing=routing, generator=generator
            )
        record[f"draws{task}"] = result.task_draws
        record[f"task_state{task}"] = model.task_state()
    return record


def pclr(part: slice, wrap: Wrap, rank: int = 0) -> dict:
    """Two PCLR tasks on a tiny Llama (:func:`pclr_cycle`)."""
    model = get_peft_model(tiny_llama(hidden_size=64), pclr_config(["q_proj", "v_proj"]))
    record = pclr_cycle(model, wrap(model), part, rank, lr=0.5)
    with torch.no_grad():
        record.update(state=_adapter_state(model, "pclr_"), logits=model(input_ids=probe()).logits)
    return record


class _GatherRows(torch.autograd.Function):
    """All ranks' rows of a per-rank batch tensor, in rank order; the backward sums the gradient of the whole over the
    ranks and keeps this rank's rows (every rank computes the same global loss from the gathered rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.rows = slice(dist.get_rank() * x.shape[0], (dist.get_rank() + 1) * x.shape[0])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rows]


def clip_loss(net: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """CLIP's symmetric contrastive loss (fixed temperature) over the global batch: the ranks' normalized embeddings
    are gathered, so every rank's in-batch negatives are those of one process on the whole batch. Each rank's loss is
    the global one and its gradient reaches its own rows summed over the ranks, which the data-parallel average of
    the parameters' gradients turns into exactly the one-process gradient."""
    out = net(**batch)
    text, image = out.text_embeds, out.image_embeds
    if world_size() > 1:
        text, image = _GatherRows.apply(text), _GatherRows.apply(image)
    logits = 10.0 * text @ image.mT
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.mT, labels)) / 2


def clip_batches(n: int, seed: int = 30) -> list[dict[str, torch.Tensor]]:
    """``n`` global batches of random token ids (ending in CLIP's end token, whose state is pooled) and pixels."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=g)
        ids[:, -1] = 2
        batches.append({"input_ids": ids, "pixel_values": torch.randn(ROWS, 3, 16, 16, generator=g)})
    return batches


def mora_model() -> nn.Module:
    """MoRA on both towers' attention of a tiny CLIP, with a visible delta at init (every factor has a gradient)."""
    return get_peft_model(tiny_clip(), MoRAConfig(r=2, init_weights=False))


def mora(part: slice, wrap: Wrap) -> dict:
    """AdamW steps of MoRA on CLIP's contrastive loss over the global batch (:func:`clip_loss`)."""
    model = mora_model()
    net = wrap(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for batch in clip_batches(STEPS):
        loss = clip_loss(net, {k: v[part] for k, v in batch.items()})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        probe_batch = {k: v[:2] for k, v in clip_batches(1, seed=99)[0].items()}
        logits = model(**probe_batch).logits_per_image
    return {"state": _adapter_state(model, "mora_"), "logits": logits}


def _sgd(params, lr: float, **_: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr)


def join() -> tuple[int, int, slice]:
    """Join the gloo process group (one thread per process); returns this rank, the world size and this rank's rows
    of every global batch."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = ROWS // world
    return rank, world, slice(rank * per_rank, (rank + 1) * per_rank)


def main(out_dir: str) -> None:
    rank, world, part = join()
    wrappers: list[nn.Module] = []

    def wrap(model: nn.Module) -> nn.Module:
        wrappers.append(DistributedDataParallel(model))
        return wrappers[-1]

    cases = {
        "riemannion": lambda: riemannion(part, wrap),
        "dct_adamw": lambda: dct_adamw(part, wrap),
        "splitlora": lambda: splitlora(part, wrap),
        "pclr": lambda: pclr(part, wrap, rank),
        "mora": lambda: mora(part, wrap),
    }
    only = os.environ.get("DDP_METHODS")  # e.g. "splitlora": the cheap form of the accelerate test runs one
    record = {"world": world}
    for name, case in cases.items():
        if not only or name in only.split(","):
            record[name] = case()
    torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    wrappers.clear()  # tearing the group down under a live DDP reducer can hang gloo at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
