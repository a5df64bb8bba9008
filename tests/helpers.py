"""Shared test fixtures: a tiny text classifier and a small, learnable synthetic task sequence.

The synthetic sequence is only for mechanical runner tests (fast, exact); quality is measured on real data.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from peft import PeftConfig
from torch import nn
from transformers import AutoTokenizer, BertConfig, BertModel

from peft_ext import PCLRConfig, RiemannionConfig, SplitLoRAConfig
from peft_ext.continual import TrainConfig, run_sequence
from peft_ext.data.tasks import Example, Task, TaskSequence
from peft_ext.models import SentenceClassifier, minilm_path, tiny_bert
from peft_ext.tuners.pclr import query_loss

ROOT = Path(__file__).resolve().parents[1]


def tiny_classifier(num_labels: int, seed: int = 0) -> SentenceClassifier:
    return SentenceClassifier(tiny_bert(vocab_size=64, hidden_size=32, seed=seed).bert, num_labels, dropout=0.0)


def token_sequence(n_tasks: int = 3, classes_per_task: int = 2, per_class: int = 24, seed: int = 0) -> TaskSequence:
    """Class c's sentences are drawn from its own 4 token ids (plus shared noise), so classes are separable."""
    gen = torch.Generator().manual_seed(seed)
    n_classes = n_tasks * classes_per_task
    tasks = []
    for t in range(n_tasks):
        classes = list(range(t * classes_per_task, (t + 1) * classes_per_task))
        splits = {"train": [], "test": []}
        for c in classes:
            for split, n in (("train", per_class), ("test", per_class // 2)):
                for _ in range(n):
                    own = 4 + 4 * c + torch.randint(0, 4, (5,), generator=gen)
                    noise = torch.randint(4 + 4 * n_classes, 64, (3,), generator=gen)
                    splits[split].append(Example(torch.cat([own, noise]), c))
        tasks.append(Task(f"t{t}", classes, splits["train"], splits["test"]))
    return TaskSequence("tokens", [f"c{c}" for c in range(n_classes)], tasks)


def stack_collate(examples):
    ids = torch.stack([ex.inputs for ex in examples])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.tensor([e.label for e in examples]),
    }


QUERY_VALUE = ["query", "value"]


def lora_adapter(r: int, lora_alpha: float = 16.0) -> dict:
    """A LoRA ``adapter:`` section with the alpha and targets the LoRA methods used before they embedded LoraConfig."""
    return {"r": r, "lora_alpha": lora_alpha, "target_modules": list(QUERY_VALUE)}


def pclr_adapter(**fields) -> dict:
    """A PCLR ``adapter:`` section: what the ``pclr`` method used before it embedded PCLRConfig, then ``fields``."""
    base = {"pool_size": 64, "ranks_schedule": [16], "compress_schedule": [0.0, 0.0, 0.25], "top_k": 16, "alpha": 16.0}
    return {**base, "shared_r": 4, "shared_alpha": 8.0, "target_modules": list(QUERY_VALUE), **fields}


#: A fresh config of three adapter types on BERT's query and value projections, by the type's name.
ADAPTER_CONFIGS: dict[str, Callable[[], PeftConfig]] = {
    "riemannion": lambda: RiemannionConfig(r=4, target_modules=list(QUERY_VALUE)),
    "splitlora": lambda: SplitLoRAConfig(r=4, target_modules=list(QUERY_VALUE)),
    "pclr": lambda: PCLRConfig(target_modules=list(QUERY_VALUE), pool_size=8, ranks_schedule=[4], top_k=2),
}


class ContractMLP(nn.Module):
    """Two hidden linears and a head, ``forward(x)`` like any model PEFT wraps: the tuner-contract test model.

    ``widths``: input, the two hidden widths, output. The contract's are 64: bitsandbytes' CPU 4-bit inference kernel
    (used on AVX512-BF16 machines) repacks the weight in blocks of 32 output rows and 64 input columns and refuses
    other shapes.
    """

    def __init__(self, widths: tuple[int, int, int, int] = (64, 64, 64, 5)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin0 = nn.Linear(widths[0], widths[1])
        self.lin1 = nn.Linear(widths[1], widths[2])
        self.head = nn.Linear(widths[2], widths[3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin1(torch.tanh(self.lin0(x)))))


def run_recording_state(seq: TaskSequence, method, epochs: int = 2, batch_size: int = 8) -> tuple[dict, dict]:
    """``run_sequence`` of ``method`` over ``seq`` on :func:`tiny_classifier`; returns the result and the method's
    ``state`` as it stood after the last ``after_task`` (what the method recorded there)."""
    recorded = {}
    original = method.after_task

    def after_task(model, task_id, task, ctx):
        out = original(model, task_id, task, ctx)
        recorded.update(method.state)
        return out

    method.after_task = after_task
    config = TrainConfig(epochs=epochs, batch_size=batch_size, progress=False)
    return run_sequence(seq, method, tiny_classifier(seq.num_classes), stack_collate, config), recorded


def training_only(method, *, head: bool = True, adapter: bool = True, adapter_markers: tuple[str, ...] = ()):
    """``method`` with part of what it trains left frozen: the head (``head=False``: the ``classifier`` module, or its
    copy in ``modules_to_save``) and / or the adapter (``adapter=False``: parameters whose names contain one of
    ``adapter_markers``, e.g. ``("pclr_A", "pclr_B")``: a dead adapter). On the tests' separable token data a trained
    head learns a task alone, so a check that the adapter learns freezes the head, and a check of that check kills the
    adapter too.
    """
    chosen = method.trainable_parameters

    def trainable_parameters(model, ctx):
        names = {id(p): n for n, p in model.named_parameters()}
        kept = []
        for p in chosen(model, ctx):
            name = names[id(p)]
            in_head = "modules_to_save" in name or "classifier" in name.split(".")  # the runner's head module
            drop = (not head and in_head) or (not adapter and any(m in name for m in adapter_markers))
            p.requires_grad_(not drop)
            if not drop:
                kept.append(p)
        return kept

    method.trainable_parameters = trainable_parameters
    return method


def dead_adapter(method, adapter_markers: tuple[str, ...]):
    """``method`` with its adapter's update zeroed: after every step of the method's optimizer, the parameters whose
    names contain one of ``adapter_markers`` (e.g. ``("lora_A", "lora_B")``) are put back where the step found them.
    Everything else runs as before (the same optimizer over the same parameters, the method's hooks, its head if it
    trains one), so a learning check run on it shows that its bound fails when the adapter learns nothing. Unlike
    ``training_only(adapter=False)`` it works when the adapter is all a method trains (with the head frozen: the
    runner refuses an empty parameter list) and for optimizers that find their adapters in the model.
    """
    make_optimizer = method.make_optimizer

    def make_dead_optimizer(model, params, ctx):
        optimizer = make_optimizer(model, params, ctx)
        adapter = [p for n, p in model.named_parameters() if any(m in n for m in adapter_markers)]
        assert adapter, f"no parameter of the model is named with one of {adapter_markers}"
        before: list[torch.Tensor] = []

        def remember(*_):
            before[:] = [p.detach().clone() for p in adapter]

        def restore(*_):
            with torch.no_grad():
                for p, value in zip(adapter, before):
                    p.copy_(value)

        optimizer.register_step_pre_hook(remember)
        optimizer.register_step_post_hook(restore)
        return optimizer

    method.make_optimizer = make_dead_optimizer
    return method


#: The analytic head's random projection in the jobs tests build on tiny backbones: RanPAC's 2048 columns make its
#: per-task eigendecomposition of a 2048 x 2048 Gram matrix most of such a job's time (108 of 145 s in the resume
#: test's job, profiled), and nothing those tests check depends on the width.
TEST_HEAD_DIM = 64


def small_analytic_heads(data: dict, dim: int = TEST_HEAD_DIM) -> None:
    """Give every method of a job config that scores with the analytic head (by its ``head``, or ``ranpac``'s
    default) a projection of ``dim`` columns, in place."""
    for method in data.get("methods", []):
        if not isinstance(method, dict):  # a multimodal job names its methods only
            continue
        head = method.get("head", "analytic" if method["name"] == "ranpac" else None)
        if head == "analytic":
            method["head"] = {"name": "analytic", "dim": dim}
        elif isinstance(head, dict) and head.get("name") == "analytic":
            head.setdefault("dim", dim)


def job_config(tmp_path: Path, name: str, edit: Callable[[dict], None], head_dim: int | None = TEST_HEAD_DIM) -> Path:
    """``configs/<name>.yaml`` changed by ``edit`` (in place) and with its output under ``tmp_path / "out"``, written
    to ``tmp_path / "cfg.yaml"``; returns that path. ``head_dim``: the analytic heads' projection width
    (:func:`small_analytic_heads`; ``None`` keeps the config's)."""
    data = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    edit(data)
    if head_dim is not None:
        small_analytic_heads(data, head_dim)
    data["output"]["dir"] = str(tmp_path / "out")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def save_tiny_bert(path: Path, num_layers: int, seed: int | None = 0) -> Path:
    """Save a tiny random BERT (width 32) with MiniLM's real tokenizer to ``path``: a local model directory, as a user
    would pass one; returns ``path``. ``seed``: torch's seed for the weights (``None``: the current RNG state)."""
    tok = AutoTokenizer.from_pretrained(minilm_path())
    if seed is not None:
        torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
    )
    BertModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def offline_env(threads: int | None = None) -> dict[str, str]:
    """This process's environment for a child run from the repository root: the checkout on ``PYTHONPATH``, the
    Hugging Face hub offline, and ``OMP_NUM_THREADS=threads`` unless ``threads`` is ``None``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_module(
    module: str, *args: object, timeout: float = 600, threads: int | None = None, ok: bool = True
) -> subprocess.CompletedProcess:
    """Run ``python -m module *args`` from the repository root with :func:`offline_env` (``threads``), its output
    captured as text, and return the finished process. It is killed after ``timeout`` seconds (the test errors with
    ``TimeoutExpired``); with ``ok`` the test fails unless it exits 0, showing the tails of its output."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=offline_env(threads), capture_output=True, text=True, timeout=timeout)
    if ok:
        assert proc.returncode == 0, (
            f"python -m {module}: exit status {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def launcher(name: str) -> str | None:
    """The path of the launcher ``name`` (``torchrun``, ``accelerate``): next to this Python first, else on PATH."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def accelerate_launcher() -> str:
    """The ``accelerate`` launcher; skips unless accelerate is installed (``accelerate launch`` is optional). The
    cheap form of each accelerate test runs with it by default; the full forms are :func:`opt_in_accelerate`'s."""
    accelerate = launcher("accelerate")
    if accelerate is None:
        pytest.skip("accelerate is not installed; `accelerate launch` is optional")
    pytest.importorskip("accelerate")
    return accelerate


def opt_in_accelerate(cost: str) -> str:
    """The ``accelerate`` launcher for an opt-in test; skips unless accelerate is installed and
    ``PEFT_EXT_ACCELERATE_TEST=1`` (``cost``: what the run costs, for the skip message)."""
    accelerate = accelerate_launcher()
    if os.environ.get("PEFT_EXT_ACCELERATE_TEST") != "1":
        pytest.skip(f"{cost}; set PEFT_EXT_ACCELERATE_TEST=1 (docs/distributed.md)")
    return accelerate


def run_launcher(cmd: list[str], timeout: float = 150, ok: bool = True) -> tuple[str, str]:
    """Run the multi-process launch ``cmd`` from the repository root, offline; return its stdout and stderr (every
    rank's). Fail the test if it outlives ``timeout`` seconds, or fails (``ok``) or succeeds (``not ok``)."""
    env = offline_env(threads=1)
    # a session of its own, so a timeout can end the launcher *and* its workers (killing the launcher alone orphans
    # them)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a worker that left the group still holds the pipes: fail, do not hang
            stderr = "(a worker outlived the launcher and kept its output open)"
        pytest.fail(f"the 2-process run did not finish in {timeout} s:\n{stderr[-4000:]}")
    assert (proc.returncode == 0) == ok, f"{' '.join(cmd)}: exit status {proc.returncode}:\n{stderr[-4000:]}"
    return stdout, stderr


def torchrun_ranks(worker: Path, out: Path, if_missing: Callable[[str], None]) -> list[dict]:
    """Run ``worker out`` under ``torchrun --standalone --nproc_per_node=2`` and load what each rank saved
    (``out / "rank<r>.pt"``). Without torchrun, ``if_missing(message)`` (``pytest.skip`` or ``pytest.fail``)."""
    torchrun = launcher("torchrun")
    if torchrun is None:
        if_missing("torchrun is not installed next to this Python (it ships with torch); it starts the 2 processes")
    run_launcher([torchrun, "--standalone", "--nproc_per_node=2", str(worker), str(out)])
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def pclr_lm_step(net: nn.Module, model: nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step of a PCLR causal LM on token ``ids``: next-token cross-entropy of ``net`` (the model or its
    DDP wrapper) plus the query-key loss of ``model``."""
    logits = net(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)) + query_loss(model)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def padded_batches(seed: int, count: int, shape: tuple[int, int], pad_from: int, vocab: int = 128) -> list[tuple]:
    """``count`` random ``(input_ids, attention_mask)`` batches of ``shape`` (batch, tokens), the second sample padded
    from position ``pad_from`` on: token batches with padding for the statistics tests."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, shape, generator=g)
        mask = torch.ones(shape, dtype=torch.long)
        mask[1, pad_from:] = 0
        out.append((ids, mask))
    return out
