"""Riemannion (+ LOI), DCT-AdamW, SplitLoRA, PCLR and MoRA under DDP: ``torchrun --nproc_per_node=2`` (gloo, CPU).

After training, every parameter and buffer is bit-identical across the ranks and equal (to rounding) to one process
on the whole batches. Also: the optimizers refuse layouts they cannot use (DTensor column shards, DeepSpeed ZeRO)
with a ``ValueError`` instead of training on them; FSDP2 row shards are tested in tests/test_fsdp_optim.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import get_peft_model
from torch import nn

from peft_ext import RiemannionConfig
from peft_ext.models import tiny_llama
from peft_ext.optim import DCTAdamW, Riemannion, create_riemannion_optimizer

from .helpers import accelerate_launcher, opt_in_accelerate, run_launcher, torchrun_ranks
from .single_thread import one_thread, single_thread  # noqa: F401  (fixture)
from .workers import distributed as worker

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("riemannion", "dct_adamw", "splitlora", "pclr", "mora")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun_ranks(ROOT / "tests" / "workers" / "distributed.py", tmp_path_factory.mktemp("ddp"), pytest.skip)


@pytest.fixture(scope="module")
def single():
    with one_thread():
        return {name: getattr(worker, name)(slice(None), lambda model: model) for name in METHODS}


@pytest.mark.distributed
@pytest.mark.parametrize("method", METHODS)
def test_ranks_end_bit_identical(ranks, method):
    zero, one = ranks[0][method], ranks[1][method]
    assert ranks[0]["world"] == 2
    assert zero["state"].keys() == one["state"].keys() and zero["state"]
    for name, value in zero["state"].items():
        assert torch.equal(value, one["state"][name]), name
    assert torch.equal(zero["logits"], one["logits"])


@pytest.mark.distributed
@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_equal_one_process_on_the_global_batch(ranks, single, method):
    ddp, one = ranks[0][method], single[method]
    for name, value in one["state"].items():
        if name.endswith(("riemannion_A.default", "riemannion_B.default", "X0_A.default", "X0_B.default")):
            continue  # factors of X are defined up to sign by the SVDs; X itself is compared below
        torch.testing.assert_close(ddp["state"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(ddp["logits"], one["logits"], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_loi_and_riemannion_points_match_one_process(ranks, single):
    # The ranks all-reduce their gradients in another order than one process sums the global batch: float32 rounding
    # that a few Riemannion steps carry into the points, up to 1.4e-6 (composed step) / 2.3e-6 (factored step) on
    # entries of size up to 3.4e-2 here; the LOI starts agree to 4e-9.
    for key, atol in (("loi", 1e-6), ("points", 5e-6)):
        for layer, X in single["riemannion"][key].items():
            for rank in ranks:
                torch.testing.assert_close(rank["riemannion"][key][layer], X, rtol=1e-4, atol=atol, msg=layer)


@pytest.mark.distributed
def test_selections_splits_prototypes_and_draws_are_global(ranks, single):
    for rank in ranks:
        assert rank["dct_adamw"]["history"] == single["dct_adamw"]["history"]
        assert rank["splitlora"]["splits"] == single["splitlora"]["splits"]
        assert rank["pclr"]["draws1"] == single["pclr"]["draws1"]
        for got, want in zip(rank["pclr"]["prototypes"], single["pclr"]["prototypes"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _accelerate_ranks(accelerate: str, out: Path) -> list[dict]:
    """``accelerate launch --config_file tests/accelerate_cpu.yaml`` of the worker: what each of its 2 ranks saved."""
    config = ROOT / "tests" / "accelerate_cpu.yaml"
    run_launcher(
        [
            accelerate,
            "launch",
            "--config_file",
            str(config),
            str(ROOT / "tests" / "workers" / "distributed.py"),
            str(out),
        ]
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.distributed
def test_accelerate_launch_trains_a_method_like_one_process(tmp_path, single, monkeypatch):
    """The cheap form, run by default: accelerate's launcher (its DDP config on CPUs) starts the worker for SplitLoRA
    alone; the two ranks end bit-identical and equal to one process on the whole batches. Its cost is the launch
    (two processes importing transformers and PEFT, ~10 s), not the method (a tenth of a second)."""
    accelerate = accelerate_launcher()
    monkeypatch.setenv("DDP_METHODS", "splitlora")
    zero, one = _accelerate_ranks(accelerate, tmp_path)
    assert zero["world"] == 2 and set(zero) == {"world", "splitlora"}
    assert zero["splitlora"]["state"]
    for name, value in zero["splitlora"]["state"].items():
        assert torch.equal(value, one["splitlora"]["state"][name]), name
    for name, value in single["splitlora"]["state"].items():
        torch.testing.assert_close(zero["splitlora"]["state"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert zero["splitlora"]["splits"] == single["splitlora"]["splits"]


@pytest.mark.distributed
def test_accelerate_launch_runs_the_same_worker(tmp_path, monkeypatch):
    """The full form (opt-in): every method of the worker under accelerate's launcher."""
    accelerate = opt_in_accelerate("runs the whole worker again (~15 s; its cheap form runs SplitLoRA alone)")
    monkeypatch.delenv("DDP_METHODS", raising=False)
    zero, one = _accelerate_ranks(accelerate, tmp_path)
    assert zero["world"] == 2
    for method in METHODS:
        for name, value in zero[method]["state"].items():
            assert torch.equal(value, one[method]["state"][name]), (method, name)


# -- sharded parameters: fail loudly instead of optimizing shards -------------------------------------------------


@pytest.fixture
def one_process_group(tmp_path):
    if not dist.is_available():
        pytest.skip("torch is built without torch.distributed")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _riemannion_model() -> nn.Module:
    return get_peft_model(tiny_llama(hidden_size=32, num_layers=1), RiemannionConfig(r=2, target_modules=["q_proj"]))


@pytest.mark.distributed
def test_layouts_other_than_row_shards_are_refused(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    columns = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)]))
    with pytest.raises(
        ValueError,
        match=r"DCTAdamW got `w` \(shape \(8, 6\)\) as a DTensor with placements "
        r"\(Shard\(dim=1\),\).*Shard\(0\).*fully_shard's default",
    ):
        DCTAdamW([("w", columns)], rank=2)
    rows = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]))
    DCTAdamW([("w", rows)], rank=2)  # FSDP2's layout: accepted
    with pytest.raises(ValueError, match=r"side='left' transforms over the rows of `w`.*'auto' or 'right'"):
        DCTAdamW([("w", rows)], rank=2, side="left")

    model = _riemannion_model()
    ref = next(m for n, m in model.named_modules() if n.endswith("q_proj"))
    B = ref.riemannion_B["default"]
    ref.riemannion_B["default"] = nn.Parameter(distribute_tensor(B.detach(), mesh, [Shard(0)]))
    Riemannion(model)  # FSDP2's layout: accepted; the layer stops caching B_R (FSDP2 refills B behind its version)
    assert ref.cache_right_basis is False
    ref.riemannion_B["default"] = nn.Parameter(distribute_tensor(B.detach(), mesh, [Shard(1)]))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "riemannion_A" in n}
    with pytest.raises(ValueError, match=r"Riemannion got `.*riemannion_B.default` .*Shard\(dim=1\).*retraction"):
        Riemannion(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


@pytest.mark.parametrize("make", ["dct", "riemannion"])
def test_zero3_parameters_are_refused(make):
    if make == "dct":
        p = nn.Parameter(torch.randn(8, 6))
        p.ds_id, p.ds_numel = 3, 48  # what DeepSpeed ZeRO-3 puts on a partitioned parameter
        with pytest.raises(ValueError, match=r"`w` \(shape \(8, 6\)\) as a DeepSpeed ZeRO-3 shard"):
            DCTAdamW([("w", p)], rank=2)
    else:
        model = _riemannion_model()
        B = next(p for n, p in model.named_parameters() if "riemannion_B" in n)
        B.ds_id = 7
        with pytest.raises(ValueError, match=r"riemannion_B.default` .* DeepSpeed ZeRO-3 shard"):
            create_riemannion_optimizer(model)


def test_parameters_flattened_after_construction_are_refused():
    # DeepSpeed ZeRO (stages 1-3) swaps each group's parameters for one flat partition after the optimizer is built
    model = _riemannion_model()
    optimizer = create_riemannion_optimizer(model)
    optimizer.param_groups[0]["params"] = [
        torch.cat([p.detach().flatten() for p in optimizer.param_groups[0]["params"]])
    ]
    with pytest.raises(ValueError, match="Riemannion: the parameters of param group 0 were replaced.*DeepSpeed ZeRO"):
        optimizer.step()

    w = nn.Parameter(torch.randn(8, 6))
    dct = DCTAdamW([w], rank=2)
    dct.param_groups[0]["params"] = [nn.Parameter(torch.randn(48))]
    with pytest.raises(ValueError, match="DCTAdamW: the parameters of param group 0 were replaced"):
        dct.step()
