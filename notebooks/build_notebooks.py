"""Write and execute the notebooks in this folder, saved with their outputs so they read well without running.

Every notebook starts with ``SMALL = True`` (the sizes ``tests/test_notebooks.py`` runs) and writes its files
(checkpoints, figures) to a temporary directory. The kernel runs in a temporary working directory too, so nothing is
left in ``notebooks/``.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python notebooks/build_notebooks.py                      # all four
    OMP_NUM_THREADS=1 .venv/bin/python notebooks/build_notebooks.py --only 03_optimizers  # one
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nbformat as nbf
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell

# every notebook's first code cell: the flag, one thread, quiet imports, a scratch directory for files
PREAMBLE = (
    "SMALL = True  # test-suite sizes; False for the larger runs quoted in docs/\n"
    "import os, tempfile, warnings\n"
    "TINY = os.environ.get('PEFT_EXT_NOTEBOOK_TINY') == '1'  # smaller still: the suite's smoke run of every cell\n"
    "os.environ.setdefault('HF_HUB_OFFLINE', '1')\n"
    "warnings.filterwarnings('ignore', message='IProgress not found')  # tqdm without ipywidgets\n"
    "warnings.filterwarnings('ignore', category=FutureWarning)\n"
    "import transformers\n"
    "transformers.utils.logging.disable_progress_bar()  # no 'Loading weights' bars or load reports in the outputs\n"
    "transformers.utils.logging.set_verbosity_error()\n"
    "import torch\n"
    "torch.set_num_threads(1)  # the figures below were measured on one thread\n"
    "%matplotlib inline\n"
    "import matplotlib.pyplot as plt\n"
    "SCRATCH = tempfile.mkdtemp(prefix='peft_ext_nb_')  # checkpoints and figures go here, not into notebooks/\n"
)


def quickstart() -> list:
    return [
        md(
            "# peft-ext quickstart: four adapter types through PEFT\n\n"
            "`import peft_ext` registers Riemannion, SplitLoRA, PCLR and MoRA with PEFT, so each one goes through "
            "the same calls as LoRA: `get_peft_model`, a training step, `save_pretrained`, "
            "`PeftModel.from_pretrained` and `merge_and_unload`. Every model here is a tiny random transformer from "
            "`peft_ext.models`, so the notebook runs in seconds; the other notebooks use the real MiniLM-L6."
        ),
        code(
            PREAMBLE + "import peft_ext  # registers the adapter types\n"
            "from peft import PeftModel, get_peft_model\n"
            "from peft_ext import MoRAConfig, PCLRConfig, RiemannionConfig, SplitLoRAConfig\n"
            "from peft_ext.models import tiny_bert, tiny_clip, tiny_llama\n"
            "from peft_ext.optim import create_riemannion_optimizer\n"
            "gen = torch.Generator().manual_seed(0)\n"
            "text_batch = {'input_ids': torch.randint(3, 128, (4, 7), generator=gen)}\n"
            "clip_batch = {**text_batch, 'pixel_values': torch.randn(4, 3, 16, 16, generator=gen)}"
        ),
        md(
            "## One function for the whole life cycle\n\n"
            "`life_cycle` wraps a fresh base model, takes one optimizer step on a toy loss (the mean square of the "
            "output), saves the adapter, loads it onto another fresh base model and checks that the loaded model "
            "gives the same output; then it merges the adapter into the base weights and checks again. MoRA's "
            "output is the pair of pooled tower outputs (CLIP's `logits_per_image` would mix rows)."
        ),
        code(
            "def output(model, batch):\n"
            "    out = model(**batch)\n"
            "    if hasattr(out, 'text_model_output'):  # CLIP: both towers' pooled outputs\n"
            "        text, image = out.text_model_output, out.vision_model_output\n"
            "        return torch.cat([text.pooler_output, image.pooler_output], 1)\n"
            "    return out.logits\n"
            "\n"
            "def life_cycle(name, make_base, config, batch, make_optimizer=None, merge=True):\n"
            "    model = get_peft_model(make_base(), config)\n"
            "    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)\n"
            "    params = [p for p in model.parameters() if p.requires_grad]\n"
            "    optimizer = make_optimizer(model) if make_optimizer else torch.optim.AdamW(params, lr=1e-2)\n"
            "    before = output(model, batch).detach()\n"
            "    output(model, batch).pow(2).mean().backward()\n"
            "    optimizer.step()\n"
            "    model.eval()\n"
            "    with torch.no_grad():\n"
            "        trained = output(model, batch)\n"
            "    path = os.path.join(SCRATCH, name)\n"
            "    model.save_pretrained(path)\n"
            "    loaded = PeftModel.from_pretrained(make_base(), path).eval()\n"
            "    with torch.no_grad():\n"
            "        reloaded = output(loaded, batch)\n"
            "    row = dict(adapter=name, trainable=trainable, step_changed=(trained - before).abs().max().item(),\n"
            "               load_diff=(reloaded - trained).abs().max().item(), merge_diff=None)\n"
            "    if merge:\n"
            "        merged = loaded.merge_and_unload()\n"
            "        with torch.no_grad():\n"
            "            row['merge_diff'] = (output(merged, batch) - trained).abs().max().item()\n"
            "    assert row['load_diff'] < 1e-5 and (row['merge_diff'] is None or row['merge_diff'] < 1e-4), row\n"
            "    print(f\"{name:<10} {trainable:>6,} trainable | step moved it {row['step_changed']:.1e} \"\n"
            "          f\"| |loaded - trained| {row['load_diff']:.1e} \"\n"
            "          f\"| |merged - trained| {row['merge_diff']:.1e}\")\n"
            "    return row\n"
            "\n"
            "rows = []"
        ),
        md(
            "## Riemannion\n\n"
            "LoRA as a point on the manifold of rank-r matrices, trained by its own optimizer "
            "(`create_riemannion_optimizer`: Muon-style steps on the manifold, AdamW for anything else trainable)."
        ),
        code(
            "rows.append(life_cycle(\n"
            "    'riemannion', lambda: tiny_llama(hidden_size=64),\n"
            "    RiemannionConfig(r=4, target_modules=['q_proj', 'v_proj']), text_batch,\n"
            "    make_optimizer=lambda m: create_riemannion_optimizer(m, lr=3e-2)))"
        ),
        md(
            "## SplitLoRA\n\n"
            "Per task a frozen `A` in the subspace the earlier tasks used least, and a trainable `B`. In continual "
            "learning, `begin_task` / `collect_statistics` / `end_task` frame each task (notebook 02 runs them "
            "through the harness); for one task the adapter is used like LoRA."
        ),
        code(
            "rows.append(life_cycle(\n"
            "    'splitlora', lambda: tiny_bert(hidden_size=64),\n"
            "    SplitLoRAConfig(r=4, target_modules=['query', 'value']), text_batch))"
        ),
        md(
            "## PCLR\n\n"
            "A capped pool of rank-1 components with keys; each input uses the top-K components whose keys match "
            "its query. Merging into one weight is exact only while routing is *static*, i.e. every input uses "
            "every active rank (`top_k` >= the ranks). With input-dependent routing `merge` refuses with an error "
            "that says why:"
        ),
        code(
            "routing = PCLRConfig(target_modules=['q_proj', 'v_proj'], pool_size=16, ranks_schedule=[8], top_k=3)\n"
            "routed = get_peft_model(tiny_llama(hidden_size=64), routing)\n"
            "try:\n"
            "    routed.merge_adapter()\n"
            "except ValueError as err:\n"
            "    print('ValueError:', err)"
        ),
        md("With `top_k` covering the task's 4 ranks the routing is static, and the full life cycle works:"),
        code(
            "rows.append(life_cycle(\n"
            "    'pclr', lambda: tiny_llama(hidden_size=64),\n"
            "    PCLRConfig(target_modules=['q_proj', 'v_proj'], pool_size=8, ranks_schedule=[4], top_k=4,\n"
            "               shared_r=2),\n"
            "    text_batch))"
        ),
        md(
            "## MoRA\n\n"
            "Modality-common and modality-specific low-rank adapters on the attention of the top layers of *both* "
            "towers of a dual encoder (here a tiny CLIP whose towers have different widths). Notebook 04 trains it "
            "with missing modalities."
        ),
        code("rows.append(life_cycle('mora', tiny_clip, MoRAConfig(r=4, top_layers=2), clip_batch))"),
        md("## Trainable parameters per adapter type"),
        code(
            "fig, ax = plt.subplots(figsize=(6, 3))\n"
            "ax.bar([r['adapter'] for r in rows], [r['trainable'] for r in rows], color='tab:blue')\n"
            "for i, r in enumerate(rows):\n"
            "    ax.annotate(f\"{r['trainable']:,}\", (i, r['trainable']), ha='center', va='bottom')\n"
            "ax.set_ylabel('trainable parameters')\n"
            "ax.set_title('one adapter on a tiny model (see the configs above)')\n"
            "ax.margins(y=0.15); plt.tight_layout(); plt.show()"
        ),
    ]


def continual_learning() -> list:
    return [
        md(
            "# Continual learning on WordNet: sequential LoRA, SplitLoRA and PCLR\n\n"
            "The real pretrained MiniLM-L6 (offline) learns WordNet 3.0 supersenses from their glosses, a few "
            "classes per task, task after task (class-incremental: no task id at test time). After each task the "
            "runner evaluates every task, filling the accuracy matrix R[i][j] = accuracy on task j after training "
            "task i. We compare\n\n"
            "- **sequential LoRA** (PEFT's LoRA, simply trained on each task in turn): how forgetting looks without "
            "care;\n"
            "- **SplitLoRA**: each task's low-rank update lives in the input subspace the earlier tasks used least;\n"
            "- **PCLR**: a capped pool of rank-1 components with keyed routing, compressed and distilled after each "
            "task.\n\n"
            "`SMALL = True` runs 3 tasks x 3 classes and 2 epochs (under two minutes on one CPU thread); "
            "`False` gives the `make run` sizes (5 tasks x 4 classes, 3 epochs)."
        ),
        code(
            PREAMBLE + "import peft_ext\n"
            "from peft_ext.continual import TrainConfig, get_continual_method, run_sequence\n"
            "from peft_ext.continual.report import matrix_table, metrics_table, plot_accuracy_matrices\n"
            "from peft_ext.data import wordnet_task_sequence\n"
            "from peft_ext.data.collate import TextCollator\n"
            "from peft_ext.models import load_text_classifier"
        ),
        md(
            "## The task sequence\n"
            "Supersenses are picked and ordered by the seed; test glosses never overlap training glosses."
        ),
        code(
            "if TINY:\n"
            "    sizes = dict(n_tasks=2, classes_per_task=2, train_per_class=8, test_per_class=4)\n"
            "    train = TrainConfig(epochs=1, batch_size=16, progress=False)\n"
            "elif SMALL:\n"
            "    sizes = dict(n_tasks=3, classes_per_task=3, train_per_class=32, test_per_class=16)\n"
            "    train = TrainConfig(epochs=2, batch_size=16, progress=False)\n"
            "else:\n"
            "    sizes = dict(n_tasks=5, classes_per_task=4, train_per_class=80, test_per_class=40)\n"
            "    train = TrainConfig(epochs=3, batch_size=32, progress=False)\n"
            "seq = wordnet_task_sequence(seed=0, **sizes)\n"
            "for t in seq.tasks:\n"
            "    print(f'{t.name}: {len(t.train)} train, {len(t.test)} test')\n"
            "ex = seq.tasks[0].train[0]\n"
            "print('example:', repr(ex.inputs), '->', seq.class_names[ex.label])"
        ),
        md(
            "## Train every method through the sequence\n"
            "Every method starts from the same pretrained weights and the same head initialization, and sees the "
            "same batches. All three adapt `query` and `value`; LoRA and SplitLoRA at rank 8 / 10, PCLR with a pool "
            "of 32 ranks per linear (16 new ranks per task, half the pool compressed away after each task from the "
            "second on, then distilled back)."
        ),
        code(
            "model, tok = load_text_classifier('minilm', num_labels=seq.num_classes)\n"
            "collate = TextCollator(tok, max_length=32)\n"
            "qv = ['query', 'value']\n"
            "methods = [\n"
            "    get_continual_method('seq_lora')(lr=2e-3, adapter=dict(r=8, lora_alpha=16.0, target_modules=qv)),\n"
            "    get_continual_method('splitlora')(lr=5e-3, adapter=dict(r=10, target_modules=qv)),\n"
            "    get_continual_method('pclr')(lr=2e-3, adapter=dict(pool_size=32, ranks_schedule=[16], top_k=16, alpha=16.0,\n"
            "                                 shared_r=4, shared_alpha=8.0, target_modules=qv,\n"
            "                                 compress_schedule=[0.0, 0.5], compress_rule='index')),\n"
            "]\n"
            "results = [run_sequence(seq, m, model, collate, train) for m in methods]\n"
            "print(metrics_table(results))"
        ),
        md(
            "`final acc` is the mean of the last row of R, `avg incr acc` the mean over rows of each row's mean, "
            "BWT the mean change of each old task between right after its training and the end, `forgetting` the "
            "mean drop from each old task's best accuracy."
        ),
        md(
            "## The accuracy matrices\n"
            "Sequential LoRA learns each new task but overwrites the old ones: the cells below the diagonal fade. "
            "SplitLoRA and PCLR keep more of them. At these small sizes (48 test glosses per task) one gloss is "
            "two points of a task's accuracy, so read the pattern rather than the last digit."
        ),
        code(
            "for r in results:\n"
            "    print(r.label)\n"
            "    print(matrix_table(r))\n"
            "from IPython.display import Image\n"
            "png = plot_accuracy_matrices(results, os.path.join(SCRATCH, 'accuracy_matrix.png'),\n"
            "                             title='WordNet supersenses, class-incremental')\n"
            "Image(filename=str(png))"
        ),
    ]


def optimizers() -> list:
    return [
        md(
            "# Optimizers: Riemannion and DCT-AdamW against their peers\n\n"
            "Two optimizers that ship with peft-ext, each beside what it replaces, on one WordNet supersense task "
            "with the real pretrained MiniLM-L6:\n\n"
            "- **Riemannion** (+ LOI initialization) trains a LoRA adapter as a point on the manifold of rank-r "
            "matrices; its peer is **LoRA + AdamW** at the same rank on the same modules.\n"
            "- **DCT-AdamW** is full fine-tuning with Adam's moments kept in a rank-r subspace picked from the "
            "DCT basis (no SVD); its peers are **AdamW** (full moments) and **GaLore-AdamW** (SVD subspace).\n\n"
            "Every run sees the same batches in the same order. We plot the training loss, then tabulate test "
            "accuracy, time per step and the optimizer's state size. `SMALL = True`: 8 classes, 2 epochs of 12 steps."
        ),
        code(
            PREAMBLE + "import copy, time\n"
            "import peft_ext\n"
            "from peft import LoraConfig, get_peft_model\n"
            "from peft_ext import DCTAdamW, RiemannionConfig\n"
            "from peft_ext.continual import get_continual_method\n"
            "from peft_ext.data import wordnet_task_sequence\n"
            "from peft_ext.data.collate import TextCollator\n"
            "from peft_ext.models import load_text_classifier\n"
            "from peft_ext.optim import create_riemannion_optimizer\n"
            "from peft_ext.tuners.riemannion import initialize_loi"
        ),
        md("## One task, fixed batches"),
        code(
            "sizes = dict(classes_per_task=8, train_per_class=24, test_per_class=16) if SMALL else \\\n"
            "    dict(classes_per_task=20, train_per_class=80, test_per_class=40)\n"
            "EPOCHS, BATCH, RANK = (2, 16, 8) if SMALL else (3, 32, 16)\n"
            "if TINY:\n"
            "    sizes, EPOCHS = dict(classes_per_task=4, train_per_class=8, test_per_class=4), 1\n"
            "task = wordnet_task_sequence(n_tasks=1, seed=0, **sizes).tasks[0]\n"
            "base, tok = load_text_classifier('minilm', num_labels=sizes['classes_per_task'])\n"
            "collate = TextCollator(tok, max_length=32)\n"
            "order = torch.randperm(len(task.train), generator=torch.Generator().manual_seed(0)).tolist()\n"
            "train = [task.train[i] for i in order]\n"
            "batches = [collate(train[i:i + BATCH]) for i in range(0, len(train), BATCH)]\n"
            "test = [collate(task.test[i:i + 128]) for i in range(0, len(task.test), 128)]\n"
            "print(f'{len(task.train)} train / {len(task.test)} test glosses, {len(batches)} steps per epoch')"
        ),
        md(
            "## The training loop and the runs\n"
            "`fit` runs the same loop for every optimizer and records the loss of every step, the time of every "
            "step (the first, which builds lazy state, is left out) and the bytes the optimizer's state holds. "
            "Learning rates: Riemannion and LoRA + AdamW as tuned in `benchmarks/riemannion.py`; the full "
            "fine-tuning optimizers share one lr, and GaLore and DCT-AdamW use GaLore's fine-tuning `scale` of 4."
        ),
        code(
            "def state_bytes(optimizer):\n"
            "    # tensors in the state, plus GaLore's projector matrices (kept in a projector object)\n"
            "    values = [v for state in optimizer.state.values() for v in state.values()]\n"
            "    values += [v.ortho_matrix for v in values if getattr(v, 'ortho_matrix', None) is not None]\n"
            "    return sum(v.numel() * v.element_size() for v in values if torch.is_tensor(v))\n"
            "\n"
            "def fit(label, model, make_optimizer):\n"
            "    torch.manual_seed(0)\n"
            "    start = time.perf_counter()\n"
            "    optimizer = make_optimizer(model)  # includes LOI for Riemannion\n"
            "    setup = time.perf_counter() - start\n"
            "    losses, step_s = [], []\n"
            "    model.train()\n"
            "    for epoch in range(EPOCHS):\n"
            "        for batch in batches:\n"
            "            start = time.perf_counter()\n"
            "            loss = model(**batch).loss\n"
            "            optimizer.zero_grad()\n"
            "            loss.backward()\n"
            "            optimizer.step()\n"
            "            step_s.append(time.perf_counter() - start)\n"
            "            losses.append(loss.item())\n"
            "    model.eval()\n"
            "    with torch.no_grad():\n"
            "        correct = sum((model(**b).logits.argmax(-1) == b['labels']).sum().item() for b in test)\n"
            "    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)\n"
            "    return dict(label=label, losses=losses, acc=100 * correct / len(task.test), trainable=trainable,\n"
            "                step_ms=1000 * sorted(step_s[1:])[len(step_s[1:]) // 2], setup_s=setup,\n"
            "                state_mib=state_bytes(optimizer) / 2**20)\n"
            "\n"
            "def adapter(config):\n"
            "    return get_peft_model(copy.deepcopy(base), config)\n"
            "\n"
            "def full():  # full fine-tuning of the transformer layers and the head; the embeddings stay frozen\n"
            "    model = copy.deepcopy(base)\n"
            "    model.encoder.embeddings.requires_grad_(False)\n"
            "    return model\n"
            "\n"
            "def riemannion(model):\n"
            "    initialize_loi(model, batches[:2])  # LOI: gradient-informed start, the output is unchanged\n"
            "    return create_riemannion_optimizer(model, lr=3e-2, aux_lr=3e-3)\n"
            "\n"
            "def trainable(model):\n"
            "    return [p for p in model.parameters() if p.requires_grad]\n"
            "\n"
            "FULL_LR, TARGETS = 1e-4, ['query', 'key', 'value', 'dense']\n"
            "def galore(model):  # the harness's GaLore-AdamW construction (galore-torch), refresh every 500 steps\n"
            "    opts = dict(optimizer='galore_adamw', lr=FULL_LR, rank=RANK, scale=4.0, update_proj_gap=500,\n"
            "                target_modules=TARGETS)\n"
            "    return get_continual_method('full_ft')(**opts).make_optimizer(model, trainable(model), None)\n"
            "\n"
            "def dct_adamw(model):\n"
            "    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]\n"
            "    return DCTAdamW(named, lr=FULL_LR, rank=RANK, scale=4.0, target_modules=TARGETS)\n"
            "\n"
            "on = dict(target_modules=['query', 'value'], modules_to_save=['classifier'])\n"
            "runs = [\n"
            "    fit('Riemannion + LOI', adapter(RiemannionConfig(r=RANK, **on)), riemannion),\n"
            "    fit('LoRA + AdamW', adapter(LoraConfig(r=RANK, lora_alpha=RANK, **on)),\n"
            "        lambda m: torch.optim.AdamW(trainable(m), lr=1e-2)),\n"
            "    fit('DCT-AdamW (full FT)', full(), dct_adamw),\n"
            "    fit('GaLore-AdamW (full FT)', full(), galore),\n"
            "    fit('AdamW (full FT)', full(), lambda m: torch.optim.AdamW(trainable(m), lr=FULL_LR)),\n"
            "]"
        ),
        md("## Loss curves"),
        code(
            "fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)\n"
            "for ax, group in zip(axes, (runs[:2], runs[2:])):\n"
            "    for r in group:\n"
            "        ax.plot(r['losses'], label=r['label'], alpha=0.85)\n"
            "    ax.set_xlabel('step'); ax.legend(); ax.grid(alpha=0.3)\n"
            "axes[0].set_ylabel('training loss (batch)')\n"
            "axes[0].set_title(f'adapters, rank {RANK} on query/value')\n"
            "axes[1].set_title(f'full fine-tuning, projection rank {RANK}')\n"
            "plt.tight_layout(); plt.show()"
        ),
        md(
            "## Accuracy, time and memory\n"
            "`step ms` is the median step (forward, backward, optimizer) on one CPU thread; `setup s` is the time "
            "to build the optimizer, LOI included; `state MiB` counts the tensors in the optimizer's state (moments, "
            "Riemannion's momentum, GaLore's projectors, DCT-AdamW's column indices). Full fine-tuning trains the "
            "11 M parameters of the transformer layers and the head (the embeddings stay frozen in all three runs, "
            "so the state column compares the optimizers on the matrices they project). Riemannion's trainable "
            "count includes `riemannion_Z`, a zero probe through which the optimizer reads the gradient; the "
            "adapter itself (A, B) has LoRA's size."
        ),
        code(
            "print('| optimizer | test acc % | trainable params | step ms | setup s | state MiB |')\n"
            "print('|---|---:|---:|---:|---:|---:|')\n"
            "for r in runs:\n"
            "    print(f\"| {r['label']} | {r['acc']:.1f} | {r['trainable']:,} | {r['step_ms']:.0f} \"\n"
            "          f\"| {r['setup_s']:.2f} | {r['state_mib']:.2f} |\")"
        ),
        md(
            "At this size (a few dozen steps, one seed) the accuracies are noisy; `benchmarks/riemannion.py` and "
            "`benchmarks/dct_vs_galore.py` run the larger, multi-seed comparisons quoted in `docs/riemannion.md` "
            "and `docs/dct_adamw.md` (where DCT-AdamW trails GaLore in accuracy at equal rank but needs no SVD and "
            "less optimizer state)."
        ),
    ]


def missing_modalities() -> list:
    return [
        md(
            "# MoRA with missing modalities: emoji images and their names\n\n"
            "MoRA adapts both towers of a dual encoder with low-rank adapters shared across the modalities plus "
            "modality-specific ones. Here it fine-tunes a small image-text dual encoder to classify emoji into "
            "their 9 Unicode groups (Smileys & Emotion, Animals & Nature, Flags, ...) from the image *and* the "
            "name, when a share of the examples has lost one of the two: a missing name becomes the empty string, "
            "a missing image a white square. We compare MoRA with LoRA on exactly the same modules at the same "
            "rank, with no missing modality and with 70 % of the examples missing one (half text, half image), "
            "the protocol of `benchmarks/mora_missing_modality.py`.\n\n"
            "The backbone is the benchmark's, smaller: the real pretrained MiniLM-L6 text tower and a ViT that is "
            "first pretrained contrastively on the complete training pairs (LiT-style, text tower locked). "
            "`SMALL = True` uses a 2-layer, 64-wide ViT, 8 pretraining and 3 fine-tuning epochs (under two minutes on "
            "one thread); `False` uses the benchmark's sizes."
        ),
        code(
            PREAMBLE + "import dataclasses\n"
            "import numpy as np\n"
            "import peft_ext\n"
            "from peft_ext.multimodal import MissingSpec, apply_missing, load_emoji_pairs, missing_masks\n"
            "from peft_ext.multimodal.experiment import ExperimentSettings, markdown_table, prepare, run_method"
        ),
        md("## The data and what missing looks like"),
        code(
            "train_pairs, test_pairs = load_emoji_pairs('train'), load_emoji_pairs('test')\n"
            "groups = train_pairs.group_names\n"
            "print(f'{len(train_pairs)} train / {len(test_pairs)} test pairs, {len(groups)} groups: {groups}')\n"
            "spec = MissingSpec(rate=0.7, kind='both')\n"
            "show = test_pairs.subset(np.arange(0, 320, 20))\n"
            "names, images = apply_missing(show.names, show.images, missing_masks(len(show), spec, seed=1))\n"
            "fig, axes = plt.subplots(2, 8, figsize=(12, 4.2))\n"
            "for ax, name, image, group in zip(axes.flat, names, images, show.group):\n"
            "    ax.imshow(image); ax.set_xticks([]); ax.set_yticks([])\n"
            "    ax.set_title(f\"{name[:22] or '(no text)'}\\n[{show.group_names[group]}]\", fontsize=7)\n"
            "fig.suptitle('test pairs under a 70 % missing rate (blank square: image missing)', fontsize=10)\n"
            "plt.tight_layout(); plt.show()"
        ),
        md(
            "## Backbone\n"
            "`prepare` builds the dual encoder, pretrains the ViT against the frozen text tower, and caches the "
            "outputs of the frozen lower layers, which every method and setting reuses (only the top 2 layers of "
            "each tower are adapted)."
        ),
        code(
            "if SMALL:\n"
            "    settings = ExperimentSettings(vision_width=64, vision_layers=2, vision_heads=2, pretrain_epochs=8,\n"
            "                                  epochs=3, cache_dir=None)\n"
            "    if TINY:\n"
            "        settings = dataclasses.replace(settings, vision_width=32, pretrain_epochs=1, epochs=1)\n"
            "else:\n"
            "    settings = ExperimentSettings(cache_dir=os.path.join(SCRATCH, 'cache'))\n"
            "prep = prepare(settings)\n"
            "log = prep.pretrain_log\n"
            "print(f\"contrastive pretraining loss {log['first_loss']:.2f} -> {log['last_loss']:.2f}\")"
        ),
        md(
            "## MoRA against LoRA\n"
            "Both adapt q, k, v and the attention output of the top 2 layers of each tower at rank 4 and train the "
            "same linear head on the joined embeddings; the same missing spec applies to training and test (each "
            "split its own draw). LoRA / MoRA are merged into the backbone before testing."
        ),
        code(
            "rows = []\n"
            "for rate in (0.0, 0.7):\n"
            "    for method in ('lora', 'mora'):\n"
            "        result = run_method(prep, method, MissingSpec(rate, 'both'))\n"
            "        rows.append({'rate': rate, 'kind': 'both', 'method': method, 'seed': 0, **result})\n"
            "        print(f\"missing {rate:.0%} {method:<5} acc {100 * result['acc']:.1f} %\")\n"
            "print()\n"
            "print(markdown_table(rows))"
        ),
        code(
            "fig, ax = plt.subplots(figsize=(6, 3.4))\n"
            "width = 0.38\n"
            "styles = (('lora', 'LoRA', 'tab:gray'), ('mora', 'MoRA', 'tab:orange'))\n"
            "for k, (method, label, color) in enumerate(styles):\n"
            "    accs = [100 * r['acc'] for r in rows if r['method'] == method]\n"
            "    bars = ax.bar(np.arange(2) + (k - 0.5) * width, accs, width, label=label, color=color)\n"
            "    ax.bar_label(bars, fmt='%.1f', fontsize=8)\n"
            "ax.set_xticks(range(2), ['complete pairs', '70 % missing (text or image)'])\n"
            "ax.set_ylabel('test accuracy %'); ax.set_ylim(0, 100); ax.legend(loc='lower left')\n"
            "ax.set_title('emoji group from image + name (9 classes), rank 4, top 2 layers per tower', fontsize=9)\n"
            "plt.tight_layout(); plt.show()"
        ),
        md(
            "One seed at a small size: differences of a point or two are within the noise. "
            "`benchmarks/mora_missing_modality.py` runs the full grid (rates 0 / 0.3 / 0.7, each missing type, "
            "several seeds, plus a frozen-backbone probe and missing-aware prompts); see `docs/mora.md`."
        ),
    ]


NOTEBOOKS: dict[str, Callable[[], list]] = {
    "01_quickstart": quickstart,
    "02_continual_learning": continual_learning,
    "03_optimizers": optimizers,
    "04_missing_modalities": missing_modalities,
}


def build(name: str) -> float:
    """Write ``name.ipynb`` with its outputs; returns the execution time in seconds."""
    nb = nbf.v4.new_notebook()
    cleanup = code("import shutil\nshutil.rmtree(SCRATCH, ignore_errors=True)  # remove this notebook's files")
    nb.cells = [*NOTEBOOKS[name](), cleanup]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="peft_ext_nb_") as cwd:
        NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": cwd}}).execute()
    seconds = time.perf_counter() - start
    nbf.write(nb, HERE / f"{name}.ipynb")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(NOTEBOOKS), nargs="+", help="build only these notebooks")
    args = parser.parse_args()
    for name in args.only or NOTEBOOKS:
        print(f"{name}.ipynb: executed in {build(name):.0f} s", flush=True)


if __name__ == "__main__":
    main()
