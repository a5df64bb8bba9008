"""DCT-AdamW in the places users put an optimizer: transformers.Trainer (both ways of passing one, checkpoint resume
through Trainer's weights_only loading), a PEFT-wrapped model, and the continual runner's ``full_ft`` method."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel, Trainer, TrainingArguments

from peft_ext.continual import TrainConfig, get_continual_method, run_sequence
from peft_ext.continual.config import ConfigError, config_from_dict, load_config
from peft_ext.continual.methods.full_ft import FullFineTune
from peft_ext.jobs.resume import config_hash
from peft_ext.models import SentenceClassifier
from peft_ext.optim import DCTAdamW

from .helpers import dead_adapter, stack_collate, tiny_classifier, token_sequence, training_only
from .single_thread import single_thread  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]


# One torch thread: with two, torch's OpenMP threads spin-wait after every op while bitsandbytes' CPU kernels (linked
# against the system libgomp, a second OpenMP runtime) want the same cores; the 8-bit tests then ran up to 200x slower
# on the busy 2-core machine (docs/dct_adamw.md). Tiny tensors gain nothing from a second thread anyway.
pytestmark = pytest.mark.usefixtures("single_thread")


def no_dropout_classifier(num_labels: int = 6, seed: int = 0) -> SentenceClassifier:
    """A 2-layer BERT classifier without dropout, so two runs from the same state are bit-identical."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return SentenceClassifier(BertModel(config, add_pooling_layer=False), num_labels, dropout=0.0)


def token_dataset(n_per_class: int = 16) -> list[dict[str, torch.Tensor]]:
    seq = token_sequence(n_tasks=3, classes_per_task=2, per_class=n_per_class)
    return [
        {"input_ids": ex.inputs, "attention_mask": torch.ones_like(ex.inputs), "labels": torch.tensor(ex.label)}
        for task in seq.tasks
        for ex in task.train
    ]


def mean_loss(model: nn.Module, data: list[dict[str, torch.Tensor]]) -> float:
    batch = {k: torch.stack([d[k] for d in data]) for k in data[0]}
    with torch.no_grad():
        return model(**batch).loss.item()


def args(tmp_path: Path, **kw) -> TrainingArguments:
    base = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 16,
        "max_steps": 12,
        "learning_rate": 5e-3,
        "lr_scheduler_type": "constant",
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "logging_steps": 100,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    return TrainingArguments(**{**base, **kw})


def unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Trainer wraps the optimizer in accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)


def test_trainer_with_an_optimizer_instance(tmp_path):
    model = no_dropout_classifier()
    data = token_dataset()
    before = mean_loss(model, data)
    optimizer = DCTAdamW(model.named_parameters(), lr=5e-3, rank=4, target_modules=["query", "value", "dense"])
    trainer = Trainer(model=model, args=args(tmp_path), train_dataset=data, optimizers=(optimizer, None))
    trainer.train()
    assert unwrap(trainer.optimizer) is optimizer
    projected = {n for n, _, r in optimizer.projection_plan() if r is not None}
    assert "encoder.encoder.layer.0.attention.self.query.weight" in projected
    assert "encoder.embeddings.word_embeddings.weight" not in projected
    for name, p in model.named_parameters():
        assert ("indices" in optimizer.state[p]) == (name in projected), name
    assert optimizer.state[model.classifier.weight]["step"] == 12
    assert mean_loss(model, data) < 0.8 * before


@pytest.mark.filterwarnings("ignore:DCTAdamW. .rank. exceeds:UserWarning")  # token-type embeddings are 2 x 32
@pytest.mark.parametrize("named", [False, True], ids=["trainer-groups", "named-params"])
def test_trainer_with_optimizer_cls_and_kwargs(tmp_path, named):
    model = no_dropout_classifier()
    data = token_dataset()
    before = mean_loss(model, data)
    kwargs = {"lr": 5e-3, "rank": 4}  # Trainer passes these kwargs as they are: its learning_rate is not added
    if named:
        # target_modules needs names; Trainer's own groups have none, so hand it named parameters
        kwargs.update(params=list(model.named_parameters()), target_modules=["query", "value"])
    trainer = Trainer(
        model=model,
        args=args(tmp_path, weight_decay=0.01),
        train_dataset=data,
        optimizer_cls_and_kwargs=(DCTAdamW, kwargs),
    )
    trainer.train()
    optimizer = unwrap(trainer.optimizer)
    assert isinstance(optimizer, DCTAdamW)
    if named:
        assert len(optimizer.param_groups) == 1
    else:  # Trainer's split: decay for weights, none for biases and LayerNorm
        assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    query = model.encoder.encoder.layer[0].attention.self.query.weight
    key = model.encoder.encoder.layer[0].attention.self.key.weight
    assert optimizer.state[query]["rank"] == 4
    assert ("indices" in optimizer.state[key]) == (not named)
    assert mean_loss(model, data) < 0.8 * before


def test_trainer_checkpoint_resume_is_identical_with_weights_only_loading(tmp_path):
    """Trainer reloads optimizer.pt with torch.load(weights_only=True): GaLore's projector objects fail there."""
    data = token_dataset()
    opts = {"lr": 5e-3, "rank": 4, "error_feedback": True, "target_modules": ["query", "value", "dense"]}

    def run(out: Path, resume: str | None = None) -> SentenceClassifier:
        model = no_dropout_classifier()
        trainer = Trainer(
            model=model,
            args=args(out, save_strategy="steps", save_steps=5, max_steps=10),
            train_dataset=data,
            optimizers=(DCTAdamW(model.named_parameters(), **opts), None),
        )
        trainer.train(resume_from_checkpoint=resume)
        return model

    full = run(tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoint-5"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert any("indices" in s for s in state["state"].values())
    resumed = run(tmp_path / "b", resume=str(checkpoint))
    for (name, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_peft_wrapped_model_with_trainer(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        no_dropout_classifier(),
        LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], modules_to_save=["classifier"]),
    )
    data = token_dataset()
    before = mean_loss(model, data)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = DCTAdamW(trainable, lr=1e-2, rank=4, target_modules=["query", "value"])
    trainer = Trainer(model=model, args=args(tmp_path, max_steps=30), train_dataset=data, optimizers=(optimizer, None))
    trainer.train()
    plan = {n: r for n, _, r in optimizer.projection_plan()}
    lora_a = "base_model.model.encoder.encoder.layer.0.attention.self.query.lora_A.default.weight"
    lora_b = "base_model.model.encoder.encoder.layer.0.attention.self.query.lora_B.default.weight"
    assert plan[lora_a] == 4 and plan[lora_b] == 4, "PEFT's module names match by component"
    head = [n for n in plan if "classifier.modules_to_save" in n and n.endswith("weight")]
    assert head and plan[head[0]] is None
    params = dict(model.named_parameters())
    assert optimizer.state[params[lora_a]]["exp_avg"].shape == (4, 32), "lora_A (8 x 32) projects from the left"
    assert optimizer.state[params[lora_b]]["exp_avg"].shape == (32, 4), "lora_B (32 x 8) projects from the right"
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), f"{name} is frozen and must not move"
    assert mean_loss(model, data) < 0.8 * before


# ----------------------------------------------------------------------------------------------------------------
# the full_ft continual method


@pytest.mark.parametrize("optimizer", ["adamw", "galore_adamw", "dct_adamw", "dead_backbone"])
def test_full_ft_learns_each_task_with_every_optimizer(optimizer):
    """The classifier frozen at its random init, so each task is learned through the backbone's update, the part of
    full fine-tuning the optimizers differ in (a trained head separates these token classes by itself). Measured:
    every task 1.0 with each optimizer; with the backbone's update zeroed (``dead_backbone``, AdamW) 0.75, 0.92 and
    0.0 (the random head's own), so the bound fails there."""
    learns = optimizer != "dead_backbone"
    seq = token_sequence()
    targets = ["query", "key", "value", "dense"]
    spec = (
        "adamw"
        if optimizer in ("adamw", "dead_backbone")
        else {"name": optimizer, "rank": 4, "scale": 1.0, "target_modules": targets}
    )
    method = training_only(get_continual_method("full_ft")(optimizer=spec, lr=3e-3), head=False)
    if not learns:
        method = dead_adapter(method, ("encoder.",))  # every backbone parameter put back after each step
    result = run_sequence(
        seq,
        method,
        tiny_classifier(seq.num_classes),
        stack_collate,
        TrainConfig(epochs=4, batch_size=8, progress=False, device="cpu"),
    )
    head = 32 * seq.num_classes + seq.num_classes
    assert result.trainable_params == result.total_params - head  # everything but the frozen classifier
    assert (min(result.accuracy_matrix[i][i] for i in range(len(seq))) > 0.8) is learns, result.accuracy_matrix
    assert all(math.isfinite(x) for x in result.task_losses)


def test_full_ft_builds_the_optimizer_it_names():
    from galore_torch import GaLoreAdamW

    model = tiny_classifier(4)
    params = list(model.parameters())
    targets = ["query", "key", "value", "dense"]
    adamw = FullFineTune(optimizer="adamw", lr=1e-3).make_optimizer(model, params, None)
    assert type(adamw) is torch.optim.AdamW
    dct_spec = {"name": "dct_adamw", "rank": 4, "moments_8bit": True, "target_modules": targets}
    dct = FullFineTune(optimizer=dct_spec, lr=1e-3).make_optimizer(model, params, None)
    assert isinstance(dct, DCTAdamW) and dct.param_groups[0]["update_proj_gap"] == 1  # DCT-AdamW's own default
    assert dct.param_groups[0]["moments_8bit"]
    galore_spec = {"name": "galore_adamw", "rank": 4, "target_modules": targets}
    galore = FullFineTune(optimizer=galore_spec, lr=1e-3).make_optimizer(model, params, None)
    assert isinstance(galore, GaLoreAdamW)
    projected_group = next(g for g in galore.param_groups if "rank" in g)
    assert projected_group["update_proj_gap"] == 200 and projected_group["rank"] == 4  # GaLore's own gap
    # both low-rank optimizers project exactly the same matrices: the 2-D weights of the targets
    galore_ids = {id(p) for p in projected_group["params"]}
    dct_projected = {n for n, _, r in dct.projection_plan() if r is not None}
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in galore_ids} == dct_projected
    expected = {n for n, p in model.named_parameters() if p.ndim == 2 and n.split(".")[-2] in targets}
    assert dct_projected == expected and expected


def test_full_ft_takes_the_old_flat_optimizer_keys_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"optimizer: \{name: 'dct_adamw', rank: 4, scale: 2.0\}"):
        method = FullFineTune(optimizer="dct_adamw", lr=1e-3, rank=4, scale=2.0)
    assert method.options.optimizer["rank"] == 4 and method.options.optimizer["scale"] == 2.0
    with pytest.warns(DeprecationWarning):
        config = config_from_dict({"methods": [{"name": "full_ft", "optimizer": "dct_adamw", "rank": 4}]})
    assert config.methods[0].options.optimizer == method.options.optimizer | {"scale": 1.0}


def test_one_optimizer_spelt_two_ways_is_one_setting():
    """The fingerprint guarding `--resume` holds the effective settings: a name and its defaults written out agree."""

    def config(optimizer):
        return config_from_dict({"methods": [{"name": "full_ft", "lr": 1e-3, "optimizer": optimizer}]})

    short, spelt = config("dct_adamw"), config({"name": "dct_adamw", "rank": 128})
    assert config_hash(short) == config_hash(spelt) != config_hash(config({"name": "dct_adamw", "rank": 64}))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"optimizer": "sgd"}, r"`methods\[0\].optimizer` must be one of"),
        ({"optimizer": {"name": "dct_adamw", "rank": 0}}, r"`methods\[0\].optimizer` 'dct_adamw': `rank` must be a "),
        ({"optimizer": {"name": "dct_adamw", "update_proj_gap": 0}}, r"`update_proj_gap` must be a positive"),
        ({"optimizer": {"name": "galore_adamw", "scale": 0}}, r"'galore_adamw': `scale` must be > 0"),
        ({"optimizer": {"name": "galore_adamw", "target_modules": []}}, r"`target_modules` must name at least one"),
        ({"optimizer": {"name": "dct_adamw", "betas": [0.9]}}, r"'dct_adamw': `betas`"),
        ({"optimizer": {"name": "dct_adamw", "dct_method": "svd"}}, r"`dct_method` must be one of"),
        ({"optimizer": {"name": "dct_adamw", "ranks": 8}}, r"`methods\[0\].optimizer.ranks` is not an option of"),
        ({"optimizer": "muon"}, r"'muon' steps lora factors, which this method does not offer; it can train with"),
        ({"optimizer": {"rank": 8}}, r"`methods\[0\].optimizer` must be a name or a mapping with a `name`"),
    ],
)
def test_full_ft_options_are_validated_in_configs(options, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"methods": [{"name": "full_ft", **options}]})


def test_shipped_config_uses_every_eligible_class():
    from peft_ext.data.wordnet import class_counts

    cfg = load_config(ROOT / "configs" / "dct_adamw_wordnet.yaml")
    data = cfg.data
    eligible = [
        c for c in class_counts().values() if c["train"] >= data.train_per_class and c["test"] >= data.test_per_class
    ]
    assert data.n_tasks == 1 and data.classes_per_task == len(eligible)
    galore, dct = (cfg.methods[i].options.optimizer for i in (1, 2))
    assert [m.options.optimizer["name"] for m in cfg.methods] == ["adamw", "galore_adamw", "dct_adamw"]
    # the comparison isolates the projection: the same matrices, rank, multiplier and Adam settings
    same = ("rank", "scale", "target_modules", "max_shape", "eps", "betas")
    assert {k: galore[k] for k in same} == {k: dct[k] for k in same}
    assert cfg.methods[0].options.optimizer["eps"] == dct["eps"]


@pytest.mark.slow
def test_shipped_config_runs_end_to_end(tmp_path, capsys):
    """The real pretrained MiniLM-L6 through the CLI, shrunk to a handful of examples per class."""
    from peft_ext_cli import main

    rc = main(
        [
            "run",
            str(ROOT / "configs" / "dct_adamw_wordnet.yaml"),
            "--no-progress",
            "--set",
            "data.train_per_class=2",
            "--set",
            "data.test_per_class=2",
            "--set",
            "train.epochs=1",
            "--set",
            "model.max_length=16",
            "--set",
            f"output.dir={tmp_path}",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    for label in ("adamw", "galore_adamw_r8", "dct_adamw_r8"):
        assert f"| {label} |" in out
    assert (tmp_path / "results.json").is_file()
