"""Adam's arithmetic, once: the moment update and the bias-corrected denominator, as pure in-place tensor functions.

Every optimizer here that runs Adam on something calls these: :class:`~peft_ext.optim.DCTAdamW` on the projected
gradient and on plain parameters (:func:`adam_direction`), :class:`~peft_ext.optim.Riemannion` on the parameters
outside the manifold (:func:`adamw_update`). The operations and their order are ``torch.optim.AdamW``'s
(single-tensor path), so :func:`adamw_update` reproduces it bit for bit on CPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["adam_direction", "adamw_update"]

_Denom = tuple[Tensor, float | Tensor]  # (denominator, first moment's bias correction)


def _moments(m: Tensor, v: Tensor, g: Tensor, betas: tuple[float, float], eps: float, step: int | Tensor) -> _Denom:
    """Update Adam's moments in place; return the denominator ``sqrt(v) / sqrt(1 - b2^t) + eps`` and ``1 - b1^t``.

    The arguments are :func:`adam_direction`'s (``m``, ``v``, ``g``: its ``exp_avg``, ``exp_avg_sq``, ``grad``).

    Returns:
        ``(denom, bias_correction1)``: a new tensor and the first moment's bias correction (a tensor when ``step``
        is one).
    """
    beta1, beta2 = betas
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if isinstance(step, Tensor):
        t = step.to(m.dtype)
        bias1 = 1 - torch.pow(beta1, t)
        bias2_sqrt = (1 - torch.pow(beta2, t)).sqrt()
    else:
        bias1 = 1 - beta1**step
        bias2_sqrt = math.sqrt(1 - beta2**step)
    # one temporary, the rest in place: for an embedding-sized tensor every extra copy is a full pass
    return v.sqrt().div_(bias2_sqrt).add_(eps), bias1


def adam_direction(
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    grad: Tensor,
    betas: tuple[float, float],
    eps: float,
    step: int | Tensor,
) -> Tensor:
    """Update Adam's moments in place with ``grad`` and return the bias-corrected direction ``m^ / (sqrt(v^) + eps)``.

    The arithmetic is torch.optim.AdamW's (``m/(1-b1^t) / (sqrt(v)/sqrt(1-b2^t) + eps)``), so with the identity
    basis DCT-AdamW is AdamW up to floating-point rounding (the division by ``1 - b1^t`` comes last here, where
    AdamW folds it into the step size).

    Args:
        exp_avg: First moment ``m``, updated in place.
        exp_avg_sq: Second moment ``v``, updated in place.
        grad: The gradient, same shape as the moments.
        betas: ``(beta1, beta2)``.
        eps: Added to ``sqrt(v^)``.
        step: Number of updates these moments have seen, including this one: an int, or an integer tensor
            broadcastable to the moments when every entry has its own age (DCT-AdamW's per-column correction).
    """
    denom, bias1 = _moments(exp_avg, exp_avg_sq, grad, betas, eps, step)
    return torch.div(exp_avg, denom, out=denom).div_(bias1)


def adamw_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step in place, the same arithmetic as ``torch.optim.AdamW`` (decoupled decay, bias correction).

    Args:
        param: The parameter (updated in place).
        grad: Its gradient.
        exp_avg: First moment (updated in place). When it is wider than ``param`` (float32 moments of a
            bfloat16 / float16 parameter) the step is computed in the moments' dtype and rounded into ``param``.
        exp_avg_sq: Second moment (updated in place), the dtype of ``exp_avg``.
        step: The step number, counting from 1.
        lr: Learning rate.
        betas: Moment coefficients.
        eps: Denominator term.
        weight_decay: Decoupled weight decay.
    """
    if param.dtype != exp_avg.dtype:
        # half-precision parameter, float32 moments: the step is taken on a float32 copy and rounded once
        work = param.to(exp_avg.dtype)
        adamw_update(
            work,
            grad.to(exp_avg.dtype),
            exp_avg,
            exp_avg_sq,
            step,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )
        param.copy_(work)
        return
    param.mul_(1 - lr * weight_decay)
    denom, bias1 = _moments(exp_avg, exp_avg_sq, grad, betas, eps, step)
    param.addcdiv_(exp_avg, denom, value=-lr / bias1)
