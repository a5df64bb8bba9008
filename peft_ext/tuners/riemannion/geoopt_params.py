"""geoopt's optimizers on a Riemannion adapter: :func:`riemannian_parameters` puts each adapter's ``riemannion_A`` on
geoopt's Stiefel manifold (:data:`peft_ext.manifolds.STIEFEL`), its ``riemannion_B`` Euclidean. The product of the
factors' manifolds is a different geometry from :class:`peft_ext.optim.Riemannion`'s (see
:mod:`peft_ext.manifolds.geoopt_manifold`)."""

from __future__ import annotations

import geoopt
import torch
from torch import nn

from ...distributed import is_dtensor
from ...manifolds.geoopt_manifold import ORTHONORMAL_TOL, STIEFEL
from ...precision import is_half
from .layer import AdapterRef, find_adapters

__all__ = ["riemannian_parameters"]


def riemannian_parameters(model: nn.Module, adapter_name: str | None = None) -> list[nn.Parameter]:
    """The trainable parameters of ``model`` ready for geoopt's optimizers, Riemannion adapters on their manifolds.

    Each Riemannion adapter's ``riemannion_A`` is replaced in its layer by a ``geoopt.ManifoldParameter`` on
    :data:`STIEFEL` sharing its storage, so ``geoopt.optim.RiemannianAdam`` / ``RiemannianSGD`` keep its columns
    orthonormal; ``riemannion_B`` and every other trainable parameter (heads, ``modules_to_save``) are Euclidean.
    The adapters' zero probes ``riemannion_Z`` are left out: they serve the Riemannion optimizer and must stay zero.
    Call it before building the optimizer (a replaced ``A`` is a new parameter object); calling it again returns the
    same parameters. See the module docstring for how this geometry differs from :class:`peft_ext.optim.Riemannion`'s.

    Args:
        model: A model with Riemannion adapters (e.g. from ``get_peft_model``).
        adapter_name: Only this Riemannion adapter (default: every trainable one); the other adapters' parameters
            are left out, other trainable parameters are included.

    Raises:
        ValueError: If the model has no trainable Riemannion adapter (named ``adapter_name``), or an adapter's ``A``
            is not orthonormal.
        TypeError: If an adapter's factors are bfloat16 / float16 (geoopt's QR retraction runs in the factor's dtype)
            or sharded DTensors.
    """
    every = find_adapters(model)
    refs = [ref for ref in every if adapter_name is None or ref.adapter_name == adapter_name]
    trainable = [ref for ref in refs if ref.A.requires_grad]
    if not trainable:
        names = sorted({ref.adapter_name for ref in every})
        if not every:
            found = "has no Riemannion adapter; add one with get_peft_model(model, RiemannionConfig(...))"
        elif not refs:
            found = f"has no Riemannion adapter named {adapter_name!r}; valid names: {names}"
        else:
            found = f"has no trainable Riemannion adapter{'' if adapter_name is None else f' named {adapter_name!r}'}"
            found += f" (adapters {names}); activate one with model.set_adapter(name)"
        raise ValueError(f"riemannian_parameters: {type(model).__name__} {found}")
    chosen = set()
    for ref in trainable:
        _check_adapter(ref)
        if not isinstance(getattr(ref.A, "manifold", None), geoopt.EuclideanStiefel):
            ref.layer.riemannion_A[ref.adapter_name] = geoopt.ManifoldParameter(ref.A.detach(), manifold=STIEFEL)
        chosen |= {id(ref.A), id(ref.B)}
    left_out = {id(p) for ref in every for p in (ref.A, ref.B, ref.Z)} - chosen
    return [p for p in model.parameters() if p.requires_grad and id(p) not in left_out]


@torch.no_grad()
def _check_adapter(ref: AdapterRef) -> None:
    A = ref.A
    if is_half(A.dtype) or is_half(ref.B.dtype):
        raise TypeError(
            f"riemannian_parameters: {ref} has {A.dtype} factors; geoopt's Stiefel retraction (QR) needs float32 or "
            "float64 (PEFT keeps adapters in float32 unless autocast_adapter_dtype=False)"
        )
    if is_dtensor(A) or is_dtensor(ref.B):
        raise TypeError(
            f"riemannian_parameters: {ref} is sharded (DTensor); geoopt's QR retraction needs whole factors: use "
            "peft_ext.optim.Riemannion for FSDP2 (docs/distributed.md)"
        )
    err = (A.double().mT @ A.double() - torch.eye(A.shape[-1], dtype=torch.float64, device=A.device)).abs().max()
    if err > ORTHONORMAL_TOL:
        raise ValueError(
            f"riemannian_parameters: {ref}: riemannion_A is not orthonormal (max |A^T A - I| = {err.item():.1e} > "
            f"{ORTHONORMAL_TOL}), so it is not a point of the Stiefel manifold; it was changed outside a manifold "
            "optimizer (RiemannionLayer.reorthonormalize(adapter_name) refactors it, keeping A B^T)"
        )
