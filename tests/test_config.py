import copy
from pathlib import Path

import pytest
import yaml

from peft_ext.continual.config import ConfigError, apply_overrides, config_from_dict, load_config
from peft_ext.jobs import load_job_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


@pytest.fixture
def data():
    return yaml.safe_load(QUICKSTART.read_text())


def test_every_shipped_config_is_valid():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert QUICKSTART in configs
    for path in configs:
        cfg = load_job_config(path)  # continual jobs and `job: missing_modality`
        assert cfg.methods, path


def test_quickstart_values(data):
    cfg = config_from_dict(data)
    every = ["frozen_linear", "seq_lora", "inflora", "olora", "osf", "splitlora", "pclr", "joint"]
    assert [m.name for m in cfg.methods] == [*every, "ncm", "slda", "ranpac"]  # then the training-free baselines
    heads = {m.options.label or m.name: m.options.head for m in cfg.methods}
    assert heads["splitlora"] == heads["pclr"] == heads["inflora"] == "analytic" and heads["seq_lora"] is None
    assert cfg.methods[1].options.adapter.r == 8 and cfg.methods[1].options.lr == pytest.approx(1e-3)
    pclr = cfg.methods[6].options
    assert (pclr.adapter.pool_size, pclr.adapter.top_k, pclr.adapter.shared_r) == (64, 16, 4)
    assert pclr.adapter.modules_to_save is None  # the method sets the head when it builds the model
    assert cfg.data.n_tasks == 5 and cfg.data.classes_per_task == 4


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(trian={}), r"unknown key `trian` \(did you mean `train`\?\)"),
        (lambda d: d["train"].update(epoch=2), r"unknown key `train.epoch` \(did you mean `epochs`\?\)"),
        (lambda d: d["train"].update(epochs="two"), r"`train.epochs` must be an integer, got str 'two'"),
        (lambda d: d["train"].update(epochs=2.5), r"`train.epochs` must be an integer"),
        (lambda d: d["train"].update(epochs=0), r"`train.epochs` must be a positive integer, got 0"),
        (lambda d: d["train"].update(progress="yes"), r"`train.progress` must be true or false"),
        (lambda d: d["data"].update(protocol="online"), r"`data.protocol` must be one of"),
        (
            lambda d: d["data"].update(dataset="imagenet"),
            r"`data.dataset` must be one of \['wordnet', 'fortunes', 'instruct', 'files', 'instructions'\]",
        ),
        (lambda d: d["data"].update(classes=["noun.animal"]), r"`data.classes` lists 1 names"),
        (lambda d: d["methods"][1].update(lr=-1), r"`methods\[1\].lr` must be > 0, got -1.0"),
        (lambda d: d["methods"][6]["adapter"].update(pool_size=0), r"`methods\[6\].adapter.pool_size` must be a pos"),
        (lambda d: d["methods"][6]["adapter"].update(pool_siz=8), r"`methods\[6\].adapter.pool_siz` \(did you m"),
        (lambda d: d["methods"][6]["adapter"].update(modules_to_save=["x"]), r"`methods\[6\].adapter.modules_to_sa"),
        (lambda d: d["methods"][5]["adapter"].update(seed=3), r"`methods\[5\].adapter.seed` is set by the method"),
        (lambda d: d["methods"][6].update(adapter=[1]), r"`methods\[6\].adapter` must be a mapping"),
        (
            lambda d: d["methods"][6].update(cycle={"integrate_lr": 0}),
            r"`methods\[6\].cycle.integrate_lr` must be > 0",
        ),
        (lambda d: d["methods"][1]["adapter"].update(r=0), r"`methods\[1\].adapter.r` must be a positive integer"),
        (lambda d: d["methods"][1].update(rank=4), r"unknown key `methods\[1\].rank`"),
        (lambda d: d["methods"][0].update(name="ewc"), r"`methods\[0\].name`: unknown continual method 'ewc'"),
        (
            lambda d: d["methods"][0].update(name="splitlroa"),
            r"unknown continual method 'splitlroa'; did you mean 'splitlora'\? registered methods: \[",
        ),
        (lambda d: d["methods"][0].update(r=4), r"unknown key `methods\[0\].r`"),
        (lambda d: d.update(methods=[]), r"`methods` must be a non-empty list"),
        (lambda d: d["methods"].append({"name": "seq_lora"}), r"two entries labelled 'seq_lora'"),
        (lambda d: d["model"].update(backbone="./no/such/model"), r"`model.backbone` './no/such/model' looks like"),
        (lambda d: d.update(model=[1, 2]), r"`model` must be a mapping"),
    ],
)
def test_bad_values_name_the_key_and_what_is_valid(data, mutate, message):
    mutate(data)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_yaml_exponent_without_dot_is_read_as_a_number(data):
    data["methods"][1]["lr"] = "1e-3"  # what yaml.safe_load gives for `lr: 1e-3`
    assert config_from_dict(data).methods[1].options.lr == pytest.approx(1e-3)
    data["methods"][1]["lr"] = "fast"
    with pytest.raises(ConfigError, match=r"`methods\[1\].lr` must be a number, got str 'fast'"):
        config_from_dict(data)


def test_output_dir_that_is_a_file(tmp_path, data):
    f = tmp_path / "file"
    f.write_text("x")
    data["output"]["dir"] = str(f)
    with pytest.raises(ConfigError, match=r"`output.dir` .* is not a directory"):
        config_from_dict(data)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_overrides(data):
    d = apply_overrides(copy.deepcopy(data), ["train.epochs=3", "methods.seq_lora.lr=5e-4", "methods.0.lr=0.1"])
    cfg = config_from_dict(d)
    assert cfg.train.epochs == 3
    assert cfg.methods[1].options.lr == pytest.approx(5e-4)
    assert cfg.methods[0].options.lr == pytest.approx(0.1)
    d = apply_overrides(copy.deepcopy(data), ["data.classes=[a, b]", "data.n_tasks=1", "data.classes_per_task=2"])
    assert d["data"]["classes"] == ["a", "b"]
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(copy.deepcopy(data), ["train.epochs"])
    with pytest.raises(ConfigError, match="no entry named 'lora'"):
        apply_overrides(copy.deepcopy(data), ["methods.lora.lr=1"])
    with pytest.raises(ConfigError, match="index 12 is out of range"):
        apply_overrides(copy.deepcopy(data), ["methods.12.lr=1"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides(copy.deepcopy(data), ["name.x=1"])


def test_flat_adapter_keys_still_load_with_a_warning_that_shows_the_new_form(data):
    pclr = data["methods"][6]
    nested = config_from_dict(copy.deepcopy(data)).methods[6].options.adapter
    pclr.update(pclr.pop("adapter"))  # the old layout: adapter fields beside the method's own
    with pytest.warns(DeprecationWarning, match=r"`methods\[6\].pool_size` .* write `adapter: \{pool_size: 64, "):
        flat = config_from_dict(data).methods[6].options.adapter
    assert flat == nested
    lora = {"name": "seq_lora", "r": 4, "alpha": 32.0, "dropout": 0.1}  # renamed: lora_alpha, lora_dropout
    with pytest.warns(DeprecationWarning, match=r"lora_alpha: 32.0"):
        adapter = config_from_dict({"methods": [lora]}).methods[0].options.adapter
    assert (adapter.r, adapter.lora_alpha, adapter.lora_dropout) == (4, 32.0, 0.1)


def test_one_default_per_adapter_setting():
    """A method's adapter settings default to the adapter config's own defaults; the method adds nothing."""
    from peft import LoraConfig

    from peft_ext import PCLRConfig, RiemannionConfig, SplitLoRAConfig

    expected = {"pclr": PCLRConfig(), "splitlora": SplitLoRAConfig(), "riemannion": RiemannionConfig()}
    expected.update(dict.fromkeys(["seq_lora", "joint", "olora", "lora_opt"], LoraConfig()))
    config = config_from_dict({"methods": [{"name": name} for name in expected]})
    for entry in config.methods:
        assert entry.options.adapter == expected[entry.name], entry.name


def test_set_overrides_reach_the_adapter_section(data):
    d = apply_overrides(copy.deepcopy(data), ["methods.pclr.adapter.pool_size=48", "methods.seq_lora.adapter.r=2"])
    cfg = config_from_dict(d)
    assert cfg.methods[6].options.adapter.pool_size == 48 and cfg.methods[1].options.adapter.r == 2
    assert cfg.methods[6].options.adapter.top_k == 16  # the rest of the section is kept


def test_a_trained_method_without_an_lr_is_named_with_the_default_it_gets(data):
    import warnings

    del data["methods"][1]["lr"]  # seq_lora
    said = r"`methods\[1\]` \(seq_lora\) gives no `lr`: it trains at the default 0\.001"
    with pytest.warns(UserWarning, match=said):
        config_from_dict(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shipped config (every trained method gives one; baselines train nothing)
        config_from_dict(yaml.safe_load(QUICKSTART.read_text()))
