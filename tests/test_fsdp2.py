"""LoRA, SplitLoRA and PCLR task cycles and MoRA under FSDP2 (``fully_shard``): ``torchrun --nproc_per_node=2``
(gloo, CPU).

Two ranks, each on half of every global batch, with every decoder layer an FSDP2 unit and the adapters' parameters
DTensor shards between forward passes, end with the same whole adapter tensors on both ranks, equal (to rounding)
to one process on the whole batches: the statistics, splits and folds of SplitLoRA, and the prototypes, begin_task
draws, contribution scores, rank drops, distillation and folds of PCLR. One torchrun launch runs every case
(tests/workers/fsdp2.py). MoRA trains CLIP's contrastive loss with its shared factors on the root unit. Also: the
DTensor helpers of peft_ext.distributed, and the refusals of DeepSpeed ZeRO-3 partitions (task cycles, MoRA) and of
MoRA's whole-weight operations on FSDP2 shards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import get_peft_model

from peft_ext import MoRAConfig, PCLRConfig, SplitLoRAConfig
from peft_ext.distributed import full_tensor, gathered_parameters, is_dtensor, write_full_
from peft_ext.models import tiny_clip, tiny_llama
from peft_ext.tuners.pclr import PCLRLayer

from .helpers import accelerate_launcher, opt_in_accelerate, run_launcher, torchrun_ranks
from .single_thread import one_thread
from .workers import fsdp2 as worker

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "fsdp2.py"
CASES = tuple(worker.CASES)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun_ranks(WORKER, tmp_path_factory.mktemp("fsdp2"), pytest.fail)


def _one_process(names) -> dict:
    with one_thread():
        return {name: worker.CASES[name](slice(None), lambda model: model) for name in names}


@pytest.fixture(scope="module")
def single():
    return _one_process(CASES)


def _assert_matches(got: dict, want: dict, case: str) -> None:
    assert got["state"].keys() == want["state"].keys() and want["state"], case
    for name, value in want["state"].items():
        mine = got["state"][name]
        if ".splitlora_sketch." in name:
            # a sketch is defined up to a rotation of its rows (eigenvectors of nearly equal eigenvalues turn with
            # the rounding of the Gram matrix, summed over the processes' features): compare what it sketches
            mine, value = mine.T @ mine, value.T @ value
        torch.testing.assert_close(mine, value, rtol=1e-4, atol=1e-5, msg=f"{case}: {name}")
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-4, atol=1e-5, msg=case)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_adapters_are_fsdp2_shards_and_ranks_end_identical(ranks, single, case):
    zero, one = ranks[0][case], ranks[1][case]
    assert ranks[0]["world"] == 2 and not ranks[0]["accelerate"]
    # the run really trained DTensor shards (one process: plain tensors)
    assert zero["sharded"] and zero["sharded"] == one["sharded"], case
    assert not single[case]["sharded"]
    for name, value in zero["state"].items():
        assert torch.equal(value, one["state"][name]), (case, name)
    assert torch.equal(zero["logits"], one["logits"])


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process_on_the_global_batch(ranks, single, case):
    for rank in ranks:
        _assert_matches(rank[case], single[case], case)


@pytest.mark.distributed
def test_cycle_decisions_are_those_of_one_process(ranks, single):
    for rank in ranks:
        assert rank["splitlora"]["splits"] == single["splitlora"]["splits"]
        for key in ("draws0", "draws1", "task_state0", "task_state1"):
            assert rank["pclr"][key] == single["pclr"][key], key
        for got, want in zip(rank["pclr"]["prototypes"], single["pclr"]["prototypes"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # the cycle did what it is scheduled to: task 0 compressed (6 -> 4 static ranks), task 1 distilled over tasks
    assert single["pclr"]["task_state0"]["model.layers.0"]["static"] == 4
    assert sum(single["pclr"]["draws1"]) == worker.STEPS


@pytest.mark.distributed
def test_splitlora_statistics_are_sharded_over_the_processes(ranks, single):
    # each process holds half of every module's running statistics (the widths, 32 and 64, split evenly), running and
    # in progress; with shard_statistics=False every process holds them whole, as one process does
    for rank in ranks:
        for case in ("splitlora", "splitlora_sketch"):
            assert [2 * b for b in rank[case]["statistics_bytes"]] == single[case]["statistics_bytes"], case
            assert rank[case]["splits"] == single[case]["splits"], case
        replicated = rank["splitlora_replicated"]
        assert replicated["statistics_bytes"] == single["splitlora_replicated"]["statistics_bytes"]
        assert replicated["splits"] == single["splitlora_replicated"]["splits"]
    # the sketch case really sketched: 8-row sketches of the 32- and 64-wide inputs
    sketches = {n: v.shape for n, v in single["splitlora_sketch"]["state"].items() if "splitlora_sketch." in n}
    assert sketches and all(shape[0] == 8 for shape in sketches.values()), sketches


@pytest.mark.distributed
def test_splitlora_modules_fed_one_input_share_one_sharded_sketch(ranks, single):
    # q/k/v and gate/up share one accumulator: 4 distinct inputs per decoder layer (q/k/v's, o's, gate/up's, down's),
    # so one rows exchange per distinct input and batch instead of one per module (7); every process ends with the
    # statistics and splits of separate accumulators, bit for bit (the same rows appended and shrunk alike)
    for rank in ranks:
        shared, separate = rank["splitlora_sketch"], rank["splitlora_sketch_separate"]
        layers = worker.tiny_llama().config.num_hidden_layers
        assert shared["exchanges"] == 2 * worker.STEPS * 4 * layers, shared["exchanges"]
        assert separate["exchanges"] == 2 * worker.STEPS * 7 * layers, separate["exchanges"]
        for groups in shared["groups"]:
            assert sorted(len(group) for group in groups) == sorted([1, 1, 2, 3] * layers), groups
        assert shared["splits"] == separate["splits"] == single["splitlora_sketch"]["splits"]
        for name, value in shared["state"].items():
            assert torch.equal(value, separate["state"][name]), name
        assert torch.equal(shared["logits"], separate["logits"])
    assert single["splitlora_sketch"]["exchanges"] == 0  # one process: nothing to exchange
    assert single["splitlora_sketch"]["groups"] == ranks[0]["splitlora_sketch"]["groups"]


@pytest.mark.distributed
def test_feature_shards_layout_and_collectives(ranks):
    # 7 features over 2 processes: torch.chunk's 4 + 3; process p's rows are (p + 2) x 7, whole = arange * (p + 1)
    whole = torch.arange(21.0).reshape(3, 7)
    rows = [torch.arange(7.0 * (p + 2)).reshape(p + 2, 7) + 100 * p for p in range(2)]
    for p, rank in enumerate(ranks):
        got = rank["feature_shards"]
        start, stop = got["bounds"]
        assert (start, stop) == ((0, 4), (4, 7))[p]
        # each process's own columns, reassembled: process 0's of whole * 1, process 1's of whole * 2
        assembled = torch.cat([whole[:, :4], 2 * whole[:, 4:]], dim=1)
        assert torch.equal(got["gathered"], assembled) and torch.equal(got["dtensor"], assembled)
        assert torch.equal(got["scattered"], (whole * 3).T[start:stop])  # the sum over both, this process's rows
        assert torch.equal(got["exchanged"], torch.cat(rows)[:, start:stop])  # process 0's rows first


@pytest.mark.distributed
def test_mora_shared_factors_are_root_shards_and_trained(ranks, single):
    # the tuner's S_A / S_B belong to the root unit: sharded between steps, gathered for the root's forward/backward
    shared = sorted(n for n in ranks[0]["mora"]["sharded"] if "mora_shared_" in n)
    assert len(shared) == 4, shared  # text and vision factor of both layer pairs
    init = worker.mora_model().state_dict()
    for name in shared:
        assert not torch.allclose(single["mora"]["state"][name], init[name]), name  # AdamW moved them
    for rank in ranks:  # a tower alone, through register_fsdp_forward_method
        got, want = rank["mora"]["text_features"], single["mora"]["text_features"]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _accelerate_case(accelerate: str, case: str, out: Path, monkeypatch) -> list[dict]:
    """``accelerate launch --config_file tests/accelerate_fsdp2.yaml`` of the worker for ``case`` alone: what each
    of its 2 ranks saved, after checking that they were sharded by accelerate and end bit-identical."""
    monkeypatch.setenv("FSDP2_CASES", case)
    config = ROOT / "tests" / "accelerate_fsdp2.yaml"
    run_launcher([accelerate, "launch", "--config_file", str(config), str(WORKER), str(out)])
    zero, one = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert zero["world"] == 2 and zero["accelerate"] and zero[case]["sharded"]
    for name, value in zero[case]["state"].items():
        assert torch.equal(value, one[case]["state"][name]), name
    return [zero, one]


@pytest.mark.distributed
def test_accelerate_fsdp2_config_runs_a_splitlora_cycle(tmp_path, monkeypatch):
    """The cheap form, run by default: accelerate's own FSDP2 preparation (its launcher's FSDP2 config) of two
    SplitLoRA tasks; the adapters are DTensor shards, and the ranks end bit-identical and equal to one process. Its
    cost is the launch (two processes importing transformers and PEFT, ~10 s), not the case."""
    zero, _ = _accelerate_case(accelerate_launcher(), "splitlora", tmp_path, monkeypatch)
    _assert_matches(zero["splitlora"], _one_process(["splitlora"])["splitlora"], "splitlora")


@pytest.mark.distributed
def test_accelerate_fsdp2_config_runs_the_pclr_cycle(tmp_path, single, monkeypatch):
    """The full form (opt-in): PCLR's cycle, whose routing query calls the embedding alone."""
    accelerate = opt_in_accelerate("launches the PCLR case again (~15 s; its cheap form runs SplitLoRA's cycle)")
    zero, _ = _accelerate_case(accelerate, "pclr", tmp_path, monkeypatch)
    _assert_matches(zero["pclr"], single["pclr"], "pclr")


# -- the DTensor helpers, on a 1-process mesh ---------------------------------------------------------------------


@pytest.fixture
def one_process_mesh(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_full_tensor_and_write_full_on_dtensor_and_plain(one_process_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    value = torch.randn(6, 4)
    shard = torch.nn.Parameter(distribute_tensor(value.clone(), one_process_mesh, [Shard(0)]))
    assert is_dtensor(shard) and not is_dtensor(value)
    assert torch.equal(full_tensor(shard), value) and full_tensor(value) is value
    write_full_(shard, value * 2)
    assert is_dtensor(shard) and torch.equal(full_tensor(shard), value * 2)
    plain = torch.zeros(6, 4)
    write_full_(plain, value)
    assert torch.equal(plain, value)


def test_gathered_parameters_swaps_in_whole_frozen_parameters_and_refuses_trainable(one_process_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    embedding = torch.nn.Embedding(10, 4)
    weight = embedding.weight.detach().clone()
    sharded = torch.nn.Parameter(distribute_tensor(weight, one_process_mesh, [Shard(0)]), requires_grad=False)
    embedding.weight = sharded
    ids = torch.tensor([[1, 7, 3]])
    with gathered_parameters(embedding):
        assert torch.equal(embedding(ids), weight[ids])
    assert embedding.weight is sharded
    sharded.requires_grad_(True)
    with pytest.raises(ValueError, match=r"`weight` is a trainable FSDP2 shard outside every fully_shard unit"):
        with gathered_parameters(embedding):
            pass
    assert embedding.weight is sharded


def test_pclr_pool_writes_on_dtensor_parameters_equal_plain_ones(one_process_mesh):
    # the importance rule, rank drops, folding and begin_task's writes, on DTensor stores (no forward pass needed)
    from torch.distributed.tensor import Shard, distribute_tensor

    config = PCLRConfig(
        target_modules=["q_proj", "v_proj"],
        pool_size=8,
        ranks_schedule=[4],
        top_k=2,
        shared_r=2,
        compress_schedule=[0.5],
        compress_rule="importance",
        init_weights=False,
    )
    models = [get_peft_model(tiny_llama(), config) for _ in range(2)]
    for module in models[1].modules():
        if isinstance(module, PCLRLayer):
            for store in (module.pclr_A, module.pclr_B, module.pclr_keys, module.pclr_shared_A, module.pclr_shared_B):
                for name, p in store.items():
                    store[name] = torch.nn.Parameter(distribute_tensor(p.detach(), one_process_mesh, [Shard(0)]))
    proto = torch.nn.functional.normalize(torch.arange(32.0), dim=0)
    for model in models:
        torch.manual_seed(0)
        model.end_task(0, proto)  # drops 2 of 4 ranks by importance, folds the rest
        model.begin_task(1, proto)
    plain, sharded = ({n: full_tensor(t) for n, t in m.state_dict().items() if "pclr_" in n} for m in models)
    assert any(is_dtensor(p) for p in models[1].parameters())
    assert models[0].task_state() == models[1].task_state()
    assert models[0].task_state()["model.layers.0"] == {"static": 2, "new": 4, "prototypes": 1, "task": 1}
    for name, value in plain.items():
        assert torch.equal(sharded[name], value), name


# -- DeepSpeed ZeRO-3 partitions: the task cycles refuse them ----------------------------------------------------


def _zero3(model, fragment: str) -> str:
    name, p = next((n, p) for n, p in model.named_parameters() if fragment in n)
    p.ds_id, p.ds_shape = 5, p.shape  # what DeepSpeed ZeRO-3 puts on a partitioned parameter
    return name


def test_splitlora_cycle_refuses_zero3_partitions():
    model = get_peft_model(tiny_llama(), SplitLoRAConfig(r=2, target_modules=["q_proj"]))
    _zero3(model, "splitlora_B")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    for call in (model.begin_task, model.end_task):
        with pytest.raises(
            ValueError,
            match=r"SplitLoRA \w+ got `model\.layers\.0\.self_attn\.q_proj\.splitlora_B\.default` \(shape \(32, 2\)\) "
            r"as a DeepSpeed ZeRO-3 partition.*DistributedDataParallel.*FSDP2",
        ):
            call()
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def test_pclr_cycle_refuses_zero3_partitions():
    config = PCLRConfig(target_modules=["q_proj"], pool_size=8, ranks_schedule=[2], top_k=2)
    model = get_peft_model(tiny_llama(), config)
    _zero3(model, "pclr_keys")
    proto = torch.nn.functional.normalize(torch.ones(32), dim=0)
    match = r"PCLR {} got `model\.layers\.0\.self_attn\.q_proj\.pclr_keys\.default` .* ZeRO-3 partition.*FSDP2"
    with pytest.raises(ValueError, match=match.format("begin_task")):
        model.begin_task(0, proto)
    with pytest.raises(ValueError, match=match.format("end_task")):
        model.end_task(0, proto)
    assert model.task_state()["model.layers.0"] == {"static": 0, "new": 2, "prototypes": 0, "task": 0}


# -- MoRA: whole-weight operations and one-tower calls refuse shards ------------------------------------------------


def _mora() -> torch.nn.Module:
    return get_peft_model(tiny_clip(), MoRAConfig(r=2, init_weights=False))


def _clip_inputs() -> dict:
    return {"input_ids": torch.randint(3, 128, (2, 7)), "pixel_values": torch.randn(2, 3, 16, 16)}


def test_mora_refuses_dtensor_shared_factors_and_sharded_merge(one_process_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    model = _mora()
    factors = model.base_model.mora_shared_text["default"]
    factors["t1_v1"] = torch.nn.Parameter(distribute_tensor(factors["t1_v1"].detach(), one_process_mesh, [Shard(0)]))
    before = {n: full_tensor(t).clone() for n, t in model.state_dict().items()}
    # what a tower called alone sees under FSDP2: the root unit that owns the factors did not gather them
    with pytest.raises(
        ValueError,
        match=r"MoRA layer forward got `mora_shared_text\.default\.t1_v1` \(shape \(32, 2\)\) "
        r"as an FSDP2/DTensor shard.*call the sharded root model",
    ):
        model.get_text_features(input_ids=_clip_inputs()["input_ids"])
    with pytest.raises(ValueError, match=r"MoRA merge got `mora_shared_text\.default\.t1_v1`.*full_state_dict=True"):
        model.merge_adapter()
    assert all(torch.equal(full_tensor(t), before[n]) for n, t in model.state_dict().items())


def test_mora_refuses_zero3_partitions_before_changing_weights():
    model = _mora()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    _zero3(model, "mora_shared_vision")
    with pytest.raises(
        ValueError,
        match=r"`mora_shared_vision\.default\.t0_v0` \(shape \(48, 2\)\) as a DeepSpeed "
        r"ZeRO-3 shard.*DistributedDataParallel or FSDP2",
    ):
        model(**_clip_inputs())
    with pytest.raises(ValueError, match=r"MoRA merge got `mora_shared_vision\.default\.t0_v0`.*ZeRO-3"):
        model.merge_adapter()
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    base = tiny_clip()
    base.text_model.encoder.layers[0].self_attn.q_proj.weight.ds_id = 5  # a zero.Init-partitioned base weight
    with pytest.raises(
        ValueError,
        match=r"MoRA update_layer \(adapter 'default'\) got `base_layer\.weight`.*"
        r"before fully_shard",
    ):
        get_peft_model(base, MoRAConfig(r=2))


# --- the job's sharding (peft_ext.continual.sharding) ---------------------------------------------------------------


def _lora_bert(num_layers: int = 2):
    """A tiny random BERT classifier with PEFT LoRA on its attention and the head trained whole."""
    from peft import LoraConfig
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=num_layers, num_attention_heads=2, intermediate_size=32
    )
    base = BertForSequenceClassification(config).eval()
    lora = LoraConfig(r=2, target_modules=["query", "value"], modules_to_save=["classifier"], init_lora_weights=False)
    return get_peft_model(base, lora)


def test_the_job_takes_fsdp2_from_an_accelerate_config(monkeypatch):
    import dataclasses

    from peft_ext.continual.config import ConfigError, load_config
    from peft_ext.continual.sharding import sharding_from_launcher
    from peft_ext.jobs.launch import launcher_sharding

    config = load_config(ROOT / "configs" / "quickstart.yaml")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert sharding_from_launcher() is None and launcher_sharding(config) is config
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert sharding_from_launcher() == "fsdp2"
    assert launcher_sharding(config) == dataclasses.replace(
        config, train=dataclasses.replace(config.train, sharding="fsdp2")
    )
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match=r"asks for FSDP version 1; the job shards with FSDP2 only: set `fsdp_"):
        launcher_sharding(config)


def test_sharding_is_checked_and_the_default_keeps_earlier_fingerprints():
    import dataclasses
    import hashlib
    import json

    from peft_ext.continual.config import ConfigError, load_config
    from peft_ext.fingerprint import json_default
    from peft_ext.jobs.resume import config_hash

    with pytest.raises(ConfigError, match=r"`train.sharding` must be one of \['none', 'fsdp2'\], got 'fsdp'"):
        load_config(ROOT / "configs" / "quickstart.yaml", ["train.sharding=fsdp"])
    config = load_config(ROOT / "configs" / "quickstart.yaml")
    # the fingerprint as it was computed before the keys added since existed: train.sharding, tune, the adapters'
    # loading_note (a saved adapter's note, not a setting) and SplitLoRA's shard_statistics, the methods' head,
    # compare_heads and adapt, the model's chat_template and system_prompt, the instruction data's sizes per task
    data = dataclasses.asdict(config)
    del data["model"]["chat_template"], data["model"]["system_prompt"]
    for key in ("train_per_task", "test_per_task", "val_per_task"):
        del data["data"][key]
    del data["train"]["progress"], data["train"]["sharding"], data["tune"]
    del data["output"]["save_adapters"]  # where the trained models go, not a setting of the run
    for method in data["methods"]:
        method["options"].get("adapter", {}).pop("loading_note", None)
        method["options"].get("adapter", {}).pop("shard_statistics", None)
        for key, default in {"head": None, "compare_heads": [], "adapt": "every_task"}.items():  # the heads' keys
            if method["options"].get(key) == default:
                method["options"].pop(key)
    before = hashlib.sha256(json.dumps(data, sort_keys=True, default=json_default).encode()).hexdigest()[:16]
    assert config_hash(config) == before
    # what runs of the shipped quickstart have in their results.json (change it only with configs/quickstart.yaml
    # itself: c810dc10e5568d87 until its learning rates for olora, osf, pclr and joint moved, 6cc4906bad4be375 until
    # five methods got the analytic head and the training-free baselines joined, 470fff2a7fb6e602 until olora and osf
    # took the prototype head, 6f67818e93b3d836 until it gained a validation split, data.val_per_class: 20)
    assert before == "cf1c141c3a33bc6b"
    sharded = dataclasses.replace(config, train=dataclasses.replace(config.train, sharding="fsdp2"))
    assert config_hash(sharded) != before
    override = ["methods.splitlora.adapter.shard_statistics=false"]
    replicated = load_config(ROOT / "configs" / "quickstart.yaml", override)
    assert config_hash(replicated) != before


def test_the_units_are_the_layer_stack_entries(monkeypatch):
    from peft_ext.continual.sharding import transformer_blocks

    model = _lora_bert()
    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP", raising=False)
    layers = list(model.base_model.model.bert.encoder.layer)
    assert transformer_blocks(model) == layers  # BERT also lists BertEmbeddings in _no_split_modules: root's
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "BertLayer")
    assert transformer_blocks(model) == layers
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer")
    with pytest.raises(ValueError, match=r"names \['LlamaDecoderLayer'\], which this model does not have.*BertLayer"):
        transformer_blocks(model)


def test_shard_model_keeps_the_function_and_gathers_whole_snapshots(one_process_mesh, monkeypatch):
    from peft_ext.continual.sharding import fsdp2_units, is_sharded, shard_model, whole_state_dict

    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP", raising=False)
    model = _lora_bert()
    ids = torch.randint(0, 64, (3, 5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert not is_sharded(model) and fsdp2_units(model) == 0
    assert shard_model(model, torch.device("cpu")) is model
    assert is_sharded(model) and fsdp2_units(model) == 2 + 1 + 1  # two layers, the head, the root
    head = model.base_model.model.classifier.modules_to_save["default"].weight
    assert is_dtensor(head) and is_dtensor(model.base_model.model.bert.encoder.layer[0].attention.self.query.weight)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=1e-6)
    whole = whole_state_dict(model)
    assert whole.keys() == before.keys() and not any(is_dtensor(v) for v in whole.values())
    for key, value in before.items():
        assert torch.equal(whole[key], value), key
