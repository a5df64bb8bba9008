"""Write and execute the notebooks in this folder (outputs saved, so they read well without running).

Run: .venv/bin/python notebooks/build_notebooks.py
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell
nb.cells = [
    md("# Continual learning with peft-ext: the WordNet quickstart\n\n"
       "Real pretrained MiniLM-L6 (offline) learns WordNet supersenses task after task. We compare PEFT's LoRA "
       "fine-tuned sequentially with a frozen backbone + linear head, and look at the accuracy matrix "
       "R[i][j] (accuracy on task j after training task i).\n\n"
       "`SMALL = True` keeps the run to about a minute on a laptop CPU; set it to `False` for the `make run` sizes."),
    code("SMALL = True\n"
         "import warnings; warnings.filterwarnings('ignore', message='IProgress not found')  # tqdm without ipywidgets\n"
         "import peft_ext\n"
         "from peft_ext.continual import TrainConfig, get_continual_method, run_sequence\n"
         "from peft_ext.continual.report import matrix_table, metrics_table, plot_accuracy_matrices\n"
         "from peft_ext.data import wordnet_task_sequence\n"
         "from peft_ext.data.collate import TextCollator\n"
         "from peft_ext.models import load_text_classifier"),
    md("## The task sequence\nFive (or, small, three) tasks of four supersenses each, chosen by a seed; "
       "test glosses never overlap training glosses."),
    code("sizes = dict(n_tasks=3, train_per_class=48, test_per_class=24) if SMALL else dict(n_tasks=5, train_per_class=80, test_per_class=40)\n"
         "seq = wordnet_task_sequence(classes_per_task=4, seed=0, **sizes)\n"
         "for t in seq.tasks:\n"
         "    print(t.name, len(t.train), 'train', len(t.test), 'test')\n"
         "print('example:', seq.tasks[0].train[0].inputs, '->', seq.class_names[seq.tasks[0].train[0].label])"),
    md("## Train every method through the sequence"),
    code("model, tok = load_text_classifier('minilm', num_labels=seq.num_classes)\n"
         "collate = TextCollator(tok, max_length=32)\n"
         "train = TrainConfig(epochs=3, progress=False)\n"
         "methods = [get_continual_method('frozen_linear')(lr=5e-3), get_continual_method('seq_lora')(lr=2e-3 if SMALL else 1e-3, r=8)]\n"
         "results = [run_sequence(seq, m, model, collate, train) for m in methods]\n"
         "print(metrics_table(results))"),
    md("## The accuracy matrices\nSequential LoRA learns each new task well but overwrites the old ones "
       "(the lower-left cells fade); the frozen backbone forgets less but learns less."),
    code("for r in results:\n    print(r.label)\n    print(matrix_table(r))\n"
         "from IPython.display import Image\n"
         "plot_accuracy_matrices(results, 'accuracy_matrix.png', title='WordNet supersenses, class-incremental')\n"
         "Image('accuracy_matrix.png')"),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}

from pathlib import Path

from nbclient import NotebookClient

here = Path(__file__).resolve().parent
NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(here)}}).execute()
(here / "accuracy_matrix.png").unlink(missing_ok=True)
nbf.write(nb, here / "01_continual_quickstart.ipynb")
print("wrote", here / "01_continual_quickstart.ipynb")
