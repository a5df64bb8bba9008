"""LOI: the randomized SVD through backward passes, the LOI point, no m x n gradient, and a 4-bit base."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel, get_peft_model
from torch import nn

from peft_ext import RiemannionConfig
from peft_ext.manifolds import FixedRankPoint, egrad2rgrad, retr_dense, tangent_to_dense
from peft_ext.optim import create_riemannion_optimizer
from peft_ext.tuners.riemannion import backprop_rsvd, find_adapters, initialize_loi

from .allocations import assert_no_allocation_of, record_allocations
from .single_thread import single_thread  # noqa: F401  (fixture)
from .tuner_contract import quantize_linears

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64


class Net(nn.Module):
    """Widths are multiples of 64 so that the same net can be quantized to 4 bits on CPU (see tuner tests)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin0 = nn.Linear(64, 128)
        self.lin1 = nn.Linear(128, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.head(torch.relu(self.lin1(torch.tanh(self.lin0(x)))))
        if labels is None:
            return logits
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}


def _batches(n: int = 3, rows: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        {"x": torch.randn(rows, 64, generator=g), "labels": torch.randint(0, 4, (rows,), generator=g)}
        for _ in range(n)
    ]


def _true_gradients(base: nn.Module, batches) -> dict[str, torch.Tensor]:
    """dL/dW of lin0 and lin1, summed over the batches: the explicit m x n matrices LOI must never form."""
    model = copy.deepcopy(base).double()
    for batch in batches:
        model(batch["x"].double(), batch["labels"])["loss"].backward()
    return {name: getattr(model, name).weight.grad for name in ("lin0", "lin1")}


def _loi_model(r: int = 4, base: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(1)
    return get_peft_model(base or Net(), RiemannionConfig(r=r, target_modules=["lin0", "lin1"], init_scale=0.1))


def _projector(M: torch.Tensor) -> torch.Tensor:
    Q = torch.linalg.qr(M.double()).Q
    return Q @ Q.T


# -- the randomized SVD on its own ---------------------------------------------------------------------------------


def test_backprop_rsvd_matches_an_explicit_svd_and_power_iterations_sharpen_it():
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (60, 40), "b": (30, 50)}
    matrices = {}
    for key, (m, n) in shapes.items():
        U = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=F64)).Q[:, : min(m, n)]
        V = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64)).Q[:, : min(m, n)]
        S = 0.6 ** torch.arange(min(m, n), dtype=F64)  # decaying spectrum, as gradients have
        matrices[key] = (U * S) @ V.T
    errors = []
    for power_iters in (0, 1, 2):
        calls = []

        def right(bases, calls=calls):
            calls.append("right")
            return {k: matrices[k] @ N for k, N in bases.items()}

        def left(bases, calls=calls):
            calls.append("left")
            return {k: matrices[k].T @ M for k, M in bases.items()}

        result = backprop_rsvd(right, left, shapes, 6, oversampling=8, power_iters=power_iters, generator=g, dtype=F64)
        assert calls == ["right"] + ["left", "right"] * power_iters + ["left"]  # 2 (q + 1) passes
        error = 0.0
        for key, G in matrices.items():
            U, S, V = result[key]
            U_true, S_true, Vh_true = torch.linalg.svd(G)
            assert U.shape == (shapes[key][0], 6) and V.shape == (shapes[key][1], 6)
            error = max(
                error,
                ((S - S_true[:6]) / S_true[:6]).abs().max().item(),
                (_projector(U) - _projector(U_true[:, :6])).norm().item(),
                (_projector(V) - _projector(Vh_true[:6].T)).norm().item(),
            )
        errors.append(error)
    # Halko et al.: the error falls like (s_(k+1) / s_r)^(2q + 1) = 0.6^(8 (2q + 1))
    assert errors[0] < 0.05 and errors[1] < 1e-4 and errors[2] < 1e-7, errors


def test_backprop_rsvd_rejects_ranks_beyond_the_matrix():
    with pytest.raises(ValueError, match=r"rank 12 must be in \[1, min\(m, n\)\] = \[1, 10\]"):
        backprop_rsvd(lambda b: b, lambda b: b, {"w": (10, 20)}, 12)


# -- the LOI point ---------------------------------------------------------------------------------------------------


def test_loi_finds_the_top_singular_vectors_of_the_true_gradient():
    base = Net()
    batches = _batches()
    G = _true_gradients(base, batches)
    model = _loi_model(r=4, base=copy.deepcopy(base))
    result = initialize_loi(model, batches, oversampling=16, power_iters=2)
    assert result.passes == 1 and result.batches == 3  # the later products replayed from the first pass
    for ref in find_adapters(model):
        name = ref.layer_name.rsplit(".", 1)[-1]
        U, S, Vh = torch.linalg.svd(G[name])
        torch.testing.assert_close(result.singular_values[ref.layer_name].double(), S[:8], rtol=2e-3, atol=1e-6)
        A, B = ref.A.detach().double(), ref.B.detach().double()
        torch.testing.assert_close(A.T @ A, torch.eye(4, dtype=F64), atol=1e-5, rtol=0)
        # A spans the top-r left singular vectors, B the next r right singular vectors, scaled to init_scale
        torch.testing.assert_close(_projector(A), _projector(U[:, :4]), atol=2e-3, rtol=0)
        torch.testing.assert_close(_projector(B), _projector(Vh[4:8].T), atol=2e-3, rtol=0)
        torch.testing.assert_close(torch.linalg.svdvals(B), torch.full((4,), 0.1, dtype=F64), atol=1e-6, rtol=0)


def test_loi_is_exact_when_the_probes_cover_the_gradient_rank():
    """One batch of 8 rows: rank(G) <= 8 <= k = 2r + oversampling, so the range finder captures G exactly."""
    base = Net()
    batches = _batches(1, rows=8)
    G = _true_gradients(base, batches)
    model = _loi_model(r=2, base=copy.deepcopy(base))
    result = initialize_loi(model, batches, oversampling=16, power_iters=0)
    for ref in find_adapters(model):
        S = torch.linalg.svdvals(G[ref.layer_name.rsplit(".", 1)[-1]])
        torch.testing.assert_close(result.singular_values[ref.layer_name].double(), S[:4], rtol=1e-5, atol=1e-7)


def test_loi_keeps_the_output_and_makes_the_first_riemannian_gradient_the_best_rank_2r_approximation():
    base = Net()
    batches = _batches()
    x = batches[0]["x"]
    with torch.no_grad():
        expected = base(x)
    model = _loi_model(r=4, base=copy.deepcopy(base))
    initialize_loi(model, batches, power_iters=2)
    with torch.no_grad():
        torch.testing.assert_close(model(x=x), expected, atol=1e-6, rtol=1e-5)
    for ref in find_adapters(model):
        assert torch.equal(ref.layer.riemannion_X0_A["default"], ref.A.detach())
        assert torch.equal(ref.layer.riemannion_X0_B["default"], ref.B.detach())
        assert torch.equal(ref.layer.base_layer.weight, getattr(base, ref.layer_name.rsplit(".", 1)[-1]).weight)

    # the locally optimal property: P_T(G) at the LOI point is the best rank-2r approximation of G
    model.train()
    for batch in batches:
        model(**batch)["loss"].backward()
    G = _true_gradients(base, batches)
    for ref in find_adapters(model):
        point = FixedRankPoint.from_factors(ref.A.detach().double(), ref.B.detach().double())
        grad = egrad2rgrad(point, ref.Z.grad.double(), ref.B.grad.double())
        best = retr_dense(G[ref.layer_name.rsplit(".", 1)[-1]], 8)
        assert (tangent_to_dense(point, grad) - best).norm() < 1e-2 * best.norm()


def test_loi_never_allocates_a_gradient_of_the_weight_size():
    base = Net()
    model = _loi_model(r=2, base=base)
    batches = _batches(2, rows=8)  # activations are 8 x 128; probes 128 x 20; W is 128 x 64 = 8192
    weights = [ref.layer.base_layer.weight for ref in find_adapters(model)]
    flags = [w.requires_grad for w in weights]
    recorder = record_allocations(
        lambda: initialize_loi(model, batches, power_iters=1),
        existing=list(model.parameters()) + list(model.buffers()),
    )
    assert_no_allocation_of(recorder, 64 * 128, "initialize_loi (an m x n gradient of lin0 or lin1)")
    assert any("mm" in op for op, _ in recorder.allocations)
    assert all(w.grad is None for w in weights), "a weight gradient was computed"
    assert [w.requires_grad for w in weights] == flags, "requires_grad was not restored"
    assert all(p.grad is None for p in model.parameters()), "LOI left gradients behind"


def test_loi_then_riemannion_training_works_and_saves_like_any_adapter(tmp_path):
    model = _loi_model(r=4)
    batches = _batches()
    initialize_loi(model, batches)
    optimizer = create_riemannion_optimizer(model, lr=0.02)
    loss0 = model(**batches[0])["loss"].item()
    for _ in range(4):
        for batch in batches:
            optimizer.zero_grad()
            model(**batch)["loss"].backward()
            optimizer.step()
    # only the adapters train (no modules_to_save): measured x0.88 in these 4 epochs, a frozen adapter stays at x1.00
    assert model(**batches[0])["loss"].item() < 0.95 * loss0
    model.eval()
    x = batches[0]["x"]
    with torch.no_grad():
        expected = model(x=x)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(Net(), tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x=x), expected)
    for a, b in zip(find_adapters(model), find_adapters(loaded)):
        assert torch.equal(a.layer.riemannion_X0_A["default"], b.layer.riemannion_X0_A["default"])


def test_loi_on_a_4bit_base_keeps_the_output_and_the_weights_and_round_trips(tmp_path):
    pytest.importorskip("bitsandbytes")

    def quantized() -> nn.Module:
        return quantize_linears(Net(), 4, ("lin0", "lin1")).eval()

    base = quantized()
    batches = _batches()
    x = batches[0]["x"]
    with torch.no_grad():
        expected = base(x)
    model = _loi_model(r=4, base=base)
    qweights = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.uint8}
    assert len(qweights) == 2
    result = initialize_loi(model, batches)
    assert all(torch.isfinite(s).all() and s[0] > 0 for s in result.singular_values.values())
    with torch.no_grad():
        torch.testing.assert_close(model(x=x), expected, atol=1e-5, rtol=1e-5)  # unchanged: no base mutation
    for n, p in model.named_parameters():
        if n in qweights:
            assert torch.equal(p, qweights[n]), f"LOI touched the quantized weight {n}"
    optimizer = create_riemannion_optimizer(model, lr=0.02)
    model.train()
    for batch in batches:
        optimizer.zero_grad()
        model(**batch)["loss"].backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        trained = model(x=x)
    assert not torch.allclose(trained, expected, atol=1e-4)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(quantized(), tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x=x), trained)


def test_loi_on_a_4bit_base_agrees_with_the_full_precision_gradient():
    """The quantized base changes G only by the quantization error: the subspaces stay close."""
    pytest.importorskip("bitsandbytes")
    batches = _batches()
    model = _loi_model(r=2, base=quantize_linears(Net(), 4, ("lin0", "lin1")))
    initialize_loi(model, batches, power_iters=2)
    G = _true_gradients(Net(), batches)
    for ref in find_adapters(model):
        U = torch.linalg.svd(G[ref.layer_name.rsplit(".", 1)[-1]]).U
        overlap = torch.linalg.svdvals(U[:, :2].T @ ref.A.detach().double())
        assert overlap.min() > 0.9, overlap


def _loi_points(budget: int, loss_fn=None) -> tuple[list[torch.Tensor], int]:
    model = _loi_model(r=4)
    result = initialize_loi(model, _batches(), loss_fn=loss_fn, power_iters=2, max_cached_bytes=budget)
    return [t.detach().clone() for ref in find_adapters(model) for t in (ref.A, ref.B)], result.passes


@pytest.mark.parametrize("budget", [0, 3000])
def test_replayed_products_equal_the_passes_bit_for_bit(budget):
    """The first pass's recording replaces the later passes exactly. A budget of 0, or one the recording outgrows
    mid-pass (3000 bytes: the first layer's input of the first batch fits, its output gradient does not), keeps
    every pass."""
    (replayed, one), (passed, six) = _loi_points(2**30), _loi_points(budget)
    assert (one, six) == (1, 6)
    assert all(torch.equal(a, b) for a, b in zip(replayed, passed))
    with pytest.raises(ValueError, match=r"`max_cached_bytes` must be an integer >= 0, got -1"):
        initialize_loi(_loi_model(r=4), _batches(), max_cached_bytes=-1)


def test_replay_of_layers_called_twice_per_pass_sums_both_calls():
    def twice(model, batch):  # every layer runs twice per forward pass, with different inputs
        return model(**batch)["loss"] + model(batch["x"] * 0.5, batch["labels"])["loss"]

    (replayed, one), (passed, six) = _loi_points(2**30, twice), _loi_points(0, twice)
    assert (one, six) == (1, 6)
    for a, b in zip(replayed, passed):  # the two calls' gradients may be summed in another order
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda: (_loi_model(r=4), []), "needs at least one calibration batch"),
        (lambda: (_loi_model(r=40), _batches()), r"LOI needs 2r = 80 <= min\(out, in\) = 64; lower r"),
        (lambda: (Net(), _batches()), "has no Riemannion adapters"),
    ],
)
def test_bad_input_is_refused(setup, message):
    model, batches = setup()
    with pytest.raises(ValueError, match=message):
        initialize_loi(model, batches)


def test_several_adapters_need_a_name_and_the_loss_must_exist():
    model = _loi_model(r=2)
    model.add_adapter("other", RiemannionConfig(r=2, target_modules=["lin0"]))
    with pytest.raises(ValueError, match=r"several Riemannion adapters \['default', 'other'\]; pass adapter_name="):
        initialize_loi(model, _batches())
    before = {k: v.clone() for k, v in model.state_dict().items() if ".default" in k}
    initialize_loi(model, _batches(), adapter_name="other")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "the other adapter was changed"
    with pytest.raises(ValueError, match="model output has no `loss`"):
        initialize_loi(model, [{"x": torch.randn(4, 64)}], adapter_name="other")
