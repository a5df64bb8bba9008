"""SplitLoRA: the split, the statistics, the task lifecycle, the PEFT tuner contract and the continual plugins."""

from __future__ import annotations

import copy
import json
import math
import warnings
from unittest.mock import patch

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.utils import PeftType
from safetensors.torch import load_file, save_file
from torch import nn

import peft_ext
from peft_ext import SplitLoRAConfig
from peft_ext.continual import RunContext, TrainConfig, get_continual_method, run_sequence
from peft_ext.continual.methods.covariance import input_covariances
from peft_ext.continual.methods.inflora import gpm_update, inflora_A
from peft_ext.models import tiny_bert
from peft_ext.tuners.splitlora import SPLITLORA, SplitLoRALayer, SplitLoRAModel
from peft_ext.tuners.splitlora import covariance as splitlora_covariance
from peft_ext.tuners.splitlora import statistics as statistics_module
from peft_ext.tuners.splitlora.covariance import fd_compress, fd_update
from peft_ext.tuners.splitlora.sequence_state import SEQUENCE_STATE_FILE
from peft_ext.tuners.splitlora.subspace import (
    choose_split,
    closed_form_split,
    kaiming_lora_A,
    primary_dimension,
    seeded_generator,
    split_objective,
)

from .helpers import (
    QUERY_VALUE,
    dead_adapter,
    lora_adapter,
    padded_batches,
    stack_collate,
    tiny_classifier,
    token_sequence,
    training_only,
)
from .tuner_contract import TunerCase, contract_test


class MLP(nn.Module):
    """Two hidden linears and a head. Widths 64: bitsandbytes' CPU 4-bit kernel only takes such blocks."""

    def __init__(self, width: int = 64, n_in: int = 64, n_out: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin0 = nn.Linear(n_in, width)
        self.lin1 = nn.Linear(width, width)
        self.head = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin1(torch.tanh(self.lin0(x)))))


class TokenMLP(MLP):
    """Takes ``attention_mask`` like a transformer does (and ignores it), so the statistics hooks can use it."""

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


def _peft(config: SplitLoRAConfig, **kwargs) -> PeftModel:
    return get_peft_model(MLP(**kwargs), config)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 30, lr: float = 1e-2) -> float:
    """Full-batch AdamW on the MSE; a fresh optimizer, like every task. Returns the final loss."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        return float((model(x) - y).pow(2).mean())


def _finish(model: PeftModel, *batches: torch.Tensor) -> dict:
    with torch.no_grad(), model.collect_statistics():
        for x in batches:
            model(x)
    return model.end_task()


def _layers(model: nn.Module) -> dict[str, SplitLoRALayer]:
    return {layer._splitlora_seed_key: layer for layer in model.modules() if isinstance(layer, SplitLoRALayer)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the split --------------------------------------------------------------------------------------------------


def _brute_force_f(p: list[float], t: int, a: float, d: int) -> list[float]:
    """f(j) of docs/methods.md (SplitLoRA), term by term in plain Python."""
    return [(t + 1) * (1 - sum(p[: j + 1])) - a * (d - j) / d for j in range(len(p))]


@pytest.mark.parametrize("seed", range(6))
def test_k_star_is_the_brute_force_argmin_and_the_closed_form(seed):
    g = _gen(seed)
    checked_interior = 0
    for _ in range(40):
        d = int(torch.randint(4, 80, (1,), generator=g))
        decay = float(torch.rand(1, generator=g)) * 0.5 + 0.02
        values = torch.exp(-decay * torch.arange(d, dtype=torch.float64)) * (1 + 0.3 * torch.rand(d, generator=g))
        values = values.sort(descending=True).values
        t = int(torch.randint(0, 12, (1,), generator=g))
        a = float(torch.rand(1, generator=g)) * 30 + 0.5
        p = (values / values.sum()).tolist()
        f = _brute_force_f(p, t, a, d)
        expected = min(range(d), key=lambda j: (f[j], j))
        assert choose_split(values, t, a) == expected
        assert closed_form_split(values, t, a) == expected
        torch.testing.assert_close(split_objective(values, t, a), torch.tensor(f, dtype=torch.float64))
        checked_interior += 0 < expected < d - 1
    assert checked_interior > 10, "the random spectra must exercise splits away from the ends"


def test_split_with_a_partial_spectrum_uses_the_exact_trace_and_width():
    values = torch.tensor([5.0, 3.0, 1.0, 0.5], dtype=torch.float64)
    # the known top of a 100-wide spectrum whose other 96 eigenvalues carry 10.5 more energy
    total, d = 20.0, 100
    p = (values / total).tolist()
    f = _brute_force_f(p, 2, 20.0, d)
    assert choose_split(values, 2, 20.0, dim=d, total=total) == min(range(4), key=lambda j: (f[j], j))
    # threshold 20 / (3 * 100) = 0.0667: shares 0.25, 0.15, 0.05, 0.025 -> two above -> k* = 1
    assert closed_form_split(values, 2, 20.0, dim=d, total=total) == 1
    assert primary_dimension(0, 10) == 2 and primary_dimension(1, 10) == 2 and primary_dimension(5, 10) == 6
    assert primary_dimension(9, 3) == 3


def test_split_rejects_bad_spectra():
    with pytest.raises(ValueError, match="descending"):
        choose_split(torch.tensor([1.0, 2.0]), 0, 20.0)
    with pytest.raises(ValueError, match="positive finite"):
        choose_split(torch.zeros(3), 0, 20.0)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        choose_split(torch.zeros(0), 0, 20.0)


# --- statistics --------------------------------------------------------------------------------------------------


def test_streaming_covariance_equals_the_covariance_of_the_concatenated_data():
    """Token-weighted running mean over two tasks, uneven batches and padding masks == X^T X / N of all real rows."""
    model = get_peft_model(TokenMLP(n_in=12, width=16), SplitLoRAConfig(r=2, target_modules=["lin0"]))
    layer = _layers(model)["lin0"]
    g = _gen(1)
    seen = []
    for task, sizes in enumerate([(5, 3, 9), (2, 7)]):
        with torch.no_grad(), model.collect_statistics():
            for b in sizes:
                x = torch.randn(b, 6, 12, generator=g, dtype=torch.float32) * (1 + task)
                mask = (torch.rand(b, 6, generator=g) > 0.3).long()
                model(x, attention_mask=mask)
                seen.append(x[mask.bool()])
        model.end_task()
    rows = torch.cat(seen).to(torch.float64)
    expected = rows.T @ rows / rows.shape[0]
    assert int(layer.splitlora_tokens["default"]) == rows.shape[0]
    torch.testing.assert_close(layer.covariance("default").to(torch.float64), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(float(layer.splitlora_energy["default"]), float(rows.square().sum()), rtol=1e-6, atol=0)


def test_frequent_directions_is_exact_up_to_rank_ell_and_bounded_beyond():
    g = _gen(2)
    ell, n = 8, 40
    low_rank = torch.randn(300, 6, generator=g, dtype=torch.float64) @ torch.randn(
        6, n, generator=g, dtype=torch.float64
    )
    sketch, delta = fd_update(torch.zeros(ell, n, dtype=torch.float64), low_rank)
    assert delta < 1e-8 * low_rank.square().sum()
    torch.testing.assert_close(sketch.T @ sketch, low_rank.T @ low_rank, rtol=1e-9, atol=1e-7)

    data = torch.randn(500, n, generator=g, dtype=torch.float64) * torch.linspace(3, 0.1, n, dtype=torch.float64)
    total = 0.0
    sketch = torch.zeros(ell, n, dtype=torch.float64)
    for chunk in data.split(37):  # streaming in uneven batches
        sketch, d = fd_update(sketch, chunk)
        total += d
    gap = torch.linalg.eigvalsh(data.T @ data - sketch.T @ sketch)
    assert float(gap.min()) > -1e-8, "a frequent-directions sketch never overestimates"
    assert float(gap.max()) <= total + 1e-8, "the accumulated shrinkage certifies the spectral error"
    assert total <= (data.square().sum() - sketch.square().sum()) / ell + 1e-8
    assert float(gap.max()) > 0.1 * total, "the bound should be reasonably tight, not vacuous"

    # merging two sketches (what DDP does) keeps the certificate: the errors add up
    half_a, da = fd_update(torch.zeros(ell, n, dtype=torch.float64), data[:250])
    half_b, db = fd_update(torch.zeros(ell, n, dtype=torch.float64), data[250:])
    merged, dm = fd_compress(torch.cat([half_a, half_b]), ell)
    gap = torch.linalg.eigvalsh(data.T @ data - merged.T @ merged)
    assert float(gap.min()) > -1e-8 and float(gap.max()) <= da + db + dm + 1e-8


def test_sketch_statistics_in_a_layer_are_certified():
    config = SplitLoRAConfig(r=2, target_modules=["lin0"], statistics="auto", dense_max_features=16, sketch_rank=6)
    model = _peft(config, n_in=24, width=16)
    layer = _layers(model)["lin0"]
    assert layer.statistics_kind("default") == "sketch" and "default" not in layer.splitlora_cov
    g = _gen(3)
    data = torch.randn(90, 24, generator=g) * torch.linspace(2, 0.2, 24)
    _finish(model, *data.split(20))
    true = (data.T @ data / 90).to(torch.float64)
    gap = torch.linalg.eigvalsh(true - layer.covariance("default").to(torch.float64))
    assert float(gap.min()) > -1e-5 and float(gap.max()) <= layer.statistics_error("default") + 1e-5
    assert layer.statistics_error("default") > 0
    assert model.task_state()["lin0"]["statistics"] == "sketch"


# --- the lifecycle ------------------------------------------------------------------------------------------------


def _subspace_tasks(n_tasks: int, n_in: int = 24, per_task: int = 4, rows: int = 120, seed: int = 4):
    """Task t's inputs live in its own ``per_task``-dim subspace (mutually orthogonal); targets are a random linear
    function of them (a learnable task)."""
    g = _gen(seed)
    basis = torch.linalg.qr(torch.randn(n_in, n_in, generator=g)).Q
    tasks = []
    for t in range(n_tasks):
        u = basis[:, t * per_task : (t + 1) * per_task]
        x = (torch.randn(rows, per_task, generator=g) * torch.tensor([2.0, 1.5, 1.0, 0.7])[:per_task]) @ u.T
        y = x @ torch.randn(n_in, 5, generator=g) * 0.5
        tasks.append((x, y))
    return tasks


def test_primary_subspace_grows_and_new_A_is_orthogonal_to_it():
    # a = 2 with d = 24: the threshold a / ((t + 1) d) = 0.083 / (t + 1) sits inside each task's spectrum
    config = SplitLoRAConfig(r=3, target_modules=["lin0", "lin1"], trade_off=2.0, init_scaling="inverse_task")
    model = _peft(config, n_in=24, width=32)
    layers = _layers(model)
    tasks = _subspace_tasks(4)
    primaries = []
    for t, (x, y) in enumerate(tasks):
        assert model.begin_task() == t
        _train(model, x, y, steps=5)
        splits = _finish(model, x)
        primaries.append(splits["lin0"].primary)
        for key, layer in layers.items():
            values, vectors, _ = layer.spectrum("default")
            k = choose_split(values, t, 2.0, dim=layer.in_features)
            assert splits[key].k_star == k and splits[key].primary == primary_dimension(k, layer.in_features)
            # the primary subspace recomputed from the saved covariance, independently of the layer's own choice
            primary = torch.linalg.eigh(layer.covariance("default").to(torch.float64)).eigenvectors
            primary = primary[:, -splits[key].primary :]
            a = layer.splitlora_A["default"].to(torch.float64)
            assert float((a @ primary).norm()) < 1e-6 * float(a.norm()), key
            kaiming = kaiming_lora_A(3, layer.in_features, seeded_generator(0, key, t + 1), torch.float64)
            torch.testing.assert_close(float(a.norm()), float(kaiming.norm()) / (t + 2), rtol=1e-5, atol=0)
            assert float(layer.splitlora_B["default"].detach().abs().max()) == 0.0
    # shares of task t's 4 directions ~ (0.52, 0.29, 0.13, 0.06) / (t + 1) against a threshold 0.083 / (t + 1):
    # about 3 directions pass at t = 0 and each later task adds about 3 of its own
    assert all(b >= a + 2 for a, b in zip(primaries, primaries[1:])), primaries
    assert primaries[0] >= 3 and primaries[-1] >= 10, primaries


def test_end_task_keeps_outputs_and_stacks_then_densifies_the_old_delta():
    config = SplitLoRAConfig(r=4, target_modules=["lin0"], trade_off=2.0)
    model = _peft(config, n_in=8, width=8)
    layer = _layers(model)["lin0"]
    g = _gen(5)
    x = torch.randn(40, 8, generator=g)
    for t in range(3):
        model.begin_task()
        _train(model, x, torch.randn(40, 5, generator=g), steps=10)
        with torch.no_grad():
            before = model(x)
            delta_before = layer.get_delta_weight("default").clone()
        _finish(model, x)
        with torch.no_grad():
            torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(layer.get_delta_weight("default"), delta_before, rtol=1e-5, atol=1e-6)
        state = model.task_state()["lin0"]
        # stacked rank 4 * (8 + 8) = 64 is not more than 8 * 8 = 64; rank 8 would be, so it is densified
        assert (state["old_rank"], state["old_dense"]) == ((4, False) if t == 0 else (0, True)), (t, state)


def test_lifecycle_misuse_is_refused_without_changing_anything(tmp_path):
    model = _peft(SplitLoRAConfig(r=2, target_modules=["lin0"]))
    layer = _layers(model)["lin0"]
    x = torch.randn(10, 64)
    with pytest.raises(ValueError, match=r"inside `collect_statistics\(\)` before `end_task\(\)`"):
        model.end_task()
    with torch.no_grad(), model.collect_statistics():
        model(x)
    with pytest.raises(ValueError, match=r"end_task\(\) was not called"):
        model.begin_task()
    with pytest.raises(ValueError, match=r"not saved .*call end_task\(\) before saving"):
        model.save_sequence_state(tmp_path)
    assert not (tmp_path / SEQUENCE_STATE_FILE).exists()
    model.end_task()
    model.merge_adapter()
    with pytest.raises(ValueError, match=r"merged into the base weights"):
        model.begin_task()
    model.unmerge_adapter()
    state = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        layer.splitlora_B["default"].fill_(float("nan"))
        with model.collect_statistics():
            model(x)
    with pytest.raises(ValueError, match=r"on .lin0. has non-finite values .* end_task changed nothing"):
        model.end_task()
    for key in ("old_A", "old_B", "old_dense", "A"):
        full = f"base_model.model.lin0.splitlora_{key}.default"
        assert torch.equal(model.state_dict()[full], state[full]), key
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        model.end_task("nope")


@pytest.mark.parametrize("statistics", ["dense", "sketch"])
def test_adapter_checkpoint_holds_only_what_inference_needs(tmp_path, statistics):
    config = SplitLoRAConfig(r=3, target_modules=["lin0", "lin1"], statistics=statistics, sketch_rank=8)
    model = _peft(config, n_in=24, width=32)
    for x, y in _subspace_tasks(2, n_in=24, rows=40):
        model.begin_task()
        _train(model, x, y, steps=4)
        _finish(model, x)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    kinds = {key.split(".")[-1] for key in saved}
    assert kinds == {
        "splitlora_A",
        "splitlora_B",
        "splitlora_old_A",
        "splitlora_old_B",
        "splitlora_old_dense",
        "splitlora_tasks",
    }, kinds
    assert not (tmp_path / SEQUENCE_STATE_FILE).exists()  # only on request
    path = model.save_sequence_state(tmp_path)
    extra = load_file(path)
    expected = {"splitlora_tasks", "splitlora_tokens", "splitlora_energy", "splitlora_primary"}
    expected |= {"splitlora_cov"} if statistics == "dense" else {"splitlora_sketch", "splitlora_sketch_error"}
    assert {key.split(".")[-1] for key in extra} == expected
    # loading the inference checkpoint raises no "missing adapter keys" warning and gives the same outputs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = PeftModel.from_pretrained(MLP(n_in=24, width=32), tmp_path)
    x = torch.randn(7, 24)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_sequence_state_load_is_checked_and_all_or_nothing(tmp_path):
    config = SplitLoRAConfig(r=3, target_modules=["lin0", "lin1"])
    tasks = _subspace_tasks(2, n_in=24, rows=40)
    model = _peft(config, n_in=24, width=32)
    with pytest.raises(FileNotFoundError, match="no SplitLoRA sequence state at .*save_sequence_state"):
        model.load_sequence_state(tmp_path)
    model.begin_task()
    _train(model, *tasks[0], steps=4)
    _finish(model, tasks[0][0])
    model.save_sequence_state(tmp_path / "one")  # after 1 task
    model.begin_task()
    _train(model, *tasks[1], steps=4)
    _finish(model, tasks[1][0])
    model.save_pretrained(tmp_path / "two")
    model.save_sequence_state(tmp_path / "two")
    resumed = PeftModel.from_pretrained(MLP(n_in=24, width=32), tmp_path / "two", is_trainable=True)
    before = {k: v.clone() for k, v in resumed.state_dict().items()}
    with pytest.raises(ValueError, match=r"saved after 1 finished task\(s\), but adapter 'default' on .* has 2"):
        resumed.load_sequence_state(tmp_path / "one")
    assert all(torch.equal(v, before[k]) for k, v in resumed.state_dict().items())
    resumed.load_sequence_state(tmp_path / "two")
    got, want = resumed.state_dict(), model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want if "splitlora_" in k)
    # a second adapter's state goes to its own subfolder, like save_pretrained's
    resumed.add_adapter("other", config)
    resumed.set_adapter("other")
    resumed.begin_task("other")
    _train(resumed, *tasks[0], steps=2)
    _finish(resumed, tasks[0][0])
    path = resumed.save_sequence_state(tmp_path / "two", adapter_name="other")
    assert path == str(tmp_path / "two" / "other" / SEQUENCE_STATE_FILE)


def test_checkpoint_with_statistics_inside_still_continues(tmp_path):
    """Checkpoints written before the split kept the statistics in adapter_model.safetensors: they still load whole."""
    model = _peft(SplitLoRAConfig(r=3, target_modules=["lin0"]), n_in=24, width=32)
    x, y = _subspace_tasks(1, n_in=24, rows=40)[0]
    model.begin_task()
    _train(model, x, y, steps=4)
    _finish(model, x)
    model.save_pretrained(tmp_path)
    old_format = {k.removesuffix(".default"): v for k, v in model.state_dict().items() if ".splitlora_" in k}
    save_file({k: v.contiguous() for k, v in old_format.items()}, str(tmp_path / "adapter_model.safetensors"))
    resumed = PeftModel.from_pretrained(MLP(n_in=24, width=32), tmp_path, is_trainable=True)
    got, want = resumed.state_dict(), model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want if "splitlora_" in k)
    assert resumed.begin_task() == 1


def test_inference_only_load_refuses_to_continue(tmp_path):
    model = _peft(SplitLoRAConfig(r=2, target_modules=["lin0"]))
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(MLP(), tmp_path)
    with pytest.raises(ValueError, match="is_trainable=True"):
        loaded.begin_task()


@pytest.mark.parametrize("statistics", ["dense", "sketch"])
@pytest.mark.parametrize("stop", ["between_tasks", "after_training"])
def test_save_load_mid_sequence_continues_exactly(tmp_path, statistics, stop):
    config = SplitLoRAConfig(r=3, target_modules=["lin0", "lin1"], trade_off=5.0, statistics=statistics, sketch_rank=8)
    tasks = _subspace_tasks(3, n_in=24, rows=60)

    def run(model: PeftModel, start: int, stop_at: str | None) -> PeftModel:
        for t in range(start, 3):
            x, y = tasks[t]
            if not (stop_at == "resume_after_training" and t == start):
                model.begin_task()
                _train(model, x, y, steps=8)
            if t == 1 and stop_at == "after_training":
                return model
            _finish(model, x)
            if t == 1 and stop_at == "between_tasks":
                return model
        return model

    straight = run(get_peft_model(MLP(n_in=24, width=32), config), 0, None)
    first = run(get_peft_model(MLP(n_in=24, width=32), config), 0, stop)
    first.save_pretrained(tmp_path)
    first.save_sequence_state(tmp_path)
    resumed = PeftModel.from_pretrained(MLP(n_in=24, width=32), tmp_path, is_trainable=True)
    assert resumed.finished_tasks() == (2 if stop == "between_tasks" else 1)
    with pytest.raises(ValueError, match=r"loaded without its sequence state .* model.load_sequence_state"):
        resumed.begin_task() if stop == "between_tasks" else resumed.end_task()
    resumed.load_sequence_state(tmp_path)
    run(resumed, 2 if stop == "between_tasks" else 1, "resume_after_training" if stop == "after_training" else None)
    x = torch.cat([t[0] for t in tasks])
    with torch.no_grad():
        assert torch.equal(resumed(x), straight(x))
    expected = {k: v for k, v in straight.state_dict().items() if "splitlora_" in k}
    got = resumed.state_dict()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert resumed.task_state()["lin0"]["tasks"] == 3


# --- measured stability ---------------------------------------------------------------------------------------------


def test_old_task_outputs_move_much_less_than_with_plain_lora():
    """Train task 0, then task 1 on inputs from another subspace, with the same optimizer, rate and steps; compare
    how far the outputs on held-out task-0 inputs move while task 1 is learned."""
    (x0_all, y0_all), (x1, y1) = _subspace_tasks(2, n_in=24, rows=160)
    x0, y0, x0_test = x0_all[:120], y0_all[:120], x0_all[120:]
    # a = 0.5 with d = 24 and 32: directions above ~2-4% of the energy are primary, the tail of tanh features too
    config = SplitLoRAConfig(r=4, target_modules=["lin0", "lin1"], trade_off=0.5)
    split = get_peft_model(MLP(n_in=24, width=32), config)
    split.begin_task()
    _train(split, x0, y0, steps=60)
    _finish(split, x0)
    lora = get_peft_model(MLP(n_in=24, width=32), LoraConfig(r=4, lora_alpha=4, target_modules=["lin0", "lin1"]))
    _train(lora, x0, y0, steps=60)

    drift, learned = {}, {}
    for name, model in (("splitlora", split), ("lora", lora)):
        with torch.no_grad():
            before_old = model(x0_test)
            start_loss = float((model(x1) - y1).pow(2).mean())
        if name == "splitlora":
            model.begin_task()
        learned[name] = 1 - _train(model, x1, y1, steps=60) / start_loss
        with torch.no_grad():
            drift[name] = float((model(x0_test) - before_old).norm() / before_old.norm())
    assert learned["splitlora"] > 0.3, learned  # it does learn the new task (LoRA: ~0.8; B alone on a fixed A: ~0.4)
    assert drift["lora"] > 0.5, drift  # plain LoRA really moves task 0's outputs
    assert drift["splitlora"] < 0.15 * drift["lora"], drift


# --- config and registration ----------------------------------------------------------------------------------------


def test_registered_with_peft_and_round_trips_through_json():
    assert peft_ext.registered_peft_types()["splitlora"] is SPLITLORA is PeftType.SPLITLORA
    config = SplitLoRAConfig(r=4, target_modules=["lin0"], trade_off=7.5, statistics="sketch", sketch_rank=32)
    data = json.loads(json.dumps({**config.to_dict(), "target_modules": ["lin0"]}))
    loaded = PeftConfig.from_peft_type(**data)
    assert type(loaded) is SplitLoRAConfig and loaded.peft_type is SPLITLORA
    assert (loaded.trade_off, loaded.statistics, loaded.sketch_rank) == (7.5, "sketch", 32)
    assert isinstance(get_peft_model(MLP(), config).base_model, SplitLoRAModel)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"r": 0}, ValueError, r"`r` must be a positive integer, got 0"),
        ({"trade_off": -1.0}, ValueError, r"`trade_off` must be a positive finite number, got -1.0"),
        ({"trade_off": float("inf")}, ValueError, r"`trade_off` must be a positive finite number"),
        ({"trade_off": "20"}, TypeError, r"`trade_off` must be a number, got str '20'"),
        ({"statistics": "exact"}, ValueError, r"`statistics` must be one of \('auto', 'dense', 'sketch'\)"),
        ({"sketch_rank": 0}, ValueError, r"`sketch_rank` must be a positive integer, got 0"),
        ({"init_scaling": "paper"}, ValueError, r"`init_scaling` must be one of \('inverse_task', 'constant'\)"),
        ({"target_modules": ".*lin.*", "layers_to_transform": [0]}, ValueError, "layers_to_transform"),
    ],
)
def test_config_errors_name_the_value_and_what_is_valid(kwargs, error, message):
    with pytest.raises(error, match=message):
        SplitLoRAConfig(**{"target_modules": ["lin0"], **kwargs})


def test_rank_above_the_input_width_and_unsupported_modules_are_refused():
    with pytest.raises(ValueError, match=r"`r` \(9\) must be at most the input width of 'lin0' \(8\)"):
        _peft(SplitLoRAConfig(r=9, target_modules=["lin0"]), n_in=8)

    class WithConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 2, 1)

        def forward(self, x):
            return self.conv(x)

    with pytest.raises(ValueError, match=r"SplitLoRA supports torch.nn.Linear, .* the target 'conv' is a Conv1d"):
        get_peft_model(WithConv(), SplitLoRAConfig(r=1, target_modules=["conv"]))


# --- the PEFT tuner contract -----------------------------------------------------------------------------------------


def _mlp_config(identity: bool) -> SplitLoRAConfig:
    return SplitLoRAConfig(r=3, target_modules=["lin0", "lin1"], modules_to_save=["head"], init_weights=identity)


def _bert_config(identity: bool) -> SplitLoRAConfig:
    return SplitLoRAConfig(
        r=2, target_modules=["query", "value"], init_weights=identity, statistics="sketch", sketch_rank=8
    )


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


CASES = {
    "mlp": TunerCase(
        name="mlp",
        make_model=MLP,
        make_config=_mlp_config,
        make_inputs=lambda: {"x": torch.randn(6, 64, generator=_gen(3))},
        make_optimizer=_adamw,
        prefix="splitlora_",
        modules_to_save=("head",),
    ),
    "tiny_bert_sketch": TunerCase(
        name="tiny_bert_sketch",
        make_model=lambda: tiny_bert(hidden_size=64, num_layers=1),
        make_config=_bert_config,
        make_inputs=lambda: {"input_ids": torch.randint(0, 128, (4, 7), generator=_gen(3))},
        make_optimizer=_adamw,
        prefix="splitlora_",
        quantize=("query", "value"),
        atol=1e-4,
    ),
}


test_tuner_contract = contract_test(CASES)


def test_contract_holds_with_finished_tasks(tmp_path):
    """Merge/unmerge, disable, mixed batches and save/load include the folded old-task delta, not just B A."""
    model = _peft(SplitLoRAConfig(r=3, target_modules=["lin0", "lin1"], trade_off=5.0))
    tasks = _subspace_tasks(3, n_in=64, rows=40)
    for x, y in tasks[:2]:
        model.begin_task()
        _train(model, x, y, steps=5)
        _finish(model, x)
    model.begin_task()
    _train(model, *tasks[2], steps=5)
    x = torch.cat([t[0] for t in tasks])
    base_out = MLP().eval()(x).detach()
    with torch.no_grad():
        adapted = model(x)
        assert (adapted - base_out).abs().max() > 1e-2
        weights = {k: v.clone() for k, v in model.state_dict().items() if "base_layer" in k}
        model.merge_adapter(safe_merge=True)
        torch.testing.assert_close(model(x), adapted, rtol=1e-4, atol=1e-5)
        model.unmerge_adapter()
        for key, value in weights.items():
            torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=1e-6)
        with model.disable_adapter():
            torch.testing.assert_close(model(x), base_out)
        mixed = model(x[:3], adapter_names=["default", "__base__", "default"])
        torch.testing.assert_close(mixed[1], base_out[1])
        torch.testing.assert_close(mixed[[0, 2]], adapted[[0, 2]])
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(MLP(), tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x), adapted)
        torch.testing.assert_close(loaded.merge_and_unload()(x), adapted, rtol=1e-4, atol=1e-5)


# --- the continual plugins -------------------------------------------------------------------------------------------

FAST = TrainConfig(epochs=2, batch_size=8, progress=False, device="cpu")


@pytest.fixture(scope="module")
def seq():
    return token_sequence()


def _ctx(seq) -> RunContext:
    return RunContext(sequence=seq, train=FAST, collate=stack_collate, device=torch.device("cpu"))


def test_splitlora_method_runs_the_lifecycle_and_trains_only_B_and_the_head(seq):
    adapter = {"r": 2, "trade_off": 5.0, "target_modules": QUERY_VALUE}
    method = get_continual_method("splitlora")(lr=5e-3, adapter=adapter)
    result = run_sequence(seq, method, tiny_classifier(seq.num_classes), stack_collate, FAST)
    # the first two tasks are learned (the third's accuracy right after training is dominated by class-incremental
    # bias towards the previous task's logits at 2 epochs, for every method including frozen_linear)
    assert min(result.accuracy_matrix[0][0], result.accuracy_matrix[1][1]) > 0.8, result.accuracy_matrix
    # per adapted module only B (32 x 2) trains; plus the head copy (modules_to_save)
    head = 32 * seq.num_classes + seq.num_classes
    assert result.trainable_params == 2 * 2 * 32 * 2 + head


def test_splitlora_statistics_skip_padding(seq):
    """The method's statistics count only real tokens: the attention mask reaches the hooks."""
    method = get_continual_method("splitlora")(adapter={"r": 2, "target_modules": ["query"]})
    ctx = _ctx(seq)
    model = method.build(tiny_classifier(seq.num_classes), ctx)
    padded = [
        type(ex)(torch.cat([ex.inputs, torch.zeros(3, dtype=torch.long)]), ex.label) for ex in seq.tasks[0].train
    ]

    def collate(examples):
        batch = stack_collate(examples)
        batch["attention_mask"][:, -3:] = 0
        return batch

    ctx.collate = collate
    task = type(seq.tasks[0])(seq.tasks[0].name, seq.tasks[0].classes, padded, seq.tasks[0].test)
    method.before_task(model, 0, task, ctx)
    method.after_task(model, 0, task, ctx)
    tokens = {v["tokens"] for v in model.task_state().values()}
    assert tokens == {len(padded) * 8}, tokens


@pytest.mark.parametrize("name", ["inflora", "olora", "osf"])
def test_rewrapping_baselines_keep_the_finished_task(name, seq):
    """Folding task t and wrapping task t+1's fresh adapter must not change the model's function."""
    options = {"adapter": lora_adapter(8)} if name == "olora" else {}  # inflora and osf keep flat options
    method = get_continual_method(name)(lr=5e-3, **options)
    ctx = _ctx(seq)
    model = method.build(tiny_classifier(seq.num_classes), ctx)
    x = torch.stack([ex.inputs for ex in seq.tasks[0].test])
    inputs = {"input_ids": x, "attention_mask": torch.ones_like(x)}
    model = method.before_task(model, 0, seq.tasks[0], ctx)
    from peft_ext.continual.runner import train_examples

    train_examples(model, method, seq.tasks[0].train, seq.tasks[0].classes, 0, ctx)
    model = method.after_task(model, 0, seq.tasks[0], ctx)
    model.eval()
    with torch.no_grad():
        before = model(**inputs).logits
    model = method.before_task(model, 1, seq.tasks[1], ctx)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before, rtol=1e-4, atol=1e-5)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("classifier" in n for n in trainable) and any(("lora_" in n or "osf_" in n) for n in trainable)


def test_inflora_A_avoids_the_memory_and_gpm_grows_it():
    g = _gen(8)
    n = 20
    basis = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64)).Q
    old = basis[:, :5] @ torch.diag(torch.tensor([9.0, 6, 4, 0.05, 0.01], dtype=torch.float64)) @ basis[:, :5].T
    memory = gpm_update(None, old, threshold=0.95)
    # energy = squared eigenvalues: 81/(81+36+16+...) -> the first two reach 0.88 < 0.95 < 0.99 with three
    assert memory.shape == (n, 2)
    torch.testing.assert_close(memory @ memory.T, basis[:, :2] @ basis[:, :2].T, rtol=0, atol=1e-10)
    new = basis[:, 1:4] @ torch.diag(torch.tensor([5.0, 3, 1], dtype=torch.float64)) @ basis[:, 1:4].T
    a = inflora_A(new, memory, r=2)
    assert float((a @ memory).norm()) < 1e-10
    torch.testing.assert_close(a.norm(dim=1), torch.full((2,), 1 / math.sqrt(3), dtype=torch.float64))
    grown = gpm_update(memory, new, threshold=0.99)
    assert grown.shape[1] > 2
    torch.testing.assert_close(grown.T @ grown, torch.eye(grown.shape[1], dtype=torch.float64), rtol=0, atol=1e-10)


def test_input_covariances_match_a_manual_computation(seq):
    ctx = _ctx(seq)
    model = tiny_classifier(seq.num_classes)
    names = [n for n, m in model.named_modules() if n.endswith(".query")]
    covs = input_covariances(model, ["query"], seq.tasks[0].train, ctx)
    assert sorted(covs) == sorted(names) and len(names) == 2
    rows = []
    first = model.get_submodule(names[0])
    handle = first.register_forward_pre_hook(lambda m, a: rows.append(a[0].reshape(-1, a[0].shape[-1])))
    x = torch.stack([ex.inputs for ex in seq.tasks[0].train])
    with torch.no_grad():
        model.eval()(input_ids=x, attention_mask=torch.ones_like(x))
    handle.remove()
    r = torch.cat(rows).to(torch.float64)
    torch.testing.assert_close(covs[names[0]], r.T @ r / r.shape[0], rtol=1e-5, atol=1e-6)  # float32 sums


def test_osf_preserved_share_grows_over_the_sequence():
    method = get_continual_method("osf")(preserved_start=0.5, preserved_end=0.9)
    assert [round(method.preserved_share(t, 5), 3) for t in range(5)] == [0.5, 0.6, 0.7, 0.8, 0.9]
    with pytest.raises(ValueError, match=r"`preserved_end` \(0.4\) must be >= `preserved_start` \(0.5\)"):
        get_continual_method("osf")(preserved_start=0.5, preserved_end=0.4)


def test_method_options_are_validated():
    with pytest.raises(ValueError, match=r"`trade_off` must be a positive finite number, got 0.0"):
        get_continual_method("splitlora")(adapter={"trade_off": 0.0})
    with pytest.raises(ValueError, match=r"`threshold_start` must be in \(0, 1\], got 1.5"):
        get_continual_method("inflora")(threshold_start=1.5)
    with pytest.raises(ValueError, match=r"`lambda_orth` must be >= 0, got -1"):
        get_continual_method("olora")(lambda_orth=-1)


@pytest.mark.slow
def test_on_real_minilm_splitlora_forgets_far_less_than_sequential_lora():
    """Three WordNet tasks on the real pretrained MiniLM-L6: SplitLoRA keeps old tasks where plain LoRA forgets, and
    what it learns there comes through its adapter.

    With its head trained, SplitLoRA scores about what the frozen backbone's head alone scores (final 0.678 against
    frozen_linear's 0.672, measured), and with its adapter's update zeroed it *is* frozen_linear, to the last digit:
    no bound on that run can tell a dead adapter. So the learning is checked with the head frozen at its random init:
    the first task, at the same rate and epochs, through B alone (measured 0.63; the dead adapter 0.35, chance 1/3).
    """
    from peft_ext.data import wordnet_task_sequence
    from peft_ext.data.collate import TextCollator
    from peft_ext.data.tasks import TaskSequence
    from peft_ext.models import load_text_classifier

    sequence = wordnet_task_sequence(n_tasks=3, classes_per_task=3, seed=0, train_per_class=32, test_per_class=20)
    base, tokenizer = load_text_classifier("minilm", sequence.num_classes)
    train = TrainConfig(epochs=2, batch_size=32, seed=0, progress=False, device="cpu")
    collate = TextCollator(tokenizer, 32)
    split_options = {"lr": 5e-3, "adapter": {"r": 10, "target_modules": QUERY_VALUE}}
    results = {}
    for name, options in (
        # 3e-3: at 1e-3 plain LoRA barely learns the later tasks in 2 epochs, so it has little to forget
        ("seq_lora", {"lr": 3e-3, "adapter": lora_adapter(10, lora_alpha=20.0)}),
        ("splitlora", split_options),
    ):
        method = get_continual_method(name)(**options)
        results[name] = run_sequence(sequence, method, base, collate, train)
    split, plain = results["splitlora"], results["seq_lora"]
    assert plain.metrics["forgetting"] > 0.2, plain.accuracy_matrix
    assert split.metrics["forgetting"] < 0.5 * plain.metrics["forgetting"], (split.metrics, plain.metrics)
    assert split.metrics["final_acc"] > plain.metrics["final_acc"], (split.metrics, plain.metrics)

    first = TaskSequence(sequence.name, sequence.class_names, sequence.tasks[:1])
    for live, low, high in ((True, 0.5, 1.0), (False, 0.0, 0.45)):
        method = training_only(get_continual_method("splitlora")(**split_options), head=False)
        if not live:
            method = dead_adapter(method, ("splitlora_B",))
        accuracy = run_sequence(first, method, base, collate, train).accuracy_matrix[0][0]
        assert low <= accuracy <= high, (live, accuracy)


def test_modules_fed_the_same_input_share_one_product():
    """q/k/v (and gate/up) read the same tensor: they hold one accumulator, so one x^T x serves them all, and every
    module's statistics still equal its own inputs' sum (padding excluded)."""
    from peft_ext.models import tiny_llama

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(tiny_llama(hidden_size=32), SplitLoRAConfig(r=2, target_modules=targets))
    layers = {key: layer for key, layer in _layers(model).items()}
    seen: dict[str, torch.Tensor] = {}
    current: dict[str, torch.Tensor] = {}
    for key, layer in layers.items():

        def record(module, args, key=key):
            rows = args[0][current["mask"].bool()]
            seen[key] = seen.get(key, 0) + rows.double().T @ rows.double()

        layer.register_forward_pre_hook(record)
    products = []
    original = splitlora_covariance.accumulate_covariance_lower

    def spy(cov_sum, rows):
        products.append(rows.shape)
        return original(cov_sum, rows)

    batches = padded_batches(0, 3, (2, 6), pad_from=4)
    with patch.object(statistics_module, "accumulate_covariance_lower", spy), torch.no_grad():
        with model.collect_statistics():
            for ids, mask in batches:
                current["mask"] = mask
                model(input_ids=ids, attention_mask=mask)
    # per layer and batch: one product for q/k/v, o, gate/up, down
    assert len(products) == 3 * 2 * 4, len(products)
    groups = [[key.rsplit(".", 1)[-1] for key in group] for group in model.statistics_groups()]
    assert groups == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]] * 2
    for key, layer in layers.items():
        pending = layer.reduced_statistics("default")  # the dense sum mirrored from its lower triangle
        assert int(pending["tokens"]) == 3 * 10, key
        torch.testing.assert_close(pending["cov"].double(), seen[key], rtol=1e-5, atol=1e-5)
