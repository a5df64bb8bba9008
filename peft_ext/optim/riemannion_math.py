"""Riemannion's update for a stack of adapters, as one pure function (docs/methods.md (Riemannion)).

:func:`riemannion_update` takes the current points, the two gradient products the layer's backward pass delivers
and the momentum, and returns the new points and the transported momentum; it changes nothing in place.
:class:`~peft_ext.optim.riemannion.Riemannion` only gathers the stacks, calls it and writes the results back. The
geometry (projection, orthogonalization, transport) is :mod:`peft_ext.manifolds.fixed_rank`'s and the retraction
:func:`peft_ext.kernels.retraction.retract`.

Two implementations of the same step:

- :func:`riemannion_update_reference` composes the geometry's functions one by one: ``orthogonalize`` factors the
  momentum's tangent factors (two QRs, one SVD), ``retract`` factors the step's (two more QRs, one SVD), ``transp``
  projects again. The reference, and the path for CUDA fp32 (Triton retraction) and half precision.
- :func:`riemannion_update` (CPU and other devices without the Triton retraction) factors once. The direction, the
  current point and the momentum all lie in ``span(Q_L) x span(Q_R)`` with ``Q_L = qr([M_A, A]).Q`` and
  ``Q_R = qr([B_R, M_B]).Q``: ``Ortho`` of the momentum is ``Q_L P D Qh Q_R^T``, its projection is that of the core,
  and ``x_scale X - lr D`` is ``Q_L Y Q_R^T`` with a 2r x 2r core ``Y``. So the retraction needs no QR of its own
  (its best rank-r approximation is the top-r SVD of ``Y``), the projection and the transport are products of
  2r x 2r cores, and only the new factors and the transported momentum touch m x 2r / n x 2r matrices. Equal to the
  reference in exact arithmetic (tested to float rounding); factors of the new point may differ from the reference's
  by column signs (an SVD's choice), the point ``A B^T`` does not.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..kernels.retraction import choose_retraction, retract
from ..manifolds import fixed_rank
from ..manifolds.fixed_rank import FixedRankPoint, TangentVector, egrad2rgrad, orthogonalize, transp
from ..precision import is_half

__all__ = ["riemannion_update", "riemannion_update_reference"]


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
    """One Riemannion (or, with ``orthogonalize_step=False``, RiemannLoRA) step for a stack of adapters; pure.

    Args:
        point: The current point ``X = A B^T`` (factors (..., m, r) and (..., n, r)).
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
    kwargs = {"lr": lr, "beta": beta, "nesterov": nesterov, "weight_decay": weight_decay}
    kwargs |= {"orthogonalize_step": orthogonalize_step, "rtol": rtol}
    if is_half(point.A.dtype) or choose_retraction(point.A) != "qr":
        return riemannion_update_reference(point, grad_right, grad_left, momentum, **kwargs)
    grad = egrad2rgrad(point, grad_right, grad_left)
    buf = grad if momentum is None else momentum * beta + grad
    direction = grad + buf * beta if nesterov else buf
    A, B_R, r = point.A, point.B_R, point.rank
    # one basis of each side for the whole step: [M_A, A] = Q_L T_L and [B_R, M_B] = Q_R T_R (M: the direction);
    # any orthonormal bases of these spans serve, so the QRs' signs are left as they come
    Q_L, T_L = torch.linalg.qr(torch.cat([direction.A_dot, A], dim=-1))
    Q_R, T_R = torch.linalg.qr(torch.cat([B_R, direction.B_dot], dim=-1))
    A_c, B_R_c = T_L[..., r:], T_R[..., :r]  # A = Q_L A_c and B_R = Q_R B_R_c: orthonormal coordinates
    core = T_L @ T_R.mT  # the direction M = Q_L core Q_R^T
    if orthogonalize_step:
        if rtol is None:  # ortho_lowrank's default for the m x n matrix, not for its 2r x 2r core
            rtol = max(A.shape[-2], B_R.shape[-2]) * torch.finfo(A.dtype).eps
        U_o, V_o = fixed_rank.ortho_lowrank(T_L, T_R, rtol)  # Ortho(M) = Q_L U_o V_o^T Q_R^T
        step = _proju_core(A_c, B_R_c, U_o @ V_o.mT)  # P_T(Ortho(M)), as orthogonalize
    else:
        step = core  # M is tangent already
    # x_scale X - lr D in coordinates: X = A B^T = Q_L A_c (B_R^T B)^T B_R_c^T Q_R^T (B = B_R (B_R^T B))
    R_B = B_R.mT @ point.B
    scale = 1.0 - lr * weight_decay
    target = (A_c * scale) @ (B_R_c @ R_B).mT - step * lr
    P, S, Qh = torch.linalg.svd(target, full_matrices=False)  # retr: the top r triplets of the 2r x 2r core
    P_r = P[..., :r]
    new_point = FixedRankPoint.from_factors(Q_L @ P_r, (Q_R @ Qh[..., :r, :].mT) * S[..., :r].unsqueeze(-2))
    if nesterov:
        return new_point, transp(point, new_point, buf)  # buf is not the direction: no shared coordinates
    # transp by re-projection at the new point (A' = Q_L P_r): B_dot = M^T A', A_dot = (I - A' A'^T) M B_R'
    B_dot = Q_R @ (core.mT @ P_r)
    proj = core @ (Q_R.mT @ new_point.B_R)
    A_dot = Q_L @ (proj - P_r @ (P_r.mT @ proj))
    return new_point, TangentVector(A_dot, B_dot)


def _proju_core(A_c: Tensor, B_R_c: Tensor, Y: Tensor) -> Tensor:
    """``P_T(Y)`` of a core in orthonormal coordinates where the point's factors are ``A_c`` and ``B_R_c``:
    ``A_c A_c^T Y + (I - A_c A_c^T) Y B_R_c B_R_c^T`` (:func:`~peft_ext.manifolds.fixed_rank.proju`)."""
    YB = Y @ B_R_c
    A_dot = YB - A_c @ (A_c.mT @ YB)
    return A_dot @ B_R_c.mT + A_c @ (Y.mT @ A_c).mT


def riemannion_update_reference(
    point: FixedRankPoint, grad_right: Tensor, grad_left: Tensor, momentum: Optional[TangentVector], **settings: Any
) -> tuple[FixedRankPoint, TangentVector]:
    """:func:`riemannion_update` composed from the geometry's functions (see the module docstring); the same
    arguments (``settings``: its keywords, ``lr`` and ``beta`` required)."""
    lr, beta, nesterov, weight_decay, orthogonalize_step, rtol = _step_settings(**settings)
    grad = egrad2rgrad(point, grad_right, grad_left)
    buf = grad if momentum is None else momentum * beta + grad
    direction = grad + buf * beta if nesterov else buf
    if orthogonalize_step:
        direction = orthogonalize(point, direction, rtol)
    # a stack of same-shaped adapters is retracted in one call: Householder QR on CPU (the reference), batched
    # CholeskyQR2 with Triton Gram kernels on CUDA (peft_ext.kernels.retraction)
    new_point = retract(point, direction * (-lr), x_scale=1.0 - lr * weight_decay)
    return new_point, transp(point, new_point, buf)


def _step_settings(*, lr: float, beta: float, nesterov: bool = False, weight_decay: float = 0.0, **rest: Any) -> tuple:
    # riemannion_update's keywords with its defaults, in its order (an unknown keyword is a TypeError, as there)
    orthogonalize_step, rtol = rest.pop("orthogonalize_step", True), rest.pop("rtol", None)
    if rest:
        raise TypeError(f"riemannion_update_reference() got unexpected keyword arguments {sorted(rest)}")
    return lr, beta, nesterov, weight_decay, orthogonalize_step, rtol
