"""Riemannion's update for a stack of adapters, as one pure function (docs/methods.md (Riemannion)).

:func:`riemannion_update` takes the current points, the two gradient products the layer's backward pass delivers
and the momentum, and returns the new points and the transported momentum; it changes nothing in place.
:class:`~peft_ext.optim.riemannion.Riemannion` only gathers the stacks, calls it and writes the results back. The
geometry (projection, orthogonalization, transport) is :mod:`peft_ext.manifolds.fixed_rank`'s and the retraction
:func:`peft_ext.kernels.retraction.retract`.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..kernels.retraction import retract
from ..manifolds.fixed_rank import FixedRankPoint, TangentVector, egrad2rgrad, orthogonalize, transp

__all__ = ["riemannion_update"]


def riemannion_update(
    point: FixedRankPoint,
    grad_right: Tensor,
    grad_left: Tensor,
    momentum: Optional[TangentVector],
    *,
    lr: float,
    beta: float,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    orthogonalize_step: bool = True,
    rtol: Optional[float] = None,
) -> tuple[FixedRankPoint, TangentVector]:
    """One Riemannion (or, with ``orthogonalize_step=False``, RiemannLoRA) step for one adapter; pure.

    Args:
        point: The current point ``X = A B^T``.
        grad_right: ``G B_R`` (m x r), the gradient of the layer's zero probe ``Z``.
        grad_left: ``G^T A`` (n x r), the gradient of ``B``.
        momentum: The momentum tangent vector at ``point`` (``None`` on the first step).
        lr: Step size (spectral-norm units when orthogonalizing, Frobenius units otherwise).
        beta: Momentum coefficient.
        nesterov: Step along ``grad + beta * M`` instead of ``M``.
        weight_decay: Decoupled weight decay: the step retracts ``(1 - lr * weight_decay) X - lr * D``.
        orthogonalize_step: Orthogonalize the direction (Riemannion) or not (RiemannLoRA).
        rtol: Rank threshold of the orthogonalization; see :func:`peft_ext.manifolds.ortho_lowrank`.

    Returns:
        ``(new_point, momentum transported to new_point)``; the stored momentum is the pre-orthogonalization one.
    """
    grad = egrad2rgrad(point, grad_right, grad_left)
    buf = grad if momentum is None else momentum * beta + grad
    direction = grad + buf * beta if nesterov else buf
    if orthogonalize_step:
        direction = orthogonalize(point, direction, rtol)
    # a stack of same-shaped adapters is retracted in one call: Householder QR on CPU (the reference), batched
    # CholeskyQR2 with Triton Gram kernels on CUDA (peft_ext.kernels.retraction)
    new_point = retract(point, direction * (-lr), x_scale=1.0 - lr * weight_decay)
    return new_point, transp(point, new_point, buf)
