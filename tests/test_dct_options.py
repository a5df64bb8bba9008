"""DCTAdamW's parameter routing (``target_modules``, groups, rank clamping), bad options and non-finite gradients."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from peft_ext.optim import DCTAdamW
from peft_ext.optim.dct_adamw import matches_target

from .single_thread import single_thread  # noqa: F401  (fixture)

B1, B2 = 0.9, 0.999


# One torch thread: with two, torch's OpenMP threads spin-wait after every op while bitsandbytes' CPU kernels (linked
# against the system libgomp, a second OpenMP runtime) want the same cores; the 8-bit tests then ran up to 200x slower
# on the busy 2-core machine (docs/dct_adamw.md). Tiny tensors gain nothing from a second thread anyway.
pytestmark = pytest.mark.usefixtures("single_thread")


# ----------------------------------------------------------------------------------------------------------------
# routing, clamping and bad inputs


def test_matches_target():
    assert matches_target("encoder.layer.0.attention.self.query", ["query"])
    assert matches_target("base_model.model.layer.0.query.lora_A.default", ["query"])
    assert matches_target("encoder.layer.0.attention.self.query", ["self.query"])
    assert not matches_target("model.layers.0.self_attn.query_proj", ["query"])
    assert not matches_target("encoder.layer.0.attention.self.key", ["query", "value"])
    assert matches_target("encoder.layer.3.output.dense", r".*layer\.[0-3]\.output\.dense")
    assert not matches_target("encoder.layer.3.output.dense", r"layer\.[0-3]\.output\.dense")
    assert matches_target("anything", None)


def test_target_modules_on_a_transformers_model():
    from peft_ext.models import tiny_bert

    model = tiny_bert(vocab_size=64, hidden_size=32)
    opt = DCTAdamW(model.named_parameters(), lr=1e-3, rank=4, target_modules=["query", "value"])
    plan = {name: rank for name, _, rank in opt.projection_plan()}
    projected = {name for name, rank in plan.items() if rank is not None}
    expected = {f"bert.encoder.layer.{i}.attention.self.{m}.weight" for i in (0, 1) for m in ("query", "value")}
    assert projected == expected
    assert plan["bert.encoder.layer.0.attention.self.query.weight"] == 4
    regex = DCTAdamW(model.named_parameters(), lr=1e-3, rank=4, target_modules=r".*layer\.1\..*dense")
    assert {n for n, _, r in regex.projection_plan() if r is not None} == {
        "bert.encoder.layer.1.attention.output.dense.weight",
        "bert.encoder.layer.1.intermediate.dense.weight",
        "bert.encoder.layer.1.output.dense.weight",
    }
    everything = DCTAdamW(model.named_parameters(), lr=1e-3, rank=4, max_shape=64)
    plan = {name: rank for name, _, rank in everything.projection_plan()}
    assert plan["bert.embeddings.word_embeddings.weight"] is None, "64 x 32 reaches max_shape=64"
    assert plan["bert.encoder.layer.0.intermediate.dense.weight"] is None, "64 x 32 reaches max_shape=64"
    assert plan["bert.encoder.layer.0.attention.output.dense.weight"] == 4
    assert plan["bert.encoder.layer.0.attention.output.dense.bias"] is None


def test_param_groups_can_override_rank():
    a, b = nn.Parameter(torch.randn(20, 10)), nn.Parameter(torch.randn(20, 10))
    opt = DCTAdamW([{"params": [a]}, {"params": [b], "rank": 6}], lr=1e-3, rank=2)
    a.grad, b.grad = torch.randn(20, 10), torch.randn(20, 10)
    opt.step()
    assert opt.state[a]["exp_avg"].shape == (20, 2) and opt.state[b]["exp_avg"].shape == (20, 6)


def test_rank_above_the_smaller_dimension_is_clamped_with_a_warning():
    named = [
        ("head.weight", nn.Parameter(torch.randn(5, 30, dtype=torch.float64))),
        ("body.weight", nn.Parameter(torch.randn(30, 8, dtype=torch.float64))),
    ]
    opt = DCTAdamW(named, lr=1e-2, rank=8)
    for _, p in named:
        p.grad = torch.randn_like(p)
    with pytest.warns(UserWarning, match=r"`head.weight` \(shape \(5, 30\)\): rank 8 -> 5") as record:
        opt.step()
    assert not any("body.weight" in str(w.message) for w in record), "rank == n is not clamped"
    assert opt.state[named[0][1]]["rank"] == 5 and opt.state[named[0][1]]["exp_avg"].shape == (5, 30)
    assert opt.state[named[1][1]]["rank"] == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # warned once, when the state was created


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rank": 0}, ValueError, "`rank` must be a positive integer, got 0"),
        ({"rank": -3}, ValueError, "`rank` must be a positive integer, got -3"),
        ({"rank": 2.0}, TypeError, "`rank` must be an int, got float"),
        ({"rank": True}, TypeError, "`rank` must be an int, got bool"),
        ({"update_proj_gap": 0}, ValueError, "`update_proj_gap` must be a positive integer"),
        ({"lr": -1.0}, ValueError, "Invalid learning rate: -1.0; `lr` must be a finite number >= 0"),
        ({"lr": float("nan")}, ValueError, "`lr` must be a finite number"),
        ({"eps": -1e-8}, ValueError, "`eps`"),
        ({"weight_decay": -0.1}, ValueError, "`weight_decay`"),
        ({"scale": -1.0}, ValueError, "`scale` must be a finite number >= 0"),
        ({"betas": (1.0, 0.999)}, ValueError, "`betas` must be a pair of numbers in"),
        ({"betas": (0.9,)}, ValueError, "`betas`"),
        ({"max_shape": 0}, ValueError, "`max_shape`"),
        ({"dct_method": "svd"}, ValueError, "`dct_method` must be one of"),
        ({"selection_norm": 0}, ValueError, "`selection_norm` must be a positive number"),
        ({"quant_blocksize": 100}, ValueError, "`quant_blocksize` must be one of"),
        ({"min_8bit_size": 0}, ValueError, "`min_8bit_size`"),
        ({"moments_8bit": 1}, TypeError, "`moments_8bit` must be True or False"),
        ({"error_feedback_8bit": True}, ValueError, "needs `error_feedback=True`"),
        ({"nonfinite": "ignore"}, ValueError, "`nonfinite` must be one of"),
        ({"lr": torch.tensor(0.01)}, ValueError, "lr as a Tensor is not supported by DCTAdamW"),
        ({"sync_indices": "yes"}, TypeError, "`sync_indices` must be None, True or False"),
        ({"target_modules": []}, ValueError, "empty list"),
        ({"target_modules": 5}, TypeError, "`target_modules` must be None, a regex"),
        ({"target_modules": "query("}, ValueError, "not a valid regular expression"),
    ],
)
def test_bad_options_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        DCTAdamW([("w", nn.Parameter(torch.randn(4, 4)))], **kwargs)


def test_bad_parameters_raise():
    with pytest.raises(TypeError, match="came without names"):
        DCTAdamW([nn.Parameter(torch.randn(4, 4))], target_modules=["query"])
    with pytest.raises(ValueError, match="`rank` must be a positive integer, got 0"):
        DCTAdamW([{"params": [nn.Parameter(torch.randn(4, 4))], "rank": 0}])
    with pytest.raises(TypeError, match="floating-point"):
        DCTAdamW([torch.zeros(3, dtype=torch.int64)])
    opt = DCTAdamW([nn.Parameter(torch.randn(4, 4))], rank=2)
    with pytest.raises(ValueError, match="`rank` must be a positive integer, got 0"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], "rank": 0})
    assert len(opt.param_groups) == 1, "a rejected group is not left in the optimizer"
    p = nn.Parameter(torch.randn(6, 4))
    opt = DCTAdamW([p], rank=2)
    p.grad = torch.randn(6, 4).to_sparse()
    with pytest.raises(TypeError, match="sparse gradients"):
        opt.step()
    p.grad = torch.randn(6, 4)
    with pytest.raises(ValueError, match="needs torch.distributed to be initialized"):
        DCTAdamW([p], rank=2, sync_indices=True).step()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_raises_before_anything_changes(bad):
    named = [("a.weight", nn.Parameter(torch.randn(6, 4))), ("b.weight", nn.Parameter(torch.randn(6, 4)))]
    opt = DCTAdamW(named, lr=0.1, rank=2)
    before = [p.detach().clone() for _, p in named]
    named[0][1].grad = torch.randn(6, 4)
    named[1][1].grad = torch.randn(6, 4)
    named[1][1].grad[2, 3] = bad
    with pytest.raises(FloatingPointError, match=r"non-finite gradient .* in `b.weight`"):
        opt.step()
    assert all(torch.equal(b, p) for b, (_, p) in zip(before, named)), "a.weight comes first and must be untouched"
    assert all(not opt.state[p] for _, p in named)


def test_nonfinite_gradient_names_unnamed_parameters_by_group_and_position():
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(3, 2))
    opt = DCTAdamW([{"params": [a]}, {"params": [b], "rank": 1}], rank=2)
    a.grad, b.grad = torch.randn(4, 4), torch.tensor([[0.0, 1.0], [float("inf"), 0.0], [0.0, 0.0]])
    with pytest.raises(FloatingPointError, match=r"parameter 0 of group 1 \(shape \(3, 2\)\)"):
        opt.step()


def test_nonfinite_gradient_skip_policy_skips_the_whole_step():
    torch.manual_seed(0)
    init = torch.randn(6, 4)
    grads = [torch.randn(6, 4) for _ in range(3)]
    p = nn.Parameter(init.clone())
    opt = DCTAdamW([p], lr=0.1, rank=2, nonfinite="skip")
    ref_p = nn.Parameter(init.clone())
    ref = DCTAdamW([ref_p], lr=0.1, rank=2)
    p.grad, ref_p.grad = grads[0].clone(), grads[0].clone()
    opt.step()
    ref.step()
    state_before = copy.deepcopy(opt.state_dict())
    p.grad = torch.full((6, 4), float("nan"))
    with pytest.warns(UserWarning, match="skipping this optimizer step"):
        opt.step()
    assert opt.skipped_steps == 1
    assert torch.equal(p.detach(), ref_p.detach())
    after = opt.state_dict()["state"][0]
    assert all(
        torch.equal(v, state_before["state"][0][k])
        if isinstance(v, torch.Tensor)
        else v == state_before["state"][0][k]
        for k, v in after.items()
    )
    for g in grads[1:]:
        p.grad, ref_p.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.equal(p.detach(), ref_p.detach()), "a skipped step leaves no trace"
