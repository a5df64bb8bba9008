"""The methods of the missing-modality experiment, as a registry: each says how it changes the frozen backbone.

A method is a :class:`MissingModalityMethod`: a ``build`` that takes a fresh copy of the pretrained
:class:`~.dual_encoder.DualEncoder` and returns the backbone to train (wrapped by PEFT, or not) with the prompts it
adds, plus two facts the experiment acts on: whether the backbone is frozen end to end (its features are then computed
once) and whether the adapter is merged into the backbone before inference. Register another one with
:func:`register_missing_modality_method`; the experiment and the ``peft-ext run`` job look methods up here.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from peft import LoraConfig, get_peft_model
from torch import nn

from ..tuners.mora import MoRAConfig, plan_targets
from .dual_encoder import DualEncoder, mora_patterns
from .prompts import MissingAwarePrompts

__all__ = [
    "MISSING_MODALITY_METHODS",
    "Built",
    "MissingModalityMethod",
    "get_missing_modality_method",
    "job_methods",
    "register_missing_modality_method",
]


class _Prepared(Protocol):
    """What a builder reads from the experiment's prepared backbone (:class:`~.preparation.Prepared`)."""

    settings: Any

    @property
    def matched_ranks(self) -> dict[str, int]: ...


@dataclass
class Built:
    """A method's trainable part: the backbone (a PEFT model or the plain dual encoder) and optional prompts."""

    backbone: nn.Module
    text_prompts: MissingAwarePrompts | None = None
    vision_prompts: MissingAwarePrompts | None = None


@dataclass(frozen=True)
class MissingModalityMethod:
    """One method of the missing-modality experiment.

    Args:
        name: Its name in configs and results.
        build: ``build(prep, backbone, seed)``: the trainable part around ``backbone`` (a fresh copy of the frozen
            pretrained dual encoder), initialized from ``seed``.
        description: One line for listings.
        frozen_backbone: Nothing in the backbone trains (a linear probe): features are computed once.
        merges: An adapter merged into the backbone before inference (no inference overhead).
        in_job: Offered by the ``peft-ext run`` job (``False``: benchmark-only).
    """

    name: str
    build: Callable[[_Prepared, DualEncoder, int], Built]
    description: str
    frozen_backbone: bool = False
    merges: bool = False
    in_job: bool = True


MISSING_MODALITY_METHODS: dict[str, MissingModalityMethod] = {}


def register_missing_modality_method(method: MissingModalityMethod) -> MissingModalityMethod:
    """Add ``method`` to :data:`MISSING_MODALITY_METHODS`; a name already taken raises ``ValueError``."""
    if method.name in MISSING_MODALITY_METHODS:
        raise ValueError(f"a missing-modality method named {method.name!r} is already registered")
    MISSING_MODALITY_METHODS[method.name] = method
    return method


def get_missing_modality_method(name: str) -> MissingModalityMethod:
    """The registered method ``name``; an unknown name raises ``ValueError`` listing the valid ones."""
    try:
        return MISSING_MODALITY_METHODS[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(MISSING_MODALITY_METHODS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown method {name!r}{hint}; choose from {tuple(MISSING_MODALITY_METHODS)}") from None


def job_methods() -> tuple[str, ...]:
    """The names the ``peft-ext run`` job offers, in registration order."""
    return tuple(name for name, method in MISSING_MODALITY_METHODS.items() if method.in_job)


def _one_regex(names: Any) -> str:
    return "|".join(re.escape(name) for name in names)


def _linear_probe(prep: _Prepared, backbone: DualEncoder, seed: int) -> Built:
    return Built(backbone)


def _lora(prep: _Prepared, backbone: DualEncoder, seed: int) -> Built:
    s = prep.settings
    # exactly the modules MoRA adapts (same plan), as one regex
    plan = plan_targets(backbone, MoRAConfig(r=s.r, top_layers=s.top_layers, **mora_patterns()))
    return Built(get_peft_model(backbone, LoraConfig(r=s.r, lora_alpha=s.alpha, target_modules=_one_regex(plan))))


def _mora(prep: _Prepared, backbone: DualEncoder, seed: int) -> Built:
    s = prep.settings
    config = MoRAConfig(r=s.r, alpha=s.alpha, top_layers=s.top_layers, **mora_patterns())
    return Built(get_peft_model(backbone, config))


def _prompts(prep: _Prepared, backbone: DualEncoder, seed: int) -> Built:
    s = prep.settings
    text = MissingAwarePrompts(s.top_layers, s.prompt_length, backbone.text.config.hidden_size, seed=seed)
    vision = MissingAwarePrompts(s.top_layers, s.prompt_length, backbone.vision.config.hidden_size, seed=seed + 1)
    return Built(backbone, text, vision)


def _lora_matched(prep: _Prepared, backbone: DualEncoder, seed: int) -> Built:
    s = prep.settings
    ranks = prep.matched_ranks
    # every module keeps LoRA's scaling alpha / r of the plain "lora" method
    config = LoraConfig(
        r=s.r,
        lora_alpha=s.alpha,
        target_modules=_one_regex(ranks),
        rank_pattern={re.escape(n): r for n, r in ranks.items()},
        alpha_pattern={re.escape(n): s.alpha * r / s.r for n, r in ranks.items()},
    )
    return Built(get_peft_model(backbone, config))


for _method in (
    MissingModalityMethod("linear_probe", _linear_probe, "frozen backbone, linear head", frozen_backbone=True),
    MissingModalityMethod("lora", _lora, "LoRA on the modules MoRA adapts", merges=True),
    MissingModalityMethod("mora", _mora, "MoRA: shared and per-modality factors", merges=True),
    MissingModalityMethod("prompts", _prompts, "missing-aware prompts (MMP) on a frozen backbone"),
    MissingModalityMethod(
        "lora_matched", _lora_matched, "LoRA at MoRA's trainable-parameter count", merges=True, in_job=False
    ),
):
    register_missing_modality_method(_method)
