"""How the low-rank Adam direction of a projected matrix becomes its update, as objects: :class:`UpdateRule`.

* :class:`ProjectedUpdate` (``update="projected"``): the direction mapped back into the full matrix by the basis
  (GaLore, DCT-AdamW).
* :class:`ChannelUpdate` (``update="channel"``): APOLLO's rule, the whole gradient scaled per channel by the ratio
  the low-rank Adam state estimates, with APOLLO's norm-growth limiter (:func:`~.subspace.channel_scaled_update`,
  :func:`~.subspace.limit_norm_growth`).

:class:`~peft_ext.optim.SubspaceAdamW` calls :meth:`UpdateRule.update` once per projected matrix and step; any
:class:`~peft_ext.optim.bases.SubspaceBasis` combines with any rule.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .bases import SubspaceBasis, SubspaceSpec, refuse_options
from .subspace import channel_scaled_update, limit_norm_growth

__all__ = ["UPDATE_RULES", "ChannelUpdate", "ProjectedStep", "ProjectedUpdate", "UpdateRule"]


@dataclass(frozen=True)
class ProjectedStep:
    """What an :class:`UpdateRule` gets for one projected matrix at one step.

    Args:
        basis: The matrix's basis kind.
        matrix: Its current ``(r, n)`` basis (from :meth:`~SubspaceBasis.select` / :meth:`~SubspaceBasis.current`).
        grad: The full gradient (with the error-feedback residual added, when on).
        low: ``grad`` projected onto ``matrix``.
        direction: Adam's direction computed on ``low``.
        state: The parameter's optimizer state (for rules that keep something, e.g. the last update's norm).
        spec: The matrix's side, rank and process layout.
    """

    basis: SubspaceBasis
    matrix: torch.Tensor
    grad: torch.Tensor
    low: torch.Tensor
    direction: torch.Tensor
    state: dict[str, Any]
    spec: SubspaceSpec


class UpdateRule(ABC):
    """Turns Adam's direction on the projected gradient into the full-shape update of one matrix."""

    #: The ``update=`` value that selects this rule.
    name: ClassVar[str]

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> UpdateRule:
        """The rule configured by a param group."""
        return cls()

    #: Options this rule cannot honour, ``{option: why}``: :meth:`check_options` refuses a group that turns one on.
    refuses: ClassVar[dict[str, str]] = {}

    @classmethod
    def check_options(cls, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for a param group's options this rule cannot honour (:attr:`refuses`)."""
        refuse_options(group, cls.refuses)

    @abstractmethod
    def update(self, step: ProjectedStep) -> torch.Tensor:
        """The update (before ``-lr * scale``) in the full shape, from one matrix's projected step."""


class ProjectedUpdate(UpdateRule):
    """The low-rank direction mapped back: ``u B`` (right) or ``B^T u`` (left)."""

    name = "projected"

    def update(self, step: ProjectedStep) -> torch.Tensor:
        return step.basis.project_back(step.direction, step.matrix, step.spec)


class ChannelUpdate(UpdateRule):
    """APOLLO's channel-scaled update: ``s * G`` with ``s_i = ||direction_i|| / ||low_i||`` per channel (row for
    ``side="right"``), so directions outside the subspace are not dropped.

    Args:
        norm_growth_limit: An update's norm may be at most this times the previous one's (APOLLO: 1.01); ``None``
            turns the limiter off.
    """

    name = "channel"

    def __init__(self, norm_growth_limit: float | None = 1.01) -> None:
        self.norm_growth_limit = norm_growth_limit

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> UpdateRule:
        return cls(group.get("norm_growth_limit"))

    refuses: ClassVar[dict[str, str]] = {
        "error_feedback": "with update='channel': the channel-scaled update already uses the whole gradient, so "
        "there is no residual to feed back; turn one of them off"
    }

    def update(self, step: ProjectedStep) -> torch.Tensor:
        scaled = channel_scaled_update(step.grad, step.low, step.direction, step.spec.side)
        return limit_norm_growth(scaled, step.state, self.norm_growth_limit, step.spec.reduce)


#: ``update=`` name -> rule class; the keys are :data:`~.subspace.UPDATES`.
UPDATE_RULES: dict[str, type[UpdateRule]] = {cls.name: cls for cls in (ProjectedUpdate, ChannelUpdate)}
