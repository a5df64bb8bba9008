"""DCT-AdamW's SVD-free family (peft_ext.optim.subspace): the power-iteration basis, plain coordinates, APOLLO's
channel-scaled update; against independent references (SVD, brute force, the formulas), exact resume, errors; and
the family's structure: SubspaceAdamW the general optimizer, DCTAdamW its preset, bases and update rules as objects."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from peft_ext import SubspaceAdamW
from peft_ext.optim import OPTIMIZERS, DCTAdamW
from peft_ext.optim.bases import CoordinateBasis, DCTBasis, PowerBasis, SubspaceBasis
from peft_ext.optim.components import REGISTRY
from peft_ext.optim.subspace import (
    channel_scaled_update,
    coordinate_select,
    limit_norm_growth,
    power_refresh,
    rotate_by_overlap,
)
from peft_ext.optim.update_rules import ChannelUpdate, ProjectedUpdate, UpdateRule

VARIANTS = [
    {"basis": "power"},
    {"basis": "coordinates"},
    {"basis": "power", "update": "channel"},
    {"basis": "dct", "update": "channel"},
]


def _principal_angle_deg(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest principal angle between the row spaces of two (r, n) orthonormal bases."""
    s = torch.linalg.svdvals(a.double() @ b.double().T)
    return math.degrees(math.acos(min(1.0, float(s.min()))))


@pytest.mark.parametrize("side", ["right", "left"])
def test_power_iteration_finds_the_top_singular_subspace(side):
    gen = torch.Generator().manual_seed(0)
    # singular values 5, 4, 3, 2.5 | 2.2, 2.0, ...: a modest gap, so one iteration is not enough
    s = torch.tensor([5.0, 4.0, 3.0, 2.5] + [2.2 * 0.9**k for k in range(60)])
    u = torch.linalg.qr(torch.randn(96, 64, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(64, 64, generator=gen))[0]
    g = (u * s) @ v.T
    top = v[:, :4].T if side == "right" else u[:, :4].T
    n = 64 if side == "right" else 96
    basis = torch.linalg.qr(torch.randn(n, 4, generator=gen))[0].T.contiguous()
    angles = []
    for _ in range(20):
        basis = power_refresh(g, basis, side)
        angles.append(_principal_angle_deg(basis, top))
    torch.testing.assert_close(basis @ basis.T, torch.eye(4), atol=1e-5, rtol=0)
    assert all(b <= a + 1e-3 for a, b in zip(angles, angles[1:])), angles  # each warm-started step gets closer
    assert angles[-1] < 1.0 and angles[-1] < angles[0] / 20, angles
    # deterministic signs: the same input gives the same basis
    assert torch.equal(power_refresh(g, basis, side), power_refresh(g, basis, side))


def test_power_refresh_keeps_the_basis_on_a_zero_gradient():
    basis = torch.eye(3, 8)
    assert torch.equal(power_refresh(torch.zeros(5, 8), basis, "right"), basis)


def test_coordinate_select_is_the_brute_force_top_columns():
    g = torch.randn(20, 12, generator=torch.Generator().manual_seed(1))
    for norm in (1.0, 2.0, math.inf):
        indices, low = coordinate_select(g, 5, "right", norm)
        scores = torch.linalg.vector_norm(g, ord=norm, dim=0)
        assert set(indices.tolist()) == set(torch.argsort(scores, descending=True)[:5].tolist())
        assert torch.equal(low, g[:, indices]) and indices.tolist() == sorted(indices.tolist())
    rows, low = coordinate_select(g.T, 4, "left")
    assert torch.equal(low, g.T[rows])
    with pytest.raises(ValueError, match=r"`rank` must be in \[1, 12\]"):
        coordinate_select(g, 13, "right")


def test_rotating_moments_by_the_overlap_re_expresses_them():
    """A new basis that permutes and flips the old one: the first moment is the same vector in new coordinates."""
    old = torch.linalg.qr(torch.randn(10, 3))[0].T
    perm = torch.tensor([[0.0, -1, 0], [0, 0, 1], [1, 0, 0]])
    new = perm @ old
    m, v = torch.randn(7, 3), torch.rand(7, 3)
    m2, v2 = rotate_by_overlap(m, v, old, new, "right")
    torch.testing.assert_close(m2 @ new, m @ old)  # same full-space first moment
    torch.testing.assert_close(v2, v @ (perm.T * perm.T))  # second moment follows |overlap|^2
    assert bool((v2 >= 0).all())
    m3, _ = rotate_by_overlap(m.T, v.T, old, new, "left")
    torch.testing.assert_close(new.T @ m3, old.T @ m.T)


def test_channel_update_is_apollos_formula():
    g = torch.randn(6, 9)
    low, direction = torch.randn(6, 3), torch.randn(6, 3)
    low[2] = 0
    out = channel_scaled_update(g, low, direction, "right")
    expected = g * (direction.norm(dim=1) / low.norm(dim=1)).nan_to_num(0.0, posinf=0.0).unsqueeze(1)
    expected[2] = 0
    torch.testing.assert_close(out, expected)
    out = channel_scaled_update(g.T, low.T, direction.T, "left")
    torch.testing.assert_close(out.T, expected)


def test_norm_growth_limiter():
    state: dict = {}
    first = limit_norm_growth(torch.ones(4), state, 1.01)
    assert torch.equal(first, torch.ones(4)) and float(state["update_norm"]) == pytest.approx(2.0)
    capped = limit_norm_growth(10 * torch.ones(4), state, 1.01)
    assert float(capped.norm()) == pytest.approx(2.02)
    assert limit_norm_growth(torch.ones(2), {}, None).tolist() == [1.0, 1.0]


def _train(options: dict, steps: int, resume_at: int | None = None, dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4)).to(dtype)
    gen = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(steps, 8, 16, generator=gen).to(dtype), torch.randint(0, 4, (steps, 8), generator=gen)
    make = lambda m: DCTAdamW(m.named_parameters(), lr=1e-2, rank=3, update_proj_gap=2, **options)  # noqa: E731
    opt = make(model)
    for t in range(steps):
        if t == resume_at:  # save both, rebuild from scratch, load (weights_only) and go on
            blob = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
            blob.seek(0)
            saved = torch.load(blob, weights_only=True)
            torch.manual_seed(123)
            model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4)).to(dtype)
            model.load_state_dict(saved["model"])
            opt = make(model)
            opt.load_state_dict(saved["opt"])
        loss = nn.functional.cross_entropy(model(xs[t]).float(), ys[t])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt, loss.item()


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: "-".join(o.values()))
def test_each_variant_trains_and_resumes_exactly(options):
    straight, opt, loss = _train(options, 9)
    resumed, _, _ = _train(options, 9, resume_at=5)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    state = opt.state[straight[0].weight]
    assert state["exp_avg"].shape == (24, 3)  # 24 x 16: the 16 columns are compressed to 3
    if options["basis"] == "power":
        torch.testing.assert_close(state["basis"] @ state["basis"].T, torch.eye(3), atol=1e-5, rtol=0)
        assert "indices" not in state
    first = _train(options, 1)[2]
    assert math.isfinite(loss) and loss < first


def test_bf16_keeps_an_fp32_basis_through_a_reload():
    model, opt, _ = _train({"basis": "power"}, 4, resume_at=2, dtype=torch.bfloat16)
    state = opt.state[model[0].weight]
    assert state["basis"].dtype == torch.float32 and state["exp_avg"].dtype == torch.float32


def test_subspace_adamw_defaults_and_registry():
    model = nn.Linear(8, 6)
    opt = SubspaceAdamW(model.named_parameters(), rank=2)
    assert opt.defaults["basis"] == "power" and opt.defaults["update_proj_gap"] == 50
    assert OPTIMIZERS["subspace_adamw"] is SubspaceAdamW
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    assert opt.state[model.weight]["basis"].shape == (2, 6)  # 6 x 8 is wider than tall: the rows are compressed


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"basis": "svd"}, ValueError, r"`basis` must be one of \('dct', 'coordinates', 'power'\) .*got 'svd'"),
        ({"basis": "powr"}, ValueError, r"did you mean 'power'\?"),
        ({"update": "full"}, ValueError, r"`update` must be one of \('projected', 'channel'\) .*got 'full'"),
        ({"update": "channel", "error_feedback": True}, TypeError, "no residual to feed back"),
        ({"basis": "power", "column_bias_correction": True}, TypeError, "no columns to age"),
        ({"basis": "coordinates", "dct_method": "fft"}, TypeError, r"`dct_method` is not an option of basis 'coord"),
        ({"norm_growth_limit": 0.5}, TypeError, r"not an option of update 'projected'; it is .* update 'channel'"),
        ({"update": "channel", "norm_growth_limit": 0.5}, ValueError, r"`norm_growth_limit` must be None or a finite"),
        ({"dct_method": "svd"}, ValueError, r"`dct_method` must be one of \('auto', 'matmul', 'fft'\), got 'svd'"),
        ({"rnak": 2}, TypeError, r"unexpected keyword argument 'rnak' \(did you mean 'rank'\?\)"),
        ({"basis": DCTBasis(), "dct_method": "fft"}, TypeError, "pass them to its constructor"),
        ({"basis": ChannelUpdate()}, TypeError, "`basis` must be a basis object or name"),
        ({"error_feedback_8bit": True}, ValueError, "needs `error_feedback=True`"),
    ],
)
def test_bad_options_are_named(options, error, message):
    with pytest.raises(error, match=message):
        DCTAdamW(nn.Linear(4, 4).parameters(), **options)


def test_each_part_validates_its_own_options_where_it_is_built():
    with pytest.raises(ValueError, match="`selection_norm` must be a positive number"):
        CoordinateBasis(selection_norm=0)
    with pytest.raises(TypeError, match="`column_bias_correction` must be True or False"):
        DCTBasis(column_bias_correction=1)
    assert PowerBasis.option_defaults() == {"selection_norm": 1.0, "dct_method": "auto"}
    assert ChannelUpdate(norm_growth_limit=None).options() == {"norm_growth_limit": None}


def test_objects_and_names_with_options_configure_the_same_optimizer():
    named = list(nn.Linear(8, 6).named_parameters())
    by_name = SubspaceAdamW(named, basis="dct", dct_method="fft", update="channel", norm_growth_limit=None)
    by_object = SubspaceAdamW(named, basis=DCTBasis(dct_method="fft"), update=ChannelUpdate(norm_growth_limit=None))
    assert by_name.defaults == by_object.defaults
    assert by_name.parts(by_name.param_groups[0]) == (DCTBasis(dct_method="fft"), ChannelUpdate(None))
    # a group stores names and options only: no objects in the state dict
    assert by_object.param_groups[0]["basis"] == "dct" and "error_feedback" not in by_object.param_groups[0]


def test_a_group_may_choose_another_basis_and_takes_only_its_options():
    a, b = nn.Linear(8, 6), nn.Linear(6, 4)
    opt = DCTAdamW(
        [{"params": a.parameters()}, {"params": b.parameters(), "basis": "coordinates", "selection_norm": 2.0}],
        rank=2,
        dct_method="fft",
        column_bias_correction=True,
    )
    first, second = opt.param_groups
    assert (first["dct_method"], first["column_bias_correction"]) == ("fft", True)
    assert second["basis"] == "coordinates" and "dct_method" not in second
    assert (second["selection_norm"], second["column_bias_correction"]) == (2.0, False)  # the part's defaults
    with pytest.raises(TypeError, match="`dct_method` is not an option of basis 'coordinates'"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3, 3))], "basis": "coordinates", "dct_method": "fft"})
    assert len(opt.param_groups) == 2
    with pytest.raises(ValueError, match="`nonfinite` applies to the whole optimizer"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3, 3))], "nonfinite": "skip"})


def test_projection_is_the_deprecated_name_of_basis():
    named = list(nn.Linear(8, 6).named_parameters())
    with pytest.warns(DeprecationWarning, match="`projection=` is deprecated; pass `basis=`"):
        opt = SubspaceAdamW(named, projection="coordinates")
    assert opt.defaults["basis"] == "coordinates" and "projection" not in opt.defaults
    # the same rule inside a param group (it was refused there)
    with pytest.warns(DeprecationWarning, match="`projection=` is deprecated; pass `basis=`"):
        group = {"params": [nn.Parameter(torch.randn(6, 4))], "param_names": ["w"], "projection": "dct", "rank": 2}
        opt.add_param_group(group)
    assert opt.param_groups[-1]["basis"] == "dct" and "projection" not in opt.param_groups[-1]


def test_a_state_saved_with_the_projection_key_loads_with_a_deprecation_warning():
    model = nn.Linear(8, 6)
    opt = DCTAdamW(model.named_parameters(), rank=2, update="channel")
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    for group in saved["param_groups"]:  # the layout before `basis`: every part's options in every group
        group["projection"] = group.pop("basis")
        group.update(error_feedback=False, error_feedback_8bit=False)
        del group["nonfinite"], group["sync_indices"]
    fresh = DCTAdamW(model.named_parameters(), rank=2, update="channel")
    with pytest.warns(DeprecationWarning, match="saved with the param-group key `projection`"):
        fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["basis"] == "dct" and "error_feedback" not in fresh.param_groups[0]
    assert fresh.param_groups[0]["nonfinite"] == "raise"
    fresh.step()


# ----------------------------------------------------------------------------------------------------------------
# the family's structure: the general optimizer, its DCT preset, variation in objects


def test_dct_adamw_is_the_dct_preset_of_subspace_adamw():
    assert issubclass(DCTAdamW, SubspaceAdamW)
    named = list(nn.Linear(8, 6).named_parameters())
    dct, general = DCTAdamW(named, rank=2), SubspaceAdamW(named, rank=2)
    assert (dct.defaults["basis"], dct.defaults["update_proj_gap"]) == ("dct", 1)
    assert (general.defaults["basis"], general.defaults["update_proj_gap"]) == ("power", 50)
    assert {k: v for k, v in dct.defaults.items() if k not in ("basis", "update_proj_gap", "dct_method")} == {
        k: v for k, v in general.defaults.items() if k not in ("basis", "update_proj_gap", "dct_method")
    } | {"column_bias_correction": False}


def test_one_registry_names_every_basis_and_update():
    assert tuple(REGISTRY) == ("basis", "update")
    assert tuple(REGISTRY["basis"]) == ("dct", "coordinates", "power")
    assert tuple(REGISTRY["update"]) == ("projected", "channel")
    assert all(issubclass(cls, SubspaceBasis) for cls in REGISTRY["basis"].values())
    assert all(issubclass(cls, UpdateRule) for cls in REGISTRY["update"].values())
    assert REGISTRY["update"]["projected"] is ProjectedUpdate


def test_a_subspace_adamw_warning_names_subspace_adamw():
    model = nn.Linear(8, 6)
    with pytest.warns(UserWarning, match=r"^SubspaceAdamW: `target_modules` \['nope'\]"):
        SubspaceAdamW(model.named_parameters(), rank=2, target_modules=["nope"])
    opt = SubspaceAdamW(model.named_parameters(), rank=9)
    model(torch.randn(3, 8)).sum().backward()
    with pytest.warns(UserWarning, match=r"^SubspaceAdamW: `rank` exceeds .* full power-iteration basis") as caught:
        opt.step()
    assert "DCTAdamW" not in str(caught[0].message) and caught[0].filename == __file__
    p = nn.Parameter(torch.randn(6, 4))
    p.grad = torch.randn(6, 4).to_sparse()
    with pytest.raises(TypeError, match="^SubspaceAdamW does not support sparse gradients"):
        SubspaceAdamW([p], rank=2).step()


class _LeadingCoordinates(CoordinateBasis):
    """A basis the package does not ship: always the first ``r`` coordinates."""

    name = "leading"

    def _select(self, grad, spec):
        indices = torch.arange(spec.rank, device=grad.device)
        return indices, grad.index_select(spec.dim, indices)


def test_a_new_basis_plugs_in_through_the_registry(monkeypatch):
    """The step speaks only the basis vocabulary: a registered basis needs no other change. With every coordinate
    kept, Adam in the coordinate basis is AdamW."""
    monkeypatch.setitem(REGISTRY["basis"], "leading", _LeadingCoordinates)
    torch.manual_seed(0)
    ours, reference = nn.Linear(5, 7), nn.Linear(5, 7)
    reference.load_state_dict(ours.state_dict())
    opt = SubspaceAdamW(ours.parameters(), lr=1e-2, rank=5, basis="leading", weight_decay=0.1)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        x = torch.randn(3, 5)
        for model, optimizer in ((ours, opt), (reference, adamw)):
            optimizer.zero_grad()
            model(x).square().sum().backward()
            optimizer.step()
    assert opt.state[ours.weight]["indices"].tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(ours.weight, reference.weight, rtol=1e-5, atol=1e-6)
