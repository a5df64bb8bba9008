"""A method's ``optimizer:`` section: optimizers found by the registry, their options validated by the optimizer
itself, and no method module deciding by an optimizer's name."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from peft_ext.continual import TrainConfig, get_continual_method
from peft_ext.continual.config import ConfigError, config_from_dict, with_setting
from peft_ext.continual.context import RunContext
from peft_ext.optim import DCTAdamW, Riemannion, RiemannLoRA, choices

from .helpers import lora_adapter, stack_collate, tiny_classifier, token_sequence

ROOT = Path(__file__).resolve().parents[1]
METHODS = ROOT / "peft_ext" / "continual" / "methods"
FAST = TrainConfig(epochs=1, batch_size=8, progress=False, device="cpu")


def _ctx(seq) -> RunContext:
    return RunContext(sequence=seq, train=FAST, collate=stack_collate, device=torch.device("cpu"))


def test_the_defaults_are_the_optimizers_own():
    dct = choices.optimizer_spec("dct_adamw")[1]
    signature = inspect.signature(DCTAdamW.__init__).parameters
    assert dct["rank"] == signature["rank"].default and dct["update_proj_gap"] == signature["update_proj_gap"].default
    assert choices.optimizer_spec("subspace_adamw")[1]["update_proj_gap"] == 50  # SubspaceAdamW's, not DCT-AdamW's 1
    adamw = inspect.signature(torch.optim.AdamW.__init__).parameters
    assert choices.optimizer_spec("adamw")[1] == {k: adamw[k].default for k in ("betas", "eps", "amsgrad")}


def test_an_unknown_name_suggests_the_close_one():
    with pytest.raises(ValueError, match=r"got 'dct_adam' \(did you mean 'dct_adamw'\?\)"):
        choices.optimizer_choice("dct_adam")


def test_a_registered_optimizer_is_found_by_configs_and_built_by_the_method():
    """A new optimizer is one class: no method module or list to edit."""

    @choices.register_optimizer
    class SignSGD(choices.OptimizerChoice):
        name = "test_sgd"
        steps = "parameters"
        summary = "torch SGD, for this test"
        built: ClassVar[list[Any]] = []

        @classmethod
        def option_defaults(cls) -> dict[str, Any]:
            return {"momentum": 0.0}

        @classmethod
        def build(cls, request: choices.OptimizerRequest, options: dict[str, Any]) -> torch.optim.Optimizer:
            optimizer = torch.optim.SGD([p for _, p in request.params], lr=request.lr, **options)
            cls.built.append(optimizer)
            return optimizer

    try:
        config = config_from_dict(
            {"methods": [{"name": "full_ft", "lr": 0.1, "optimizer": {"name": "test_sgd", "momentum": 0.5}}]}
        )
        method = get_continual_method("full_ft")(config.methods[0].options)
        model = tiny_classifier(4)
        optimizer = method.make_optimizer(model, list(model.parameters()), None)
        assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["momentum"] == 0.5
        # its option is validated against what it declares
        with pytest.raises(ConfigError, match=r"`methods\[0\].optimizer.nesterov` is not an option of 'test_sgd'"):
            config_from_dict(
                {"methods": [{"name": "full_ft", "lr": 0.1, "optimizer": {"name": "test_sgd", "nesterov": 1}}]}
            )
        # and by the optimizer itself: SGD refuses a negative momentum
        with pytest.raises(ConfigError, match="Invalid momentum value"):
            config_from_dict({"methods": [{"name": "full_ft", "optimizer": {"name": "test_sgd", "momentum": -1}}]})
    finally:
        del choices.OPTIMIZER_CHOICES["test_sgd"]


def test_a_name_is_registered_once():
    class Other(choices.OptimizerChoice):
        name = "adamw"
        steps = "parameters"

    with pytest.raises(ValueError, match="an optimizer named 'adamw' is already registered"):
        choices.register_optimizer(Other)


def test_lora_opt_steps_its_factors_with_any_parameter_optimizer_and_the_head_with_adamw():
    seq = token_sequence()
    method = get_continual_method("lora_opt")(
        lr=2e-3, head_lr=1e-2, optimizer={"name": "dct_adamw", "rank": 2}, adapter=lora_adapter(4)
    )
    model = method.build(tiny_classifier(seq.num_classes), _ctx(seq))
    optimizer = method.make_optimizer(model, method.trainable_parameters(model, _ctx(seq)), _ctx(seq))
    assert isinstance(optimizer, choices.StepTogether)
    factors, head = optimizer.optimizers
    assert isinstance(factors, DCTAdamW) and factors.param_groups[0]["lr"] == 2e-3
    assert isinstance(head, torch.optim.AdamW) and head.param_groups[0]["lr"] == 1e-2
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("lora_" in names[id(p)] for g in factors.param_groups for p in g["params"])
    assert all("classifier" in names[id(p)] for g in head.param_groups for p in g["params"])
    # AdamW holds both in one optimizer, each group at its lr
    method = get_continual_method("lora_opt")(lr=2e-3, head_lr=1e-2, adapter=lora_adapter(4))
    model = method.build(tiny_classifier(seq.num_classes), _ctx(seq))
    adamw = method.make_optimizer(model, method.trainable_parameters(model, _ctx(seq)), _ctx(seq))
    assert type(adamw) is torch.optim.AdamW and [g["lr"] for g in adamw.param_groups] == [2e-3, 1e-2]


@pytest.mark.parametrize(("name", "cls"), [("riemannion", Riemannion), ("riemannlora", RiemannLoRA)])
def test_riemannion_takes_its_optimizer_and_options_from_the_section(name, cls):
    seq = token_sequence()
    method = get_continual_method("riemannion")(
        lr=0.05, head_lr=1e-3, init="random", optimizer={"name": name, "momentum": 0.5}, adapter={"r": 2}
    )
    model = method.build(tiny_classifier(seq.num_classes), _ctx(seq))
    optimizer = method.make_optimizer(model, method.trainable_parameters(model, _ctx(seq)), _ctx(seq))
    assert type(optimizer) is cls
    assert {g["lr"] for g in optimizer.param_groups} == {0.05, 1e-3}
    assert {g["momentum"] for g in optimizer.param_groups if g.get("manifold")} == {0.5}


def test_the_old_variant_option_still_names_the_optimizer():
    with pytest.warns(DeprecationWarning, match="`variant: sgd` is now `optimizer: riemannlora`"):
        method = get_continual_method("riemannion")(lr=0.1, variant="sgd", nesterov=True)
    assert method.options.optimizer["name"] == "riemannlora" and method.options.optimizer["nesterov"] is True


def test_an_optimizer_that_needs_whole_matrices_keeps_the_method_off_fsdp2_shards():
    full_ft = get_continual_method("full_ft")
    assert full_ft(optimizer="dct_adamw").needs_whole_parameters is None  # DCT-AdamW steps row shards
    assert "SVD" in full_ft(optimizer="galore_adamw").needs_whole_parameters
    lora_opt = get_continual_method("lora_opt")
    assert "preconditioner" in lora_opt(optimizer="riemannian_precond").needs_whole_parameters


def test_a_tuned_setting_reaches_into_the_optimizer_section():
    options = get_continual_method("full_ft")(optimizer="dct_adamw").options
    assert with_setting(options, "optimizer.rank", 16).optimizer["rank"] == 16
    with pytest.raises(ConfigError, match=r"optimizer.rank: 0"):
        with_setting(options, "optimizer.rank", 0)


def test_no_method_module_decides_by_an_optimizer_name():
    """The method modules hand their parameters to the registry; none tests an optimizer's name or lists them."""
    names = "|".join(sorted(choices.OPTIMIZER_CHOICES))
    pattern = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|choices.OPTIMIZER_CHOICES\s*=|DEFAULT_PROJ_GAP""")
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(METHODS.glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)
