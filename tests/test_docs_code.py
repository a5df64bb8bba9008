"""Every Python block of docs/ runs as written (the README's: tests/test_readme.py).

A page's blocks run in order in one namespace, as in a notebook. Before each block a small prelude defines the names
the page says are yours (``base``: a tiny BERT classifier, fresh for every block; ``tasks``: two tasks of token
batches; ``train``: a short AdamW loop; ``calibration_batches``, ``loader``, ``model``, ``args``, ``data``, a
``my_train.csv``): those names stand for the reader's model and data, the block itself is unchanged. Model hub ids
become the local copy of the same model. Two kinds of block do not run, each marked in the page by an HTML comment
right above it, which this test requires:

- ``<!-- not run: REASON -->``: needs what tests cannot have (a GPU, a model from the hub); compiled only;
- ``<!-- excerpt: PATH -->``: code that does run, in PATH (a file or folder), shown without type annotations and
  docstrings: every statement of the block (``...`` aside) must be one of PATH's.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"(?:<!-- (not run|excerpt): ([^>]*?) -->\s*\n)?( *)```python\n(.*?)\n *```", re.S)

# The reader's names. `base` has "query", "value" (attention) and "classifier" (head) modules, like MiniLM with a head.
PRELUDE = """
import torch
import torch.nn.functional as F
from peft_ext.models import SentenceClassifier, tiny_bert

torch.manual_seed(0)
base = SentenceClassifier(tiny_bert(vocab_size=64, hidden_size=32).bert, num_labels=4, dropout=0.0)


def _batches(task, n=3):
    gen = torch.Generator().manual_seed(task)
    out = []
    for _ in range(n):
        labels = 2 * task + torch.randint(0, 2, (8,), generator=gen)
        ids = 4 + 8 * labels[:, None] + torch.randint(0, 8, (8, 6), generator=gen)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


tasks = [_batches(0), _batches(1)]
calibration_batches = loader = tasks[0]


def train(model, batches, extra_loss=None):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for batch in batches:
        loss = model(**batch).loss
        if extra_loss is not None:
            loss = loss + extra_loss()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""

TRAINER = """
from transformers import Trainer, TrainingArguments

model = base
data = [{k: v[i] for k, v in batch.items()} for batch in tasks[0] for i in range(len(batch["labels"]))]
args = TrainingArguments("out/trainer", max_steps=2, per_device_train_batch_size=8, report_to="none", use_cpu=True,
                         disable_tqdm=True)
"""

CSV = """
import csv

with open("my_train.csv", "w", newline="") as f:
    rows = csv.writer(f)
    rows.writerow(["text", "label"])
    for i in range(60):
        rows.writerow([f"sentence {i} about topic {i % 6}", f"topic{i % 6}"])
"""

# what `make run` leaves in runs/quickstart/adapters, from a tiny model in seconds
TRAINED = """
from pathlib import Path

import yaml
from peft_ext_cli import main as _cli
from tests.helpers import save_tiny_bert

_data = yaml.safe_load(Path("configs/quickstart.yaml").read_text())
_data["model"]["backbone"] = str(save_tiny_bert(Path("tiny-bert"), num_layers=1))
_data["data"].update(n_tasks=2, classes_per_task=2, train_per_class=4, test_per_class=2)
_data["train"].update(epochs=1, progress=False)
_data["methods"] = [{"name": "splitlora", "head": "analytic", "lr": 0.005}]
_data["output"]["dir"] = "runs/quickstart"
Path("q.yaml").write_text(yaml.safe_dump(_data))
assert _cli(["run", "q.yaml", "--no-progress"]) == 0
"""

# the single-process "cluster" a sharding example runs on
MESH = """
import torch.distributed as dist
from peft import get_peft_model
from peft_ext import SplitLoRAConfig
from peft_ext.models import tiny_llama
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
base = tiny_llama()
config = SplitLoRAConfig(r=4, target_modules=["q_proj", "v_proj"])
"""

# a vision model for the page's custom-query example
CLIP = """
from peft import get_peft_model
from peft_ext import PCLRConfig
from peft_ext.models import tiny_clip

model = get_peft_model(tiny_clip(), PCLRConfig(target_modules=["q_proj", "v_proj"], pool_size=8, top_k=2,
                                                ranks_schedule=[2], query_dim=32))
"""

EXTRA = {  # (page, block index): a prelude of its own, after the common one
    ("dct_adamw.md", 0): TRAINER,
    ("dct_adamw.md", 1): TRAINER,
    ("dct_adamw.md", 2): TRAINER,
    ("pclr.md", 0): CLIP,
    ("pclr.md", 1): TRAINER
    + """
from peft_ext import PCLRConfig
model = get_peft_model(base, PCLRConfig(target_modules=["query", "value"], pool_size=8, top_k=2, ranks_schedule=[2]))
""",
    ("own_data.md", 0): CSV,
    ("own_data.md", 1): TRAINED,
    ("distributed.md", 0): MESH,
}
CLEANUP = {("distributed.md", 0): "dist.destroy_process_group()"}


def _blocks(page: Path) -> list[tuple[str | None, str, str]]:
    """``(mark, reason or path, code)`` of every Python block of ``page``, dedented."""
    return [(m[1] or None, m[2] or "", textwrap.dedent(m[4])) for m in BLOCK.finditer(page.read_text())]


def _runnable(code: str) -> str:
    from peft_ext.models import minilm_path

    return code.replace("sentence-transformers/all-MiniLM-L6-v2", str(minilm_path()))


def test_every_block_is_found_and_marks_say_why():
    total = 0
    for page in DOCS:
        text = page.read_text()
        blocks = _blocks(page)
        assert len(blocks) == text.count("```python"), page.name  # the pattern saw every block
        for mark, why, _ in blocks:
            assert mark is None or why.strip(), f"{page.name}: a `{mark}` mark without its reason"
        total += len(blocks)
    assert total >= 20


def _statements(code: str) -> set[str]:
    """Every statement of ``code`` (nested ones too) as a line without type annotations or docstrings: a ``def``
    or ``class`` as its header, anything else unparsed; ``...`` (an elided body) and docstrings left out."""
    out = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None:
                    arg.annotation = None
            out.add(f"def {node.name}({ast.unparse(args)})")
        elif isinstance(node, ast.ClassDef):
            out.add(f"class {node.name}({', '.join(ast.unparse(b) for b in node.bases)})")
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            out.add(ast.unparse(ast.Assign([node.target], node.value, lineno=0)))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # `...` or a docstring
        elif isinstance(node, ast.stmt) and not hasattr(node, "body"):
            out.add(ast.unparse(node))
    return out


@pytest.mark.parametrize("page", [p for p in DOCS if "<!-- excerpt:" in p.read_text()], ids=lambda p: p.name)
def test_excerpts_are_statements_of_the_code_they_quote(page):
    for mark, where, code in _blocks(page):
        if mark != "excerpt":
            continue
        source = ROOT / where.strip()
        files = sorted(source.rglob("*.py")) if source.is_dir() else [source]
        known = set().union(*(_statements(f.read_text()) for f in files))
        missing = sorted(_statements(code) - known)
        assert not missing, f"{page.name}: not statements of {where} (annotations aside): {missing}"


def test_not_run_blocks_compile():
    for page in DOCS:
        for mark, _, code in _blocks(page):
            if mark == "not run":
                compile(code, str(page), "exec")


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", [p for p in DOCS if any(m is None for m, _, _ in _blocks(p))], ids=lambda p: p.name.removesuffix(".md")
)
def test_the_blocks_of_a_page_run(page, tmp_path, monkeypatch):
    from peft_ext.continual import CONTINUAL_METHODS
    from peft_ext.continual.heads import HEADS

    monkeypatch.chdir(tmp_path)
    os.symlink(ROOT / "configs", tmp_path / "configs")  # pages name the shipped configs' files by relative path
    registered, heads = set(CONTINUAL_METHODS), set(HEADS)
    scope: dict = {}
    ran = 0
    try:
        for i, (mark, _, code) in enumerate(_blocks(page)):
            if mark is not None:
                continue
            exec(compile(PRELUDE + EXTRA.get((page.name, i), ""), f"prelude of {page.name}:{i}", "exec"), scope)
            try:
                exec(compile(_runnable(code), f"{page}:block{i}", "exec"), scope)
            finally:
                if (page.name, i) in CLEANUP:
                    exec(CLEANUP[page.name, i], scope)
            ran += 1
    finally:  # a page that registers a method or a head (adding_a_*.md) leaves the registries as it found them
        for name in set(CONTINUAL_METHODS) - registered:
            del CONTINUAL_METHODS[name]
        for name in set(HEADS) - heads:
            del HEADS[name]
    assert ran


def test_the_config_reference_is_generated_from_the_code():
    """docs/config_reference.md lists every key of every section with its default, from the sections' own code."""
    import dataclasses

    from peft_ext.jobs.reference import SECTIONS, config_reference

    page = (Path(__file__).resolve().parents[1] / "docs" / "config_reference.md").read_text()
    assert page == config_reference(), "run `python -m peft_ext.jobs.reference > docs/config_reference.md`"
    for name, cls in SECTIONS:
        for field in dataclasses.fields(cls):
            row = next(line for line in page.splitlines() if line.startswith(f"| `{name}.{field.name}` |"))
            assert row.split("|")[3].strip(), f"{name}.{field.name} has no description in {cls.__name__}'s docstring"
    assert "| `train.epochs` | `1` | Passes over each task's training data" in page
