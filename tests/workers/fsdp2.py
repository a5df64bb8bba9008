"""Worker of tests/test_fsdp2.py: LoRA, SplitLoRA and PCLR task cycles and MoRA under FSDP2 (``fully_shard``, gloo,
CPU).

Run as ``torchrun --standalone --nproc_per_node=2 tests/workers/fsdp2.py OUT_DIR`` (or through
``accelerate launch --config_file tests/accelerate_fsdp2.yaml tests/workers/fsdp2.py OUT_DIR``, which shards the
model itself). Every rank trains on its own half of each global batch and writes ``rank{R}.pt``; the test runs the
same functions in one process on the whole batches (``part=slice(None)``, no sharding) and compares.

The model is a tiny Llama with every attention and MLP projection adapted (MoRA: a tiny CLIP, the attention of both
towers); each decoder (encoder) layer is its own FSDP2 unit and the ``PeftModel`` is the root (what accelerate's
transformer auto-wrap does), so the adapters' parameters are DTensor shards outside the forward and the task cycle
(statistics, split, compression, distillation) runs on them. MoRA's shared factors live on the tuner, so they are
the root's: sharded between steps, whole during the root's forward and backward.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from peft_ext import SplitLoRAConfig
from peft_ext.distributed import full_tensor, is_dtensor
from peft_ext.models import tiny_llama
from peft_ext.tuners.splitlora import SplitLoRALayer
from tests.workers.distributed import (
    STEPS,
    clip_batches,
    clip_loss,
    join,
    mora_model,
    pclr_config,
    pclr_cycle,
    probe,
    tokens,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
Shard = Callable[[nn.Module], nn.Module]


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train(model: nn.Module, batches: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    for ids in batches:
        loss = lm_loss(model, ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (DTensor shards under FSDP2), a fresh one per task as the cycle asks."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def finish(model: nn.Module, prefix: str, record: dict, inputs: dict | None = None) -> dict:
    """Every adapter tensor as a whole tensor (gathered from the shards), the logits on a probe batch (``inputs``,
    default: probe token ids), and which adapter parameters were DTensor shards."""
    sharded = [n for n, p in model.named_parameters() if prefix in n and is_dtensor(p)]
    state = {n: full_tensor(t).detach().clone() for n, t in model.state_dict().items() if prefix in n}
    with torch.no_grad():
        out = model(**(inputs or {"input_ids": probe()}))
    logits = out.logits if inputs is None else out.logits_per_image
    return {**record, "sharded": sharded, "state": state, "logits": logits}


def lora(part: slice, shard: Shard) -> dict:
    """PEFT's own LoRA on every projection: the baseline FSDP2 is known to handle."""
    model = shard(get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False)))
    train(model, [x[part] for x in tokens(1, STEPS)], adamw(model))
    return finish(model, "lora_", {})


def splitlora(part: slice, shard: Shard, separate: bool = False, **options) -> dict:
    """Two SplitLoRA tasks: begin_task, AdamW, statistics on this part, end_task (split, fold, next A); the bytes of
    running statistics this process holds after each task (its share when they are sharded), the modules sharing one
    accumulator and the rows exchanges (sharded sketches) of the statistics passes. ``separate``: sharing switched
    off, every module its own accumulator (as before modules fed the same input shared one)."""
    from unittest.mock import patch

    from peft_ext.distributed.features import FeatureShards
    from peft_ext.tuners.splitlora.sharing import _Group

    config = SplitLoRAConfig(r=2, target_modules=TARGETS, trade_off=3.0, dense_max_features=64, **options)
    model = shard(get_peft_model(tiny_llama(), config))
    splits, held, groups, exchanges = [], [], [], []
    exchange = FeatureShards.exchange

    def counted(self, rows):
        exchanges.append(rows.shape)
        return exchange(self, rows)

    for task in range(2):
        model.begin_task()
        data = [x[part] for x in tokens(10 + task, STEPS, low=40 * task, high=40 * task + 60)]
        train(model, data, adamw(model))
        with patch.object(FeatureShards, "exchange", counted):
            with patch.object(_Group, "matches", lambda self, *args: False) if separate else nullcontext():
                with torch.no_grad(), model.collect_statistics():
                    for ids in data:
                        model(input_ids=ids)
        groups.append(model.statistics_groups())
        splits.append({key: (s.k_star, s.primary) for key, s in model.end_task().items()})
        layers = [m for m in model.modules() if isinstance(m, SplitLoRALayer)]
        held.append(sum(m.local_statistics("default").nbytes for m in layers))
    record = {"splits": splits, "statistics_bytes": held, "groups": groups, "exchanges": len(exchanges)}
    return finish(model, "splitlora_", record)


def feature_shards() -> dict:
    """peft_ext.distributed.FeatureShards on 7 features (uneven: 4 + 3 over 2 processes) and unequal row counts: the
    whole tensor gathered, a sum reduce-scattered, rows exchanged, a DTensor built from the local part. One process:
    the same calls are not made (the test computes what they must return)."""
    from torch.distributed.device_mesh import init_device_mesh

    from peft_ext.distributed.features import FeatureShards

    rank = dist.get_rank()
    shards = FeatureShards(init_device_mesh("cpu", (dist.get_world_size(),)), 7)
    whole = torch.arange(21.0).reshape(3, 7) * (rank + 1)
    rows = torch.arange(7.0 * (rank + 2)).reshape(rank + 2, 7) + 100 * rank
    return {
        "bounds": shards.bounds(),
        "gathered": shards.gather(shards.local(whole, 1), 1),
        "scattered": shards.reduce_scatter(whole.T.contiguous()),
        "exchanged": shards.exchange(rows),
        "dtensor": full_tensor(shards.dtensor(shards.local(whole, 1), 1)),
    }


def pclr(part: slice, shard: Shard, rank: int = 0) -> dict:
    """Two PCLR tasks, the DDP worker's cycle (:func:`tests.workers.distributed.pclr_cycle`): prototype, begin_task,
    training with the query loss, end_task with contribution compression and distillation (input routing after task
    0, task routing after task 1), fold, next task.

    SGD, for training and in place of the distillation's AdamW: the distillation drives the loss of old tasks' routing
    towards zero, where gradient entries are rounding noise (1e-5 relative to each other in one process and two);
    Adam divides by their root mean square and turns the noise into steps of about ``lr``, so with Adam one process
    and two agree only to the order of ``lr``. With SGD they agree to rounding; AdamW on FSDP2 shards is what the
    LoRA and SplitLoRA cases train with.
    """
    model = shard(get_peft_model(tiny_llama(), pclr_config(TARGETS)))
    return finish(model, "pclr_", pclr_cycle(model, model, part, rank, lr=1e-2))


def mora(part: slice, shard: Shard) -> dict:
    """MoRA on a tiny CLIP (both towers' attention, visible delta at init), AdamW on CLIP's contrastive loss over the
    global batch (:func:`tests.workers.distributed.clip_loss` gathers the ranks' embeddings)."""
    model = shard(mora_model())
    optimizer = adamw(model)
    for batch in clip_batches(STEPS):
        loss = clip_loss(model, {k: v[part] for k, v in batch.items()})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    probe_batch = {k: v[:2] for k, v in clip_batches(1, seed=99)[0].items()}
    record = finish(model, "mora_", {}, inputs=probe_batch)  # first: it records which parameters are shards
    # one tower alone: a method other than forward must run the root's FSDP2 hooks to gather the shared factors (and
    # the root's embedding); a no-op for an unsharded model. The root keeps its parameters whole after finish's
    # no-grad forward (fully_shard does not reshard the root after forward): reshard, so the call has to gather.
    if isinstance(model, FSDPModule):
        model.reshard()
    register_fsdp_forward_method(model, "get_text_features")
    with torch.no_grad():
        record["text_features"] = model.get_text_features(input_ids=probe_batch["input_ids"]).pooler_output
    return record


CASES = {
    "lora": lora,
    "splitlora": splitlora,
    # every module a frequent-directions sketch (8 rows of 16-row buffers, shrinking every 8 tokens)
    "splitlora_sketch": partial(splitlora, statistics="sketch", sketch_rank=8),
    "splitlora_sketch_separate": partial(splitlora, separate=True, statistics="sketch", sketch_rank=8),
    "splitlora_replicated": partial(splitlora, shard_statistics=False),
    "pclr": pclr,
    "mora": mora,
}


def fsdp2(mesh) -> Shard:
    """Each decoder (encoder) layer its own FSDP2 unit, the PeftModel the root (what accelerate's transformer
    auto-wrap does). Scalar parameters (CLIP's ``logit_scale``), which fully_shard refuses, stay whole on every rank
    (``ignored_params``)."""
    from torch.distributed.fsdp import fully_shard

    def shard(model: nn.Module) -> nn.Module:
        stacks = [m for name, m in model.named_modules() if name.endswith(".layers") and isinstance(m, nn.ModuleList)]
        for layer in (layer for stack in stacks for layer in stack):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh, ignored_params={p for p in model.parameters() if p.dim() == 0} or None)
        return model

    return shard


def accelerate_fsdp2(rank: int) -> Shard:
    """accelerate's own FSDP2 preparation, as ``accelerate launch --config_file tests/accelerate_fsdp2.yaml`` sets it.

    accelerate (1.15) turns FSDP on only for GPU-type setups: on CPUs ``Accelerator().prepare`` would leave the model
    whole. So the worker runs what ``prepare`` runs for FSDP2, ``fsdp2_prepare_model`` with the
    ``FullyShardedDataParallelPlugin`` that the launcher's environment configures (version 2, the decoder layers as
    units), on a minimal stand-in for the Accelerator. On GPUs: ``model, optimizer = Accelerator().prepare(model,
    optimizer)``. tests/accelerate_fsdp2.yaml wraps ``LlamaDecoderLayer``s, and its test runs the PCLR case only
    (``FSDP2_CASES=pclr``); the MoRA case (a CLIP, whose scalar ``logit_scale`` fully_shard must ignore) runs under
    torchrun.
    """
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise ValueError(f"tests/accelerate_fsdp2.yaml should configure FSDP2, the launcher set {plugin.fsdp_version}")
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=None,
        parallelism_config=None,
        device=torch.device("cpu"),
        is_main_process=rank == 0,
        mixed_precision="no",
    )

    def shard(model: nn.Module) -> nn.Module:
        model = fsdp2_prepare_model(accelerator, model)
        # accelerate makes the input embedding a unit of its own; the root's first forward must come before a call
        # of that unit alone (PCLR's query_prototype embeds the prompt), or FSDP2 takes the embedding for the root
        with torch.no_grad():
            model(input_ids=probe())
        return model

    return shard


def main(out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world, part = join()
    # accelerate's launcher exports the config file's FSDP settings (ACCELERATE_USE_FSDP, FSDP_VERSION, ...)
    by_accelerate = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    shard = accelerate_fsdp2(rank) if by_accelerate else fsdp2(init_device_mesh("cpu", (world,)))
    only = os.environ.get("FSDP2_CASES")
    record = {"world": world, "accelerate": by_accelerate}
    for name, case in CASES.items():
        if only and name not in only.split(","):
            continue
        record[name] = case(part, shard, rank) if name == "pclr" else case(part, shard)
    if not only:
        record["feature_shards"] = feature_shards()
    torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
