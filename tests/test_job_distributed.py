"""``torchrun --nproc_per_node 2 -m peft_ext run CONFIG`` (gloo, CPU): the job trains every method data-parallel and
ends with the report of one process on the same config, within rounding; rank 0 alone prints and writes; a resume
on another number of processes is refused. With ``train.sharding: fsdp2`` the same holds for the methods trained on
FSDP2 shards, and for a run interrupted and resumed mid-method.

Tolerance: two processes average the gradients of two half-batch means where one process takes the mean of the whole
batch, so the sums round differently (about 1e-7 relative per step) and the differences grow a little over the
steps. Each accuracy may therefore move by at most one test example (an example on the decision boundary can flip),
and each task's mean training loss by 1e-6 relative (measured: at most 5e-8, and the same accuracies). The batch
size is even, so the halves are equal. The backbone has no dropout: with dropout, each process draws its own masks
and the runs are not comparable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peft_ext.distributed import is_dtensor
from peft_ext_cli import main

from .helpers import (
    ROOT,
    accelerate_launcher,
    job_config,
    launcher,
    opt_in_accelerate,
    run_launcher,
    save_tiny_bert,
)

METHODS = ["seq_lora", "splitlora"]
LOSS_RTOL = 1e-6


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    path = save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=1, seed=0)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _cfg(tmp_path: Path, backbone: Path, methods: list[str] = METHODS, sharding: str = "none") -> Path:
    def edit(data: dict) -> None:
        data["model"].update(backbone=str(backbone), dropout=0.0)
        data["data"].update(n_tasks=2, classes_per_task=2, train_per_class=8, test_per_class=4)
        data["train"].update(epochs=1, batch_size=4, sharding=sharding)  # even: two equal halves
        data["methods"] = [m for m in data["methods"] if m["name"] in methods]
        for m in data["methods"]:
            if "r" in m.get("adapter", {}):
                m["adapter"]["r"] = 2

    return job_config(tmp_path, "quickstart", edit)


def _torchrun(*args: str, ok: bool = True, timeout: float = 120) -> tuple[str, str]:
    """``torchrun --standalone --nproc_per_node=2 ARGS`` (:func:`~tests.helpers.run_launcher`): stdout, stderr."""
    torchrun = launcher("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python (it ships with torch)")
    return run_launcher([torchrun, "--standalone", "--nproc_per_node=2", *args], timeout=timeout, ok=ok)


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def _report(out: Path) -> list[dict]:
    """The results without timings (the only part an interruption may change)."""

    def untimed(d: dict) -> dict:
        return {k: untimed(v) if isinstance(v, dict) else v for k, v in d.items() if not k.endswith("_seconds")}

    return [untimed(r) for r in _results(out)["results"]]


def _assert_same_report(one: dict, two: dict) -> None:
    """The accuracy matrices within one test example and the task losses within LOSS_RTOL (the module docstring)."""
    one_example = 1 / (2 * 4)  # classes_per_task * test_per_class
    assert [r["label"] for r in one["results"]] == [r["label"] for r in two["results"]] and not two.get("failed")
    for a, b in zip(one["results"], two["results"]):
        for row_a, row_b in zip(a["accuracy_matrix"], b["accuracy_matrix"]):
            for x, y in zip(row_a, row_b):
                assert (x is None) == (y is None) and (x is None or abs(x - y) <= one_example + 1e-9), (a, b)
        for x, y in zip(a["task_losses"], b["task_losses"]):
            assert abs(x - y) <= LOSS_RTOL * abs(x), (a["label"], a["task_losses"], b["task_losses"])


@pytest.fixture(scope="module")
def two(tmp_path_factory, backbone):
    """The job on 2 processes: its config, output dir and stdout."""
    folder = tmp_path_factory.mktemp("two")
    cfg = _cfg(folder, backbone)
    stdout, _ = _torchrun("-m", "peft_ext", "run", str(cfg), "--no-progress")
    return cfg, folder / "out", stdout


@pytest.mark.distributed
def test_two_processes_match_one_and_only_rank_zero_prints_and_writes(tmp_path, backbone, two, capsys):
    _, out, stdout = two
    for label in METHODS:
        assert stdout.count(f"[peft-ext] method {label}\n") == 1, stdout
    assert stdout.count("[peft-ext] wrote ") == 1
    assert sorted(p.name for p in out.iterdir()) == ["accuracy_matrix.png", "adapters", "results.json", "results.md"]
    # rank 0 alone saved each method's trained model, once
    assert sorted(p.name for p in (out / "adapters").iterdir()) == sorted(METHODS)

    assert main(["run", str(_cfg(tmp_path, backbone)), "--no-progress"]) == 0
    one, two_ = _results(tmp_path / "out"), _results(out)
    assert (one["meta"]["world_size"], two_["meta"]["world_size"]) == (1, 2)
    assert [r["label"] for r in two_["results"]] == METHODS
    _assert_same_report(one, two_)


@pytest.mark.distributed
def test_resume_on_another_number_of_processes_is_refused(two, capsys):
    cfg, out, _ = two
    before = (out / "results.json").read_text()
    assert main(["run", str(cfg), "--no-progress", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "was made on 2 process(es), this one has 1" in err and "--nproc_per_node 2" in err
    assert (out / "results.json").read_text() == before


@pytest.mark.distributed
def test_two_processes_resume_mid_method_like_an_uninterrupted_run(tmp_path, backbone, two):
    """Rank 0 stops right after SplitLoRA's first snapshot; resumed on 2 processes, the job ends with the report of
    the uninterrupted 2-process run (the model, method state and random generators of task 0 restored)."""
    cfg, out = _cfg(tmp_path, backbone), tmp_path / "out"
    worker = str(ROOT / "tests" / "workers" / "job_interrupt.py")
    _, stderr = _torchrun(worker, "splitlora", "1", "run", str(cfg), "--no-progress", ok=False)
    assert f"torchrun --nproc_per_node=2 -m peft_ext run {cfg} --resume" in stderr
    assert [r["label"] for r in _report(out)] == METHODS[:1]
    assert (out / "progress" / "01-splitlora" / "task-0.pt").is_file()

    stdout, _ = _torchrun("-m", "peft_ext", "run", str(cfg), "--no-progress", "--resume")
    assert stdout.count("[peft-ext] method seq_lora: finished in the run being resumed") == 1, stdout
    assert stdout.count("[peft-ext] method splitlora: resuming after 1 finished task(s)") == 1, stdout
    assert _report(out) == _report(two[1])
    assert not (out / "progress").exists()


# --- FSDP2 ----------------------------------------------------------------------------------------------------------

# seq_lora, splitlora and pclr train on shards; inflora re-wraps its model every task and trains with whole parameters
SHARDED = ["seq_lora", "splitlora", "pclr"]
FSDP2_METHODS = ["seq_lora", "inflora", "splitlora", "pclr"]  # in the quickstart's order


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, backbone):
    """The job on 2 processes with ``train.sharding: fsdp2``: its config, output dir and stdout."""
    folder = tmp_path_factory.mktemp("fsdp2")
    cfg = _cfg(folder, backbone, FSDP2_METHODS, sharding="fsdp2")
    stdout, _ = _torchrun("-m", "peft_ext", "run", str(cfg), "--no-progress")
    return cfg, folder / "out", stdout


@pytest.mark.distributed
def test_fsdp2_sharded_job_matches_one_process(tmp_path, backbone, sharded):
    _, out, stdout = sharded
    assert "FSDP2: each method's parameters sharded over 2 processes while it trains" in stdout
    assert stdout.count("trains with whole parameters on every process") == 1
    assert "inflora trains with whole parameters on every process (data-parallel), not FSDP2 shards: it re-wraps" in (
        stdout
    )
    two = _results(out)
    assert two["meta"]["sharding"] == "fsdp2" and two["meta"]["world_size"] == 2
    units = {r["label"]: r["extras"].get("fsdp2_units") for r in two["results"]}
    # the model's one encoder layer, the classifier head PEFT trains whole, the root
    assert units == {**{m: 3 for m in SHARDED}, "inflora": None}, units

    assert main(["run", str(_cfg(tmp_path, backbone, FSDP2_METHODS)), "--no-progress"]) == 0
    _assert_same_report(_results(tmp_path / "out"), two)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_job_resumes_mid_method_like_an_uninterrupted_run(tmp_path, backbone, sharded):
    """Rank 0 stops right after SplitLoRA's first snapshot (gathered whole from the shards); resumed on 2 processes,
    the job ends with the report of the uninterrupted sharded run."""
    cfg, out = _cfg(tmp_path, backbone, FSDP2_METHODS, sharding="fsdp2"), tmp_path / "out"
    worker = str(ROOT / "tests" / "workers" / "job_interrupt.py")
    _torchrun(worker, "splitlora", "1", "run", str(cfg), "--no-progress", ok=False)
    snapshot = torch.load(out / "progress" / "02-splitlora" / "task-0.pt", weights_only=True)
    assert not any(is_dtensor(v) for v in snapshot["model"].values())  # whole tensors, loadable by one process

    stdout, _ = _torchrun("-m", "peft_ext", "run", str(cfg), "--no-progress", "--resume")
    assert stdout.count("[peft-ext] method splitlora: resuming after 1 finished task(s)") == 1, stdout
    assert _report(out) == _report(sharded[1])


def _accelerate_fsdp2_job(accelerate: str, tmp_path: Path, backbone: Path, methods: list[str]) -> str:
    """``accelerate launch --config_file FSDP2.yaml -m peft_ext run CONFIG`` of ``methods`` (the config has no
    `train.sharding`): its stdout, after checking that the launcher's FSDP2 settings sharded the job."""
    settings = (ROOT / "tests" / "accelerate_fsdp2.yaml").read_text()
    launch_config = tmp_path / "accelerate_fsdp2_bert.yaml"
    launch_config.write_text(settings.replace("LlamaDecoderLayer", "BertLayer"))
    cfg = _cfg(tmp_path, backbone, methods)
    launch = [accelerate, "launch", "--config_file", str(launch_config)]
    stdout, _ = run_launcher([*launch, "-m", "peft_ext", "run", str(cfg), "--no-progress"])
    assert "FSDP2: each method's parameters sharded over 2 processes" in stdout
    results = _results(tmp_path / "out")
    assert results["meta"]["sharding"] == "fsdp2" and results["meta"]["world_size"] == 2
    return stdout


@pytest.mark.distributed
def test_accelerate_launch_with_an_fsdp2_config_shards_the_job(tmp_path, backbone):
    """The cheap form, run by default: ``accelerate launch --config_file FSDP2.yaml -m peft_ext run CONFIG`` of
    sequential LoRA alone: the launcher's FSDP settings (version 2, the layer class to wrap) turn the job's sharding
    on without `train.sharding` in the config. Its cost is the launch (~12 s), not the tiny job."""
    _accelerate_fsdp2_job(accelerate_launcher(), tmp_path, backbone, ["seq_lora"])
    results = _results(tmp_path / "out")
    assert results["results"][0]["extras"]["fsdp2_units"] == 3


@pytest.mark.distributed
def test_accelerate_launch_with_an_fsdp2_config_reports_like_torchrun(tmp_path, backbone, request):
    """The full form (opt-in): every method of the torchrun FSDP2 job, whose report it equals within rounding."""
    accelerate = opt_in_accelerate("launches the FSDP2 job again under accelerate (~20 s; its cheap form: seq_lora)")
    sharded = request.getfixturevalue("sharded")  # only when opted in: it launches the torchrun job
    stdout = _accelerate_fsdp2_job(accelerate, tmp_path, backbone, FSDP2_METHODS)
    assert stdout.count("trains with whole parameters on every process") == 1  # inflora
    _assert_same_report(_results(sharded[1]), _results(tmp_path / "out"))
