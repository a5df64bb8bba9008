"""What differs between the kinds of model a continual job trains (``model.kind``), as one object per kind.

- ``classifier``: an encoder with a fresh linear head (:class:`~.text.SentenceClassifier`) for classification data.
  The task sequence is built first, since it says how many classes the head has; batches are texts (a
  :class:`~peft_ext.data.collate.TextCollator`); the job's model wraps the encoder as ``encoder``, so adapters target
  ``encoder.``-prefixed layers; the causal LM's options are refused; a saved method loads back as a
  :class:`~peft_ext.continual.trained.TrainedClassifier`.
- ``causal_lm``: a causal LM trained on instruction tasks. Its tokenizer comes first (it renders conversational rows
  while the sequence is built); batches are prompts with answers (the ``model`` section's causal collate); the LM head
  is no adapter target; preflight checks that every instruction fits ``model.max_length``; ``dtype``,
  ``load_in_4bit``, ``separator``, ``max_new_tokens``, ``chat_template`` and ``system_prompt`` are its own options; a
  saved method records the whole ``model`` section (what rebuilds its prompts) and loads back as a
  :class:`~peft_ext.continual.trained.TrainedGenerator`.

A config's ``model.kind`` names its kind and a saved method's description records it (``"kind"``); :func:`model_kind`
gives the object, and the config's validation, the job, preflight and :func:`~peft_ext.load_trained` ask it instead
of testing the name. A new kind is a subclass registered with :func:`register_model_kind`. This module imports no job
and nothing of :mod:`peft_ext.continual` when it is imported (only inside the methods that use them), so the config
may ask it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..named import KindRegistry

if TYPE_CHECKING:
    from ..data.tasks import TaskSequence

__all__ = ["MODEL_KINDS", "CausalLM", "Classifier", "ModelKind", "model_kind", "register_model_kind"]


class ModelKind:
    """One kind of model a continual job trains: what the job, its checks and a saved method do differently for it
    (see the module docstring). ``section`` below is a config's ``model`` section
    (:class:`~peft_ext.continual.config.ModelSection`)."""

    #: The ``model.kind`` value that picks it, also the ``"kind"`` a saved method's description records.
    name: ClassVar[str]
    #: The kind of task sequence it learns (``TaskSequence.kind``, a task kind's name in
    #: :mod:`peft_ext.continual.task_kinds`): the data sets whose sequences are of that kind go with it.
    sequence_kind: ClassVar[str]
    #: What it is, in the words of the config's error messages.
    summary: ClassVar[str]
    #: The ``model`` keys only this kind reads; the other kinds refuse them when set away from their defaults.
    own_options: ClassVar[tuple[str, ...]] = ()
    #: Said after the refusal of another kind's option.
    refusal_note: ClassVar[str] = ""
    #: What the names of the backbone's modules start with inside the job's model (a wrapper's attribute).
    module_prefix: ClassVar[str] = ""
    #: Linear layers whose names end in one of these are no adapter target (an output head that stays frozen).
    untargeted: ClassVar[tuple[str, ...]] = ()
    #: It answers instructions by generating text: preflight checks every instruction's length against
    #: ``model.max_length``, and a saved method loads back as a generator (``False``: it classifies).
    generates: ClassVar[bool] = False

    def check_options(self, section: Any) -> None:
        """Refuse an option of another kind set away from its default.

        Raises:
            ValueError: Naming the option and the kind it is for.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(section)}
        for other in MODEL_KINDS.values():
            for key in other.own_options:
                if key not in self.own_options and getattr(section, key) != defaults[key]:
                    raise ValueError(f"`{key}` is for `kind: {other.name}`{self.refusal_note}")

    def load_for_job(
        self, section: Any, build_sequence: Callable[[Any], TaskSequence], seed: int
    ) -> tuple[nn.Module, Any, TaskSequence]:
        """The job's backbone, its tokenizer and its task sequence, built in the order this kind needs.

        Args:
            section: The config's ``model`` section.
            build_sequence: Builds the task sequence, given the tokenizer (or ``None`` when the kind loads the model
                after the sequence).
            seed: The run's seed (a fresh head's initialization).

        Returns:
            ``(model, tokenizer, sequence)``.
        """
        raise NotImplementedError

    def collate(self, section: Any, tokenizer: Any) -> Any:
        """The job's collate: what turns a batch of examples into the model's inputs."""
        raise NotImplementedError

    def meta_backbone(self, model_config: Any) -> nn.Module:
        """The backbone built from its ``transformers`` config (called on the meta device)."""
        raise NotImplementedError

    def linear_layers(self, model_config: Any) -> dict[str, nn.Linear]:
        """The backbone's linear layers an adapter may target, by their names in the job's model; built on the meta
        device from ``model_config``, so no weights are read or allocated."""
        with torch.device("meta"):
            model = self.meta_backbone(model_config)
        return {
            f"{self.module_prefix}{name}": module
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not name.endswith(self.untargeted)
        }

    def saved_settings(self, section: Any) -> dict[str, Any]:
        """What a saved method's description records beyond the common keys, for :func:`~peft_ext.load_trained`
        (nothing by default)."""
        return {}


class Classifier(ModelKind):
    name = "classifier"
    sequence_kind = "classification"
    summary = "an encoder with a linear head, for classification data"
    refusal_note = "; a classifier trains in float32"
    module_prefix = "encoder."  # SentenceClassifier.encoder

    def load_for_job(
        self, section: Any, build_sequence: Callable[[Any], TaskSequence], seed: int
    ) -> tuple[nn.Module, Any, TaskSequence]:
        from .text import load_text_classifier

        sequence = build_sequence(None)  # the head needs the number of classes
        model, tokenizer = load_text_classifier(section.backbone, sequence.num_classes, section.dropout, seed=seed)
        return model, tokenizer, sequence

    def collate(self, section: Any, tokenizer: Any) -> Any:
        from ..data.collate import TextCollator

        return TextCollator(tokenizer, section.max_length)

    def meta_backbone(self, model_config: Any) -> nn.Module:
        from transformers import AutoModel

        return AutoModel.from_config(model_config)


class CausalLM(ModelKind):
    name = "causal_lm"
    sequence_kind = "generation"
    summary = "a causal LM trained on instruction tasks"
    own_options = ("max_new_tokens", "dtype", "load_in_4bit", "separator", "chat_template", "system_prompt")
    untargeted = ("lm_head",)  # the LM head stays as pretrained
    generates = True

    def load_for_job(
        self, section: Any, build_sequence: Callable[[Any], TaskSequence], seed: int
    ) -> tuple[nn.Module, Any, TaskSequence]:
        from .text import load_causal_lm

        # the tokenizer renders conversational rows, so it comes first
        model, tokenizer = load_causal_lm(section.backbone, section.dtype, section.load_in_4bit)
        return model, tokenizer, build_sequence(tokenizer)

    def collate(self, section: Any, tokenizer: Any) -> Any:
        return section.causal_collate(tokenizer)

    def meta_backbone(self, model_config: Any) -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(model_config)

    def saved_settings(self, section: Any) -> dict[str, Any]:
        return {"model": dataclasses.asdict(section)}  # what rebuilds the prompts: chat, separator


#: The kinds by name.
MODEL_KINDS: KindRegistry[ModelKind] = KindRegistry("model kind")
#: Register a kind (a class decorator).
register_model_kind = MODEL_KINDS.register
register_model_kind(Classifier)
register_model_kind(CausalLM)


def model_kind(name: str) -> ModelKind:
    """The kind object that ``model.kind: name`` (or a saved description's ``"kind"``) names.

    Raises:
        ValueError: A kind no one registered, naming the registered ones.
    """
    return MODEL_KINDS.lookup(name)
