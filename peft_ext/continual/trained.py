"""What a continual job keeps of each method it trained, and how to use it on new text.

``peft-ext run`` saves every classification method's final model under ``output.dir/adapters/<label>/``
(``output.save_adapters: false`` turns it off):

- ``adapter_config.json`` + ``adapter_model.safetensors``: the adapter in PEFT's layout, when the method trains one
  (it loads with ``PeftModel.from_pretrained`` on the base model, once ``peft_ext`` is imported);
- ``weights.safetensors``: the base model's tensors the run changed, when it trains no adapter (full fine-tuning:
  every tensor; a frozen backbone with a trained head: the head);
- ``head.pt``: the state of the continual head that scores the features (``analytic``, ``prototype``, ...), when the
  method has one (loads with ``torch.load(..., weights_only=True)``);
- ``peft_ext_model.json``: what rebuilds the model: the backbone, the number and names of the classes, the head and
  the files above.

:func:`load_trained` (``peft_ext.load_trained``) reads such a folder back and classifies new texts::

    model = peft_ext.load_trained("runs/quickstart/adapters/splitlora")
    print(model.predict(["a small domesticated carnivore", "move fast on foot"]))

``peft-ext predict CONFIG_OR_FOLDER FILE`` does the same from the command line.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

if TYPE_CHECKING:
    from .heads.base import ContinualHead

__all__ = [
    "MODEL_FILE",
    "TrainedClassifier",
    "TrainedGenerator",
    "load_classifier",
    "load_generator",
    "load_trained",
    "read_texts",
    "save_trained",
    "saved_methods",
]

#: The description file of a saved method's folder.
MODEL_FILE = "peft_ext_model.json"
HEAD_FILE = "head.pt"
WEIGHTS_FILE = "weights.safetensors"
FORMAT = 1


def _is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def changed_tensors(model: nn.Module, base: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``model``'s state that differ from ``base``'s (or that ``base`` lacks), contiguous copies."""
    before = base.state_dict()
    out = {}
    for name, value in model.state_dict().items():
        old = before.get(name)
        if old is None or old.shape != value.shape or not torch.equal(old.to(value.device), value):
            out[name] = value.detach().cpu().contiguous().clone()
    return out


def save_trained(
    directory: Union[str, Path],
    model: nn.Module,
    head: Optional[ContinualHead],
    base: nn.Module,
    description: dict[str, Any],
    merge: bool = False,
) -> Path:
    """Save one method's final model to ``directory`` (replaced whole, atomically: a crash leaves the old folder or
    none, never half of one).

    Args:
        directory: The method's folder (``output.dir/adapters/<label>``).
        model: The trained model (a ``PeftModel`` or the base model's class).
        head: The run's continual head (its state is saved; the linear head's is empty).
        base: The untouched base model (what ``load_trained`` rebuilds), to find the tensors a non-adapter run changed.
        description: What rebuilds the base model: ``backbone``, ``num_classes``, ``class_names``, ``dropout``,
            ``seed``, ``max_length`` (and anything else to record, e.g. ``method``, ``label``, ``final_acc``).
        merge: Save the adapter merged into the base model's tensors (the tensors it changed), not as an adapter: for
            a method that merged earlier tasks' adapters into the backbone (``rewraps_model``), whose last adapter
            alone is not its model.

    Returns:
        ``directory``.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = dict(description, format=FORMAT, adapter=False, weights=None, head=None)
    if _is_peft(model) and not merge:
        model.save_pretrained(str(tmp))
        meta["adapter"] = True
    else:
        merged = copy.deepcopy(model).merge_and_unload() if _is_peft(model) else model
        changed = changed_tensors(merged, base)
        if changed:
            save_file(changed, str(tmp / WEIGHTS_FILE))
            meta["weights"] = WEIGHTS_FILE
    if head is not None:
        torch.save(head.state_dict(), tmp / HEAD_FILE)
        meta["head"] = {"name": head.name, **_options(head)}
    (tmp / MODEL_FILE).write_text(json.dumps(meta, indent=1, default=str) + "\n")
    old = directory.with_name(directory.name + ".old")
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def _options(head: ContinualHead) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(head.options) if dataclasses.is_dataclass(head.options) else {}


def saved_methods(output_dir: Union[str, Path]) -> list[str]:
    """The labels of the methods saved under ``output_dir/adapters`` (sorted)."""
    root = Path(output_dir) / "adapters"
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / MODEL_FILE).is_file())


@dataclass
class TrainedClassifier:
    """A saved method's model, ready to classify texts (:func:`load_trained`).

    Attributes:
        model: The classifier (base model with the adapter loaded, in evaluation mode).
        tokenizer: Its tokenizer.
        head: The continual head of the run; one that reads features (``analytic``, ``prototype``, ...) scores them,
            otherwise (``linear``, ``cosine``) the model's own classifier does.
        class_names: ``class_names[i]`` is the name of class ``i``.
        meta: The saved description (``peft_ext_model.json``).
    """

    model: nn.Module
    tokenizer: Any
    head: Optional[ContinualHead]
    class_names: list[str]
    meta: dict[str, Any]

    @torch.no_grad()
    def scores(self, texts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
        """``(len(texts), num_classes)`` scores (the class with the largest is the prediction)."""
        from ..data.collate import TextCollator
        from ..data.tasks import Example
        from .heads.base import forward_with_features

        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings, got one string")
        collate = TextCollator(self.tokenizer, self.meta.get("max_length", 128))
        reads = self.head is not None and self.head.reads_features
        out = []
        for start in range(0, len(texts), batch_size):
            batch = collate([Example(text, 0) for text in texts[start : start + batch_size]])
            logits, features = forward_with_features(self.model, batch)
            out.append(self.head.scores(features.float()) if reads else logits.float())
        return torch.cat(out) if out else torch.zeros(0, len(self.class_names))

    def predict(self, texts: Sequence[str], batch_size: int = 64) -> list[str]:
        """The predicted class name of each text."""
        return [self.class_names[i] for i in self.scores(texts, batch_size).argmax(-1).tolist()]


@dataclass
class TrainedGenerator:
    """A saved causal-LM method's model, ready to answer instructions (:func:`load_trained`).

    Attributes:
        model: The causal LM (base model with the adapter loaded, or the merged weights, in evaluation mode).
        collate: Renders prompts as the run did (chat template, separator) and decodes answers.
        meta: The saved description (``peft_ext_model.json``).
    """

    model: nn.Module
    collate: Any
    meta: dict[str, Any]

    @torch.no_grad()
    def answer(self, prompts: Sequence[str], batch_size: int = 16) -> list[str]:
        """The greedy answer to each prompt (KV cache; at most ``model.max_new_tokens`` tokens each, default 64).

        Raises:
            ValueError: A prompt that needs more tokens than the run's ``max_length`` or the model's positions,
                naming its length and the limit.
        """
        from ..data.tasks import Example, Instruction
        from .generation import generate_answers

        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings, got one string")
        limit = self.collate.max_length
        positions = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        budget = self.collate.max_new_tokens or 64
        collate = self.collate
        if collate.max_new_tokens is None:  # no reference answers to size the budget by
            collate = copy.copy(collate)
            collate.max_new_tokens = budget
        answers = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            for prompt in chunk:
                n = len(self.collate.render(prompt))
                if n >= limit or (positions is not None and n + budget > positions):
                    cap = limit if n >= limit else positions - budget
                    raise ValueError(
                        f"prompt {prompt[:40]!r} is {n} tokens long; the model answers prompts of at most {cap - 1} "
                        f"tokens (max_length {limit}, {positions} positions, {budget} new tokens)"
                    )
            examples = [Example(Instruction(p, "?"), 0) for p in chunk]
            answers += generate_answers(self.model, examples, collate, next(self.model.parameters()).device)
        return answers

    def predict(self, texts: Sequence[str], batch_size: int = 16) -> list[str]:
        """:meth:`answer` (what ``peft-ext predict`` calls for every saved method)."""
        return self.answer(texts, batch_size)


def load_generator(directory: Path, meta: dict[str, Any]) -> TrainedGenerator:
    """The causal-LM method saved in ``directory`` (its description ``meta`` records the ``model`` section)."""
    if "model" not in meta:
        raise ValueError(
            f"{str(directory)!r} holds a causal-LM method saved before its prompt settings were recorded: load "
            "its adapter with PeftModel.from_pretrained on the backbone and generate, or run the job again"
        )
    from safetensors.torch import load_file

    from ..models import load_causal_lm
    from .config import ModelSection
    from .generation import prompt_query

    section = ModelSection(**meta["model"])
    model, tokenizer = load_causal_lm(section.backbone, section.dtype, section.load_in_4bit)
    collate = section.causal_collate(tokenizer)
    if meta.get("adapter"):
        model = _with_adapter(model, directory)
        if hasattr(model.base_model, "set_query_fn"):  # a PCLR pool routes each instruction by its prompt
            model.base_model.set_query_fn(prompt_query(collate.separator_id))
    if meta.get("weights"):
        missing = model.load_state_dict(load_file(str(directory / meta["weights"])), strict=False)
        if missing.unexpected_keys:
            raise ValueError(f"{meta['weights']} holds tensors the model lacks: {missing.unexpected_keys[:5]}")
    return TrainedGenerator(model.eval(), collate, meta)


def _with_adapter(model: nn.Module, directory: Path) -> nn.Module:
    """``model`` with the saved adapter of ``directory``, after :func:`~peft_ext.checkpoint.verify_checkpoint`: an
    ``adapter_config.json`` that does not fit its weights (e.g. ``"peft_type": "LORA"`` over SplitLoRA tensors, which
    PEFT would load as an untrained LoRA with a warning) is refused with what does not fit."""
    from peft import PeftModel  # peft_ext's adapter types are registered: importing this package did it

    from ..checkpoint import verify_checkpoint

    verify_checkpoint(directory)
    return PeftModel.from_pretrained(model, str(directory))


def load_trained(directory: Union[str, Path]) -> TrainedClassifier | TrainedGenerator:
    """Load a method's folder written by :func:`save_trained` (``peft-ext run`` writes one per method under
    ``output.dir/adapters``): a :class:`TrainedClassifier`, or for a causal-LM job a :class:`TrainedGenerator`, as
    the model kind its description records loads it (:mod:`peft_ext.models.kinds`).

    Raises:
        ValueError: The folder holds no saved method (naming what it does hold), or one of a model kind this
            peft-ext does not know.
    """
    from ..models.kinds import Classifier, model_kind

    directory = Path(directory)
    path = directory / MODEL_FILE
    if not path.is_file():
        inside = saved_methods(directory)
        hint = f"; it holds the methods {inside} under adapters/ (pass one of those folders)" if inside else ""
        raise ValueError(f"{str(directory)!r} has no {MODEL_FILE}: not a method saved by peft-ext run{hint}")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} has format {meta.get('format')!r}; this peft-ext reads format {FORMAT}")
    # a description without "kind" was saved before causal LMs were: a classifier
    kind = model_kind(meta.get("kind", Classifier.name))
    return load_generator(directory, meta) if kind.generates else load_classifier(directory, meta)


def load_classifier(directory: Path, meta: dict[str, Any]) -> TrainedClassifier:
    """The classification method saved in ``directory``, whose description is ``meta``."""
    from safetensors.torch import load_file

    from ..models import load_text_classifier
    from .heads.base import build_head

    model, tokenizer = load_text_classifier(
        meta["backbone"], meta["num_classes"], meta.get("dropout", 0.0), seed=meta.get("seed", 0)
    )
    head = None
    if meta.get("head"):
        head = build_head(meta["head"], meta["num_classes"], seed=meta.get("seed", 0))
        head.load_state_dict(torch.load(directory / HEAD_FILE, weights_only=True))
        model = head.attach(model)  # a head that replaces the classifier module (cosine) does so before the adapter
    if meta.get("adapter"):
        model = _with_adapter(model, directory)
    if meta.get("weights"):
        missing = model.load_state_dict(load_file(str(directory / meta["weights"])), strict=False)
        if missing.unexpected_keys:
            raise ValueError(f"{meta['weights']} holds tensors the model lacks: {missing.unexpected_keys[:5]}")
    model.eval()
    return TrainedClassifier(model, tokenizer, head, list(meta["class_names"]), meta)


def read_texts(path: Union[str, Path], column: str = "text") -> list[str]:
    """The texts of a file: a ``.txt`` file's non-empty lines, or a ``.csv`` / ``.jsonl`` file's ``column``.

    Raises:
        ValueError: No text in the file, a missing column (naming the columns there), or text that is not UTF-8.
    """
    import csv

    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{str(path)!r} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    suffix = path.suffix.lower()
    if suffix == ".csv":
        rows = list(csv.DictReader(raw.splitlines()))
        columns = list(rows[0]) if rows else []
        if rows and column not in rows[0]:
            raise ValueError(f"{str(path)!r} has no column {column!r}; columns: {columns} (pass --column)")
        texts = [row[column] for row in rows]
    elif suffix in (".jsonl", ".json"):
        texts = []
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or column not in row:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{str(path)!r} line {number} has no key {column!r}; it has {keys} (pass --column)")
            texts.append(str(row[column]))
    else:
        texts = [line.strip() for line in raw.splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"{str(path)!r} holds no text to classify")
    return texts
