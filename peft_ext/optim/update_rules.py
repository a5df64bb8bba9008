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

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .bases import SubspaceBasis, SubspaceSpec, check_flag
from .components import Component, register
from .subspace import channel_scaled_update, limit_norm_growth

__all__ = ["ChannelUpdate", "ProjectedStep", "ProjectedUpdate", "UpdateRule"]


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


class UpdateRule(Component):
    """Turns Adam's direction on the projected gradient into the full-shape update of one matrix.

    Subclasses declare their options as constructor keywords (:class:`~.components.Component`).
    """

    kind = "update"
    #: Whether the step keeps the projection's residual ``E = (G + E) - a B`` and adds it to the next gradient (only
    #: rules that map the low-rank direction back declare the option).
    error_feedback: bool = False
    #: Whether that residual is stored 8-bit.
    error_feedback_8bit: bool = False

    @abstractmethod
    def update(self, step: ProjectedStep) -> torch.Tensor:
        """The update (before ``-lr * scale``) in the full shape, from one matrix's projected step."""


@register
class ProjectedUpdate(UpdateRule):
    """The low-rank direction mapped back: ``u B`` (right) or ``B^T u`` (left).

    Args:
        error_feedback: Keep the residual ``E = (G + E) - a B`` and add it to the next gradient, so directions outside
            the subspace are delayed rather than lost. Costs a full ``R x C`` buffer per matrix (1 byte per entry
            with ``error_feedback_8bit``): larger than the moments it saves at small ``r``.
        error_feedback_8bit: Store that buffer 8-bit (the optimizer's ``quant_blocksize`` and ``min_8bit_size``).
    """

    name = "projected"

    def __init__(self, error_feedback: bool = False, error_feedback_8bit: bool = False) -> None:
        self.error_feedback = check_flag("error_feedback", error_feedback)
        self.error_feedback_8bit = check_flag("error_feedback_8bit", error_feedback_8bit)
        if error_feedback_8bit and not error_feedback:
            raise ValueError("`error_feedback_8bit=True` needs `error_feedback=True` (there is no buffer to quantize)")

    def update(self, step: ProjectedStep) -> torch.Tensor:
        return step.basis.project_back(step.direction, step.matrix, step.spec)


_NO_RESIDUAL = "the channel-scaled update already uses the whole gradient, so there is no residual to feed back"


@register
class ChannelUpdate(UpdateRule):
    """APOLLO's channel-scaled update: ``s * G`` with ``s_i = ||direction_i|| / ||low_i||`` per channel (row for
    ``side="right"``), so directions outside the subspace are not dropped.

    Args:
        norm_growth_limit: An update's norm may be at most this times the previous one's (APOLLO: 1.01); ``None``
            turns the limiter off.
    """

    name = "channel"
    why_not: ClassVar[dict[str, str]] = {"error_feedback": _NO_RESIDUAL, "error_feedback_8bit": _NO_RESIDUAL}

    def __init__(self, norm_growth_limit: float | None = 1.01) -> None:
        limit = norm_growth_limit
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 1 or limit == float("inf")
        ):
            raise ValueError(f"`norm_growth_limit` must be None or a finite number >= 1 (APOLLO: 1.01), got {limit!r}")
        self.norm_growth_limit = limit

    def update(self, step: ProjectedStep) -> torch.Tensor:
        scaled = channel_scaled_update(step.grad, step.low, step.direction, step.spec.side)
        return limit_norm_growth(scaled, step.state, self.norm_growth_limit, step.spec.reduce)
