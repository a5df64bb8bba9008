"""The Riemannion optimizer: the update against a dense reference, the manifold invariants, parametrization
independence (and LoRA + AdamW's lack of it), the auxiliary AdamW, resumable state, bad input, and Trainer usage."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import peft_ext.manifolds.fixed_rank as fixed_rank
from peft_ext import RiemannionConfig
from peft_ext.manifolds import FixedRankPoint, ortho_dense, proju_dense, retr_dense, to_dense
from peft_ext.models import tiny_bert
from peft_ext.optim import OPTIMIZERS, Riemannion, RiemannLoRA, create_riemannion_optimizer
from peft_ext.optim.adam_math import adamw_update
from peft_ext.optim.riemannion_math import riemannion_update, riemannion_update_reference
from peft_ext.tuners.riemannion import find_adapters

from .allocations import assert_no_allocation_of, record_allocations
from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64


class MLP(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin0 = nn.Linear(10, 24)
        self.lin1 = nn.Linear(24, 16)
        self.head = nn.Linear(16, 3)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin1(torch.tanh(self.lin0(x)))))


def _model(dtype: torch.dtype = torch.float32, head: bool = True, **config) -> nn.Module:
    torch.manual_seed(0)
    options = {"r": 3, "target_modules": ["lin0", "lin1"], "init_scale": 0.5, **config}
    if head:
        options["modules_to_save"] = ["head"]
    return get_peft_model(MLP(dtype), RiemannionConfig(**options))


def _batches(n: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(42)
    return [(torch.randn(8, 10, generator=g, dtype=dtype), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches, after_step=None) -> None:
    for batch in batches:
        optimizer.zero_grad()
        _loss(model, batch).backward()
        optimizer.step()
        if after_step is not None:
            after_step()


def _deltas(model: nn.Module) -> list[torch.Tensor]:
    return [(ref.A @ ref.B.T).detach().clone() for ref in find_adapters(model)]


# -- the update against the dense algorithm -----------------------------------------------------------------------


def _dense_reference(A, B, grads, *, lr, beta, nesterov, wd, ortho):
    """docs/methods.md (Riemannion)'s step with m x n matrices: P_T, transport by projection, Ortho by SVD, retraction
    by SVD."""
    r = A.shape[1]
    X, M, out = A @ B.T, None, []
    for G in grads:
        grad = proju_dense(A, B, G)
        M = grad if M is None else beta * proju_dense(A, B, M) + grad
        D = grad + beta * M if nesterov else M
        if ortho:
            D = proju_dense(A, B, ortho_dense(D))
        X = retr_dense((1 - lr * wd) * X - lr * D, r)
        U, S, Vh = torch.linalg.svd(X)
        A, B = U[:, :r], Vh[:r].T * S[:r]
        out.append(X)
    return out


@pytest.mark.parametrize("update", [riemannion_update, riemannion_update_reference], ids=["factored", "reference"])
@pytest.mark.parametrize("ortho", [True, False], ids=["riemannion", "riemannlora"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_update_equals_the_dense_algorithm(update, ortho, nesterov):
    g = torch.Generator().manual_seed(0)
    m, n, r = 11, 8, 3
    A = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=F64)).Q
    B = torch.randn(n, r, generator=g, dtype=F64)
    grads = [torch.randn(m, n, generator=g, dtype=F64) for _ in range(4)]
    kwargs = {"lr": 0.1, "beta": 0.9, "nesterov": nesterov, "wd": 0.05}
    expected = _dense_reference(A, B, grads, ortho=ortho, **kwargs)
    point, momentum = FixedRankPoint.from_factors(A, B), None
    for G, X in zip(grads, expected):
        point, momentum = update(
            point,
            G @ point.B_R,
            G.T @ point.A,
            momentum,
            lr=0.1,
            beta=0.9,
            nesterov=nesterov,
            weight_decay=0.05,
            orthogonalize_step=ortho,
        )
        torch.testing.assert_close(to_dense(point), X)


@pytest.mark.parametrize("shape", [(40, 30, 4), (6, 30, 4), (40, 5, 4)], ids=["tall", "m<2r", "n<2r"])
@pytest.mark.parametrize("options", [{}, {"nesterov": True}, {"orthogonalize_step": False}, {"weight_decay": 0.5}])
def test_factored_update_equals_the_reference_on_a_float32_stack(shape, options):
    """The shared-basis step (riemannion_update) against the composition of the geometry's functions, on a stack of
    3 adapters: with and without momentum, a zero gradient, and factors too narrow for 2r independent columns."""
    m, n, r = shape
    g = torch.Generator().manual_seed(0)
    A = torch.linalg.qr(torch.randn(3, m, r, generator=g)).Q
    point = FixedRankPoint.from_factors(A, torch.randn(3, n, r, generator=g) * 0.1)
    momentum = riemannion_update_reference(
        point, torch.randn(3, m, r, generator=g), torch.randn(3, n, r, generator=g), None, lr=0.0, beta=0.9
    )[1]
    for grad_scale, buf in ((1.0, None), (1.0, momentum), (0.0, momentum), (0.0, None)):
        grads = (torch.randn(3, m, r, generator=g) * grad_scale, torch.randn(3, n, r, generator=g) * grad_scale)
        kwargs = {"lr": 0.03, "beta": 0.9, **options}
        new, moved = riemannion_update(point, *grads, buf, **kwargs)
        want, want_moved = riemannion_update_reference(point, *grads, buf, **kwargs)
        torch.testing.assert_close(to_dense(new), to_dense(want), rtol=0, atol=1e-6)
        torch.testing.assert_close(new.A.mT @ new.A, torch.eye(r).expand(3, r, r), rtol=0, atol=1e-5)
        torch.testing.assert_close(new.B_R, fixed_rank.right_basis(new.B))
        dense = fixed_rank.tangent_to_dense
        torch.testing.assert_close(dense(new, moved), dense(want, want_moved), rtol=0, atol=1e-5)


# -- manifold invariants ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["muon", "sgd"])
def test_every_step_keeps_a_orthonormal_and_rank_exactly_r(variant):
    model = _model()
    optimizer = create_riemannion_optimizer(model, lr=0.05, variant=variant, nesterov=True, weight_decay=0.01)
    checked = []

    def check() -> None:
        for ref in find_adapters(model):
            A = ref.A.detach()
            assert (A.T @ A - torch.eye(3)).abs().max() < 1e-5
            X = A.double() @ ref.B.detach().double().T
            assert torch.linalg.matrix_rank(X).item() == 3
            assert torch.equal(ref.Z, torch.zeros_like(ref.Z)), "the probe must stay zero"
        checked.append(True)

    before = _deltas(model)
    _train(model, optimizer, _batches(15), after_step=check)
    assert len(checked) == 15
    assert all((a - b).norm() > 1e-3 for a, b in zip(before, _deltas(model))), "the adapters did not move"


@pytest.mark.parametrize("lr, learns", [(0.05, True), (1e-12, False)], ids=["adapter", "dead_adapter"])
def test_the_adapters_alone_reduce_the_loss(lr, learns):
    """No trainable head (the base's head stays frozen): only the adapters can lower the loss. With their step made
    negligible (``dead_adapter``) the same assertion fails, so this test catches an adapter that stopped learning."""
    model = _model(head=False)
    assert all("riemannion_" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = create_riemannion_optimizer(model, lr=lr)
    batch = _batches(1)[0]
    first = _loss(model, batch).item()
    _train(model, optimizer, [batch] * 30)
    assert (_loss(model, batch).item() < 0.7 * first) is learns


def test_zero_gradient_and_zero_weight_decay_leave_x_unchanged():
    model = _model()
    optimizer = create_riemannion_optimizer(model, lr=0.1, weight_decay=0.0)
    before = _deltas(model)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for a, b in zip(before, _deltas(model)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    # with weight decay the same zero-gradient step shrinks X by exactly (1 - lr * wd)
    decayed = create_riemannion_optimizer(model, lr=0.1, weight_decay=0.5)
    decayed.step()
    for a, b in zip(before, _deltas(model)):
        torch.testing.assert_close(b, a * (1 - 0.1 * 0.5), atol=1e-6, rtol=0)


def test_orthogonalized_update_has_unit_singular_values_before_reprojection(monkeypatch):
    seen = []
    original = fixed_rank.ortho_lowrank

    def spy(U, V, rtol=None):
        out = original(U, V, rtol)
        for u, v, uo, vo in zip(U, V, *out):  # the optimizer stacks same-shaped adapters into a batch
            seen.append((u.double() @ v.double().T, uo.double() @ vo.double().T))
        return out

    monkeypatch.setattr(fixed_rank, "ortho_lowrank", spy)
    model = _model()
    optimizer = create_riemannion_optimizer(model, lr=0.05)
    _train(model, optimizer, _batches(2))
    assert len(seen) == 4  # two adapters, two steps
    for momentum, update in seen:
        s = torch.linalg.svdvals(update)
        rank = torch.linalg.matrix_rank(momentum).item()
        assert rank == 6  # 2r: the momentum is a generic tangent vector
        torch.testing.assert_close(s[:rank], torch.ones(rank, dtype=F64), atol=1e-5, rtol=0)
        assert (s[rank:] < 1e-5).all()


# -- parametrization independence ---------------------------------------------------------------------------------


def _rotation(r: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(r, r, generator=torch.Generator().manual_seed(seed), dtype=F64)).Q


def test_riemannion_is_parametrization_independent_and_lora_adamw_is_not():
    batches = _batches(3, F64)

    # Riemannion: the same X split as (A, B) and as (A Q, B Q) with Q orthogonal (A Q is orthonormal too)
    first = _model(F64, head=False)
    second = copy.deepcopy(first)
    with torch.no_grad():
        for i, ref in enumerate(find_adapters(second)):
            Q = _rotation(3, i)
            ref.A.copy_(ref.A @ Q)
            ref.B.copy_(ref.B @ Q)
    for a, b in zip(_deltas(first), _deltas(second)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    start = _deltas(first)
    opt1 = create_riemannion_optimizer(first, lr=0.05, nesterov=True, weight_decay=0.01)
    opt2 = create_riemannion_optimizer(second, lr=0.05, nesterov=True, weight_decay=0.01)
    for batch in batches:  # momentum makes this check the transport too
        _train(first, opt1, [batch])
        _train(second, opt2, [batch])
        for a, b in zip(_deltas(first), _deltas(second)):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    moved = min((a - b).norm().item() for a, b in zip(_deltas(first), start))
    assert moved > 1e-2

    # LoRA + AdamW: the same X (delta = lora_B @ lora_A, scaling 1) split the same two ways gives different results
    def lora(rotate: bool, rescale: float = 1.0) -> nn.Module:
        model = get_peft_model(MLP(F64), LoraConfig(r=3, lora_alpha=3, target_modules=["lin0", "lin1"]))
        with torch.no_grad():
            for i, name in enumerate(["lin0", "lin1"]):
                U, S, Vh = torch.linalg.svd(start[i])  # the X the Riemannion adapters started from
                left, right = U[:, :3], Vh[:3].T * S[:3]
                if rotate:
                    left, right = left @ _rotation(3, i), right @ _rotation(3, i)
                layer = getattr(model.base_model.model, name)
                layer.lora_B["default"].weight.copy_(left * rescale)
                layer.lora_A["default"].weight.copy_(right.T / rescale)
        return model

    def lora_deltas(model: nn.Module) -> list[torch.Tensor]:
        layers = [model.base_model.model.lin0, model.base_model.model.lin1]
        return [layer.get_delta_weight("default").detach().clone() for layer in layers]

    results = []
    for rotate, rescale in [(False, 1.0), (True, 1.0), (False, 10.0)]:
        model = lora(rotate, rescale)
        for a, b in zip(lora_deltas(model), start):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)  # the same X before the step
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
        _train(model, optimizer, batches)
        results.append(lora_deltas(model))
    step = min((a - b).norm().item() for a, b in zip(results[0], start))
    for other in results[1:]:
        gap = max((a - b).norm().item() for a, b in zip(results[0], other))
        assert gap > 0.1 * step, f"LoRA + AdamW moved X the same way for both splits ({gap:.2e} vs step {step:.2e})"


# -- the auxiliary AdamW ------------------------------------------------------------------------------------------


def test_adamw_update_matches_torch_adamw():
    g = torch.Generator().manual_seed(1)
    p = torch.randn(5, 4, generator=g)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    exp_avg, exp_avg_sq = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 5):
        grad = torch.randn(5, 4, generator=g)
        ref.grad = grad.clone()
        opt.step()
        adamw_update(p, grad, exp_avg, exp_avg_sq, step, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
        torch.testing.assert_close(p, ref.detach(), atol=1e-7, rtol=1e-6)


def test_non_adapter_parameters_get_adamw_with_their_own_learning_rate():
    model = _model()
    optimizer = create_riemannion_optimizer(model, lr=0.05, aux_lr=3e-3, aux_weight_decay=0.02)
    manifold = [g for g in optimizer.param_groups if g["manifold"]]
    aux = [g for g in optimizer.param_groups if not g["manifold"]]
    assert len(manifold) == 1 and len(manifold[0]["params"]) == 6  # (A, B, Z) x 2 adapters
    head = {id(p) for n, p in model.named_parameters() if p.requires_grad and "head" in n}
    assert len(aux) == 1 and {id(p) for p in aux[0]["params"]} == head
    assert aux[0]["lr"] == 3e-3 and aux[0]["weight_decay"] == 0.02 and manifold[0]["lr"] == 0.05

    reference = {id(p): p.detach().clone().requires_grad_(True) for p in aux[0]["params"]}
    adamw = torch.optim.AdamW(reference.values(), lr=3e-3, weight_decay=0.02)
    for batch in _batches(3):
        optimizer.zero_grad()
        _loss(model, batch).backward()
        for p in aux[0]["params"]:
            reference[id(p)].grad = p.grad.clone()
        optimizer.step()
        adamw.step()
    for p in aux[0]["params"]:
        torch.testing.assert_close(p.detach(), reference[id(p)].detach(), atol=1e-7, rtol=1e-6)


# -- state ----------------------------------------------------------------------------------------------------------


def _fresh(variant: str = "muon"):
    model = _model()
    optimizer = create_riemannion_optimizer(model, lr=0.05, aux_lr=1e-2, nesterov=True, variant=variant)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


@pytest.mark.parametrize("variant", ["muon", "sgd"])
def test_state_dict_round_trips_and_a_resumed_run_equals_an_uninterrupted_one(variant, tmp_path):
    batches = _batches(6)

    def run(model, optimizer, scheduler, part):
        for batch in part:
            optimizer.zero_grad()
            _loss(model, batch).backward()
            optimizer.step()
            scheduler.step()

    model, optimizer, scheduler = _fresh(variant)
    run(model, optimizer, scheduler, batches)
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    model, optimizer, scheduler = _fresh(variant)
    run(model, optimizer, scheduler, batches[:3])
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
        tmp_path / "ckpt.pt",
    )
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    state = checkpoint["optimizer"]["state"]
    assert sum("momentum_A" in s for s in state.values()) == 2  # one momentum per adapter
    assert sum("exp_avg" in s for s in state.values()) == 2  # head weight and bias

    model, optimizer, scheduler = _fresh(variant)  # a new process would start like this
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    run(model, optimizer, scheduler, batches[3:])
    for key, value in model.state_dict().items():
        assert torch.equal(value, uninterrupted[key]), key


# -- bad input -------------------------------------------------------------------------------------------------------


def test_the_model_is_required():
    model = _model()
    with pytest.raises(TypeError, match=r"needs the model .* put 'model' in the kwargs of optimizer_cls_and_kwargs"):
        Riemannion([p for p in model.parameters() if p.requires_grad], lr=0.1)


def test_non_adapter_parameter_in_a_manifold_group_is_refused():
    model = _model()
    head = model.base_model.model.head.modules_to_save["default"].weight
    adapters = [p for n, p in model.named_parameters() if "riemannion_" in n]
    with pytest.raises(
        ValueError, match=r"manifold=True but 1 of its parameters are not part of a Riemannion adapter"
    ):
        Riemannion([{"params": [*adapters, head], "manifold": True}], model=model)
    with pytest.raises(ValueError, match=r"head\.modules_to_save\.default\.weight of shape \(3, 16\)"):
        Riemannion([{"params": [head], "manifold": True}], model=model)
    with pytest.raises(ValueError, match="manifold=False but holds Riemannion adapter parameters"):
        Riemannion([{"params": adapters, "manifold": False}], model=model)


def test_split_adapter_is_refused():
    model = _model()
    (ref, _) = find_adapters(model)
    rest = [p for p in model.parameters() if p.requires_grad and p is not ref.A]
    with pytest.raises(
        ValueError, match=r"holds riemannion_B/Z of adapter 'default' of base_model.model.lin0 but not"
    ):
        Riemannion([{"params": rest}, {"params": [ref.A]}], model=model)


def test_adapter_moved_off_the_manifold_by_another_optimizer_is_refused():
    model = _model()
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    _train(model, adamw, _batches(1))
    with pytest.raises(ValueError, match=r"riemannion_A is not orthonormal .* off the manifold"):
        create_riemannion_optimizer(model)
    model = _model()
    with torch.no_grad():
        find_adapters(model)[1].Z.fill_(0.5)
    with pytest.raises(ValueError, match="riemannion_Z is a gradient probe and must stay zero"):
        create_riemannion_optimizer(model)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_raises_and_changes_nothing(bad):
    model = _model()
    optimizer = create_riemannion_optimizer(model)
    _loss(model, _batches(1)[0]).backward()
    find_adapters(model)[1].B.grad[0, 0] = bad
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"non-finite gradient .* in base_model\.model\.lin1\.riemannion_B\.default"):
        optimizer.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_non_finite_gradient_is_skipped_when_asked():
    model = _model()
    optimizer = create_riemannion_optimizer(model, nonfinite="skip")
    _loss(model, _batches(1)[0]).backward()
    model.base_model.model.head.modules_to_save["default"].bias.grad[0] = float("nan")
    before = copy.deepcopy(model.state_dict())
    message = r"non-finite gradient .* .*head\.modules_to_save\.default\.bias.*; skipping this optimizer step .*1 skip"
    with pytest.warns(UserWarning, match=message) as caught:
        optimizer.step()
    assert len(caught) == 1 and caught[0].filename == __file__  # once, pointing at the caller of step()
    assert optimizer.skipped_steps == 1 and not optimizer.state
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    optimizer.zero_grad()
    _loss(model, _batches(1)[0]).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a finite step warns nothing
        optimizer.step()
    assert optimizer.skipped_steps == 1 and optimizer.state


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1.0}, r"`lr` must be a finite number >= 0, got -1.0"),
        ({"momentum": 1.0}, r"`momentum` must be in \[0, 1\), got 1.0"),
        ({"momentum": 0.0, "nesterov": True}, "`nesterov` must be False when momentum is 0"),
        ({"weight_decay": -0.1}, "`weight_decay` must be a finite number >= 0, got -0.1"),
        ({"aux_betas": (0.9, 1.0)}, r"`betas` must be a pair of numbers in \[0, 1\), got \(0.9, 1.0\)"),
        ({"aux_eps": 0.0}, "`eps` must be > 0, got 0.0"),
        ({"nonfinite": "ignore"}, r"`nonfinite` must be one of \('raise', 'skip'\), got 'ignore'"),
        ({"variant": "adam"}, r"`variant` must be one of \['muon', 'sgd'\], got 'adam'"),
    ],
)
def test_bad_hyperparameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_riemannion_optimizer(_model(), **kwargs)


def test_a_model_without_riemannion_adapters_is_refused():
    model = get_peft_model(MLP(), LoraConfig(r=2, target_modules=["lin0"]))
    with pytest.raises(ValueError, match="has no trainable Riemannion adapter"):
        create_riemannion_optimizer(model)


def test_registered_in_the_optimizer_table():
    assert OPTIMIZERS["riemannion"] is Riemannion and OPTIMIZERS["riemannlora"] is RiemannLoRA
    optimizer = RiemannLoRA(_model(), lr=0.5)
    assert all(not g["orthogonalize"] for g in optimizer.param_groups if g["manifold"])


# -- transformers.Trainer ------------------------------------------------------------------------------------------


def _trainer_setup(tmp_path):
    from transformers import TrainingArguments

    torch.manual_seed(0)
    model = get_peft_model(
        tiny_bert(num_labels=3),
        RiemannionConfig(r=2, target_modules=["query", "value"], modules_to_save=["classifier"]),
    )
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 128, (6,), generator=g), "labels": torch.tensor(i % 3)} for i in range(16)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    return model, data, args


def _check_trained(trainer, model, before) -> None:
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate may wrap it
    assert isinstance(optimizer, Riemannion)
    assert {g["manifold"] for g in optimizer.param_groups} == {True, False}
    for ref, start in zip(find_adapters(model), before):
        assert (ref.A.T @ ref.A - torch.eye(2)).abs().max() < 1e-5
        assert ((ref.A @ ref.B.T).detach() - start).norm() > 1e-4, "the adapter did not train"
    # the scheduler scaled every group, the manifold's and AdamW's: linear decay reaches 0 at max_steps
    assert all(g["lr"] == pytest.approx(0.0) for g in optimizer.param_groups)


def test_trainer_with_a_prebuilt_optimizer_and_scheduler(tmp_path):
    from transformers import Trainer, get_linear_schedule_with_warmup

    model, data, args = _trainer_setup(tmp_path)
    before = _deltas(model)
    optimizer = create_riemannion_optimizer(model, lr=0.05, aux_lr=1e-2)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=4)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, scheduler))
    trainer.train()
    _check_trained(trainer, model, before)


def test_trainer_builds_it_from_optimizer_cls_and_kwargs(tmp_path):
    from transformers import Trainer

    model, data, args = _trainer_setup(tmp_path)
    before = _deltas(model)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        optimizer_cls_and_kwargs=(Riemannion, {"model": model, "lr": 0.05, "aux_lr": 1e-2}),
    )
    trainer.train()
    _check_trained(trainer, model, before)
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])


def test_trainer_without_the_model_kwarg_says_what_to_add(tmp_path):
    from transformers import Trainer

    model, data, args = _trainer_setup(tmp_path)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=(Riemannion, {"lr": 0.05}))
    with pytest.raises(TypeError, match="put 'model' in the kwargs of optimizer_cls_and_kwargs"):
        trainer.train()


def test_same_shaped_adapters_are_stepped_in_one_batch_with_the_per_adapter_result(monkeypatch):
    import peft_ext.optim.riemannion as module  # the name the optimizer calls

    calls = []
    original = module.riemannion_update

    def spy(point, *args, **kwargs):
        calls.append(point.A.shape)
        return original(point, *args, **kwargs)

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12))
    model = get_peft_model(base, RiemannionConfig(r=2, target_modules=["0", "2", "4"], init_scale=0.5))
    optimizer = create_riemannion_optimizer(model, lr=0.1, momentum=0.0)
    model(torch.randn(5, 12)).pow(2).sum().backward()
    expected = []
    for ref in find_adapters(model):
        point = FixedRankPoint.from_factors(ref.A.detach().clone(), ref.B.detach().clone())
        new, _ = original(point, ref.Z.grad.clone(), ref.B.grad.clone(), None, lr=0.1, beta=0.0)
        expected.append(to_dense(new))
    monkeypatch.setattr(module, "riemannion_update", spy)
    optimizer.step()
    assert calls == [torch.Size([3, 12, 2])]  # one batched call for the three 12 x 12 adapters
    for ref, X in zip(find_adapters(model), expected):
        torch.testing.assert_close(ref.A @ ref.B.T, X, atol=1e-6, rtol=1e-5)


def test_the_optimizer_step_never_allocates_an_out_by_in_matrix():
    m, n = 96, 80
    model = get_peft_model(nn.Sequential(nn.Linear(n, m)), RiemannionConfig(r=4, target_modules=["0"]))
    optimizer = create_riemannion_optimizer(model, lr=0.05, nesterov=True, weight_decay=0.01)
    for _ in range(2):  # the second step also transports and combines the momentum
        optimizer.zero_grad()
        model(torch.randn(16, n)).pow(2).sum().backward()
        recorder = record_allocations(optimizer.step, existing=[p for p in model.parameters()])
        assert_no_allocation_of(recorder, m * n, "a Riemannion optimizer step")


# -- the right basis B_R: computed once per step, by the retraction ---------------------------------------------------


def test_the_step_hands_the_new_basis_to_the_layer_and_the_forward_computes_no_qr(monkeypatch):
    import peft_ext.tuners.riemannion.layer as layer_module

    # two 17 x 17 adapters (one stack; a batched QR of it would round differently from the layer's own QR) and one
    # 12 x 7 adapter: per step one QR of each new B, by the retraction
    base = nn.Sequential(nn.Linear(17, 17), nn.Tanh(), nn.Linear(17, 17), nn.Tanh(), nn.Linear(7, 12))
    torch.manual_seed(0)
    model = get_peft_model(base, RiemannionConfig(r=3, target_modules=["0", "2", "4"], init_scale=0.5))
    optimizer = create_riemannion_optimizer(model, lr=0.05, nesterov=True, weight_decay=0.01)
    layer_qr, optimizer_qr = [], []
    real = fixed_rank.right_basis
    monkeypatch.setattr(layer_module, "right_basis", lambda B: layer_qr.append(B.shape) or real(B))
    monkeypatch.setattr(fixed_rank, "right_basis", lambda B: optimizer_qr.append(B.shape) or real(B))

    def loss():
        x = torch.randn(5, 17, generator=gen)
        return model[4](torch.tanh(model[2](torch.tanh(model[0](x))))[:, :7]).pow(2).sum()

    gen = torch.Generator().manual_seed(1)
    model = model.base_model.model
    loss().backward()
    assert len(layer_qr) == 3  # the first forward fills the layers' caches
    for step in range(3):
        layer_qr.clear(), optimizer_qr.clear()
        optimizer.step()
        # the step starts from the cached bases and retracts: one QR per adapter, none for the old point
        assert sorted(optimizer_qr) == [(1, 7, 3), (2, 17, 3)], step
        for ref in find_adapters(model):
            cached = ref.layer.get_right_basis(ref.adapter_name)
            assert torch.equal(cached, real(ref.B.detach())), (step, ref)  # bit for bit the layer's own QR
        optimizer.zero_grad()
        loss().backward()
        assert layer_qr == [], step  # the forward after a step reuses the handed-over basis


def test_a_momentum_split_over_other_processes_is_refused_before_the_step():
    from peft_ext.optim.riemannion_checks import check_momentum_split

    # saved by 2 FSDP2 processes (each its own adapters' momentum): refused on 1 or 4, taken on 2
    for world in (1, 4):
        with pytest.raises(ValueError, match=r"split over 2 process\(es\).*this run has " + str(world)):
            check_momentum_split({"momentum_processes": 2}, world, has_momentum=True)
    group = {"momentum_processes": 2}
    check_momentum_split(group, 2, has_momentum=True)
    assert group["momentum_processes"] == 2
    # a whole momentum (one process, DDP, or a state from before the split) serves any number of processes
    for saved in ({"momentum_processes": 1}, {}):
        check_momentum_split(saved, 2, has_momentum=True)
        assert saved["momentum_processes"] == 2
    # no momentum yet (a fresh optimizer that loaded nothing): nothing to refuse
    check_momentum_split({"momentum_processes": 2}, 1, has_momentum=False)


def test_owners_by_group_gives_whole_groups_to_the_least_loaded_process():
    from peft_ext.distributed import owners_by_group

    # a Llama block's shapes: q/o (4 of them over 2 layers), k/v (4), gate/up (4), down (2); each group fits a share
    keys = ["qo", "kv", "qo", "kv", "gu", "gu", "down"] * 2
    costs = {"qo": 1.0, "kv": 0.6, "gu": 1.8, "down": 1.8}
    owners = owners_by_group(keys, [costs[k] for k in keys], call_cost=3.0, world=2)
    for key in costs:  # whole groups: one process makes each batched call
        assert len({o for o, k in zip(owners, keys) if k == key}) == 1, key
    load = [sum(costs[k] for o, k in zip(owners, keys) if o == r) for r in (0, 1)]
    assert set(owners) == {0, 1} and max(load) / sum(load) < 0.7, (owners, load)
    # one group bigger than a share (every adapter of one shape) is dealt out adapter by adapter
    assert owners_by_group(["same"] * 6, [1.0] * 6, call_cost=3.0, world=2) == [0, 1, 0, 1, 0, 1]
    assert owners_by_group(["a", "b"], [1.0, 1.0], call_cost=3.0, world=1) == [0, 0]
    # deterministic: every process computes the same
    assert owners == owners_by_group(keys, [costs[k] for k in keys], call_cost=3.0, world=2)


def test_a_state_saved_with_every_other_adapter_owned_keeps_that_rule():
    """States saved before the shape-group rule (no ``momentum_owners`` in the group, momentum split over processes)
    keep every ``world``-th adapter per process, so each process's saved momentum stays with its adapters."""
    from peft_ext.optim.riemannion import _owners

    A, B = torch.zeros(8, 2), torch.zeros(6, 2)
    group = {"params": [A, B, torch.zeros(2, 2)] * 4, "momentum_processes": 2}
    split = (None, 2, 1)
    assert _owners(dict(group), [0, 1, 2, 3], split, has_momentum=True) == ([0, 1, 0, 1], [1, 3])
    legacy = dict(group)
    _owners(legacy, [0, 1, 2, 3], split, has_momentum=True)
    assert legacy["momentum_owners"] == "slots"
    fresh = dict(group)
    owners, _ = _owners(fresh, [0, 1, 2, 3], split, has_momentum=False)  # new momentum: the group rule
    assert fresh["momentum_owners"] == "groups" and owners == [0, 1, 0, 1]  # one shape bigger than a share: dealt
    assert _owners({"params": group["params"]}, [0, 2], None, has_momentum=True) == ([0, 0], [0, 1])
