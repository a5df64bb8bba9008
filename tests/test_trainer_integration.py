"""Every peft-ext optimizer in transformers.Trainer through peft_ext.integrations: training, TrainingArguments
selection, checkpoint resume with Trainer's weights_only loading, and the errors a user can act on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from transformers import Trainer

from peft_ext import RiemannionConfig
from peft_ext.integrations import optimizer_for_trainer, optimizer_from_args, parse_optim_args
from peft_ext.optim import DCTAdamW, Riemannion, RiemannLoRA

from .single_thread import single_thread  # noqa: F401  (fixture)
from .test_dct_integration import args, mean_loss, no_dropout_classifier, token_dataset, unwrap

pytestmark = pytest.mark.usefixtures("single_thread")

# Per optimizer: its class and options that learn the tiny task in a dozen steps.
OPTIONS = {
    "riemannion": (Riemannion, {"lr": 0.05, "aux_lr": 3e-2}),
    "riemannlora": (RiemannLoRA, {"lr": 0.5, "aux_lr": 3e-2}),
    "dct_adamw": (DCTAdamW, {"lr": 5e-3, "rank": 4, "target_modules": ["query", "value", "dense"]}),
}


#: The adapters' learning rates when they alone train
ADAPTER_ONLY = {"riemannion": {"lr": 0.2}, "riemannlora": {"lr": 2.0}}
#: The loss each optimizer must reach in 12 steps, as a share of the untrained model's, with the classifier frozen:
#: measured x0.50 for Riemannion, x0.89 for RiemannLoRA (adapters on every projection, nothing else trainable) and
#: x0.24 for DCT-AdamW (the whole backbone); with a negligible step (``dead``) each stays at x1.00
DROP = {"riemannion": 0.95, "riemannlora": 0.95, "dct_adamw": 0.5}
NEGLIGIBLE = 1e-12


def model_for(name: str) -> torch.nn.Module:
    model = no_dropout_classifier()
    if name == "dct_adamw":
        return model
    config = RiemannionConfig(r=4, target_modules=["query", "value"], modules_to_save=["classifier"])
    return get_peft_model(model, config)


@pytest.mark.parametrize(
    "name, learns",
    [(name, True) for name in OPTIONS] + [(name, False) for name in OPTIONS],
    ids=list(OPTIONS) + [f"{name}-dead" for name in OPTIONS],
)
def test_each_optimizer_trains_in_trainer(tmp_path, name, learns):
    """The loss falls through the optimizer's own parameters with the classifier frozen (a trained head lowers it on
    these token classes by itself): Riemannion's adapters alone (no ``modules_to_save``), DCT-AdamW's backbone. With
    the step made negligible (``-dead``) the same bound fails, so a dead adapter or backbone update fails here."""
    cls, options = OPTIONS[name]
    if name == "dct_adamw":  # full fine-tuning but for the classifier: the projected and the plain AdamW weights
        model = no_dropout_classifier()
        model.classifier.requires_grad_(False)
        assert not any(n.startswith("classifier") for n, p in model.named_parameters() if p.requires_grad)
    else:  # adapters on every projection, nothing else trainable
        options = {**options, **ADAPTER_ONLY[name]}
        model = get_peft_model(
            no_dropout_classifier(), RiemannionConfig(r=4, target_modules=["query", "value", "dense"])
        )
        assert all("riemannion_" in n for n, p in model.named_parameters() if p.requires_grad)
    if not learns:
        options = {**options, "lr": NEGLIGIBLE}
    data = token_dataset()
    before = mean_loss(model, data)
    trainer = Trainer(
        model=model,
        args=args(tmp_path),
        train_dataset=data,
        optimizer_cls_and_kwargs=optimizer_for_trainer(name, model, **options),
    )
    trainer.train()
    assert type(unwrap(trainer.optimizer)) is cls
    after = mean_loss(model, data)
    assert (after < DROP[name] * before) is learns, (name, after / before)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_checkpoint_resume_is_identical(tmp_path, name):
    """Trainer reloads optimizer.pt with torch.load(weights_only=True); resuming at step 5 must end where an
    uninterrupted run ends."""
    _, options = OPTIONS[name]
    data = token_dataset()

    def run(out: Path, resume: str | None = None) -> torch.nn.Module:
        model = model_for(name)
        trainer = Trainer(
            model=model,
            args=args(out, save_strategy="steps", save_steps=5, max_steps=10),
            train_dataset=data,
            optimizer_cls_and_kwargs=optimizer_for_trainer(name, model, **options),
        )
        trainer.train(resume_from_checkpoint=resume)
        return model

    full = run(tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoint-5"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert state["state"], "the optimizer state is saved"
    resumed = run(tmp_path / "b", resume=str(checkpoint))
    for (key, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), key


@pytest.mark.filterwarnings("ignore:DCTAdamW. .rank. exceeds:UserWarning")
def test_training_arguments_select_the_optimizer(tmp_path):
    model = model_for("riemannion")
    data = token_dataset()
    before = mean_loss(model, data)
    targs = args(tmp_path, learning_rate=0.05, weight_decay=0.0, optim_args="name=riemannion,aux_lr=3e-2,momentum=0.8")
    cls, kwargs = optimizer_from_args(targs, model)
    assert cls is Riemannion and kwargs["lr"] == 0.05 and kwargs["momentum"] == 0.8 and kwargs["model"] is model
    assert kwargs["aux_betas"] == (targs.adam_beta1, targs.adam_beta2)
    trainer = Trainer(model=model, args=targs, train_dataset=data, optimizer_cls_and_kwargs=(cls, kwargs))
    trainer.train()
    optimizer = unwrap(trainer.optimizer)
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 3e-2]  # manifold group, AdamW group
    assert mean_loss(model, data) < 0.8 * before

    plain = model_for("dct_adamw")
    targs = args(tmp_path, optim_args="name=dct_adamw, rank=4, betas=0.8:0.9, target_modules=query:")
    cls, kwargs = optimizer_from_args(targs, plain)
    assert cls is DCTAdamW and kwargs["betas"] == (0.8, 0.9) and kwargs["target_modules"] == ["query"]
    assert kwargs["lr"] == targs.learning_rate and kwargs["rank"] == 4
    optimizer = cls(kwargs.pop("params"), **kwargs)
    assert {n for n, _, r in optimizer.projection_plan() if r is not None} == {
        f"encoder.encoder.layer.{i}.attention.self.query.weight" for i in range(2)
    }


def test_parse_optim_args_types():
    parsed = parse_optim_args("name=riemannion,lr=1e-3,nesterov=true,rtol=none,rank=8,aux_betas=0.9:0.95,x=abc")
    assert parsed == {
        "name": "riemannion",
        "lr": 1e-3,
        "nesterov": True,
        "rtol": None,
        "rank": 8,
        "aux_betas": (0.9, 0.95),
        "x": "abc",
    }
    assert parse_optim_args(None) == {} and parse_optim_args("") == {}


def test_errors_name_the_problem(tmp_path):
    plain = model_for("dct_adamw")
    with pytest.raises(ValueError, match=r"unknown peft-ext optimizer 'adam'; valid names: \['dct_adamw'"):
        optimizer_for_trainer("adam", plain)
    with pytest.raises(TypeError, match=r"DCTAdamW got unknown options \['momentum'\]"):
        optimizer_for_trainer("dct_adamw", plain, momentum=0.9)
    with pytest.raises(ValueError, match="needs a model with trainable Riemannion adapters"):
        optimizer_for_trainer("riemannion", plain)
    with pytest.raises(ValueError, match="must name a peft-ext optimizer as name="):
        optimizer_from_args(args(tmp_path, optim_args="rank=4"), plain)
    with pytest.raises(ValueError, match="entries must be key=value"):
        parse_optim_args("name=dct_adamw,rank")
    with pytest.raises(ValueError, match="sets 'rank' twice"):
        parse_optim_args("rank=4,rank=8")


@pytest.mark.slow
def test_docs_examples_run(tmp_path, monkeypatch, capsys):
    """docs/trainer.md's python blocks, in order, as written."""
    import re

    doc = Path(__file__).resolve().parents[1] / "docs" / "trainer.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert len(blocks) == 3
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile("\n".join(blocks), str(doc), "exec"), scope)
    result = scope["result"]
    assert result.method == "splitlora" and None not in result.accuracy_matrix[2]
    assert (tmp_path / "out" / "continual" / "continual_state.json").is_file()
    assert "final_acc" in capsys.readouterr().out
