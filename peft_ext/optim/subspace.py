"""The bases and update rules of DCT-AdamW's family besides the DCT: SVD-free bases that track the gradient.

Three ways to pick the ``r``-dimensional subspace a projected matrix's moments live in (``basis=``):

* ``"dct"``: the ``r`` DCT-II basis vectors with the largest scores (DCT-AdamW, :mod:`peft_ext.optim.dct`).
* ``"coordinates"``: the ``r`` plain coordinates (columns, or rows for ``side="left"``) whose gradient slices have the
  largest norm; a near-free baseline (no transform, nothing stored but ``r`` indices).
* ``"power"``: an orthonormal basis refreshed by one step of block power (subspace) iteration on ``G^T G``, warm
  started from the previous basis: ``B <- orth(G^T (G B^T))^T``, two ``O(m n r)`` products and a QR of an ``n x r``
  matrix, no SVD. The first basis is the DCT selection. At each refresh the Adam moments are carried into the new
  basis through the ``r x r`` overlap ``O = B_old B_new^T``: ``m <- m O`` (exact for the component inside both
  subspaces) and ``v <- v (O * O)`` (the second moment of a rotated coordinate, cross terms dropped, so it stays
  non-negative).

And two ways to turn the low-rank Adam direction into an update (``update=``):

* ``"projected"``: map it back into the full matrix (GaLore, DCT-AdamW).
* ``"channel"``: APOLLO's rule: the low-rank Adam state only estimates one scale per channel (row for
  ``side="right"``, column for ``"left"``): ``s_i = ||adam(G B^T)_i|| / ||(G B^T)_i||``, and the update is the whole
  gradient scaled channel-wise, ``s * G``, so directions outside the subspace are not dropped. With APOLLO's
  norm-growth limiter: an update whose norm exceeds ``gamma`` times the previous one's is scaled back to that.

These are pure functions on tensors; the objects the optimizer calls are in :mod:`.bases` (one class per ``basis``)
and :mod:`.update_rules` (one per ``update``), registered in :data:`.components.REGISTRY`.
"""

from __future__ import annotations

import torch

from .dct import ScoreReduce, projection_side, reduced_norm

__all__ = [
    "channel_scaled_update",
    "coordinate_select",
    "limit_norm_growth",
    "one_hot_rows",
    "power_refresh",
    "rotate_by_overlap",
]


def coordinate_select(
    grad: torch.Tensor, rank: int, side: str | None = None, norm: float = 1.0, reduce: ScoreReduce | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rank`` coordinates (columns for ``side="right"``, rows for ``"left"``) whose slices of ``grad`` have the
    largest ``norm``; ``(indices sorted ascending, grad restricted to them)`` like :func:`~.dct.dct_select`.

    Args:
        grad: The ``(R, C)`` gradient.
        rank: How many coordinates, ``1 <= rank <= n``.
        side: Projection side (default: the smaller dimension).
        norm: Vector norm of the score (1, 2 or ``math.inf``; other ``p`` work too).
        reduce: For a row shard with ``side="right"``: combines the per-column partial norms over processes.
    """
    side = projection_side(grad.shape) if side is None else side
    dim = 1 if side == "right" else 0
    n = grad.shape[dim]
    if not 1 <= rank <= n:
        raise ValueError(
            f"`rank` must be in [1, {n}] for a {side} projection of shape {tuple(grad.shape)}, got {rank}"
        )
    work = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
    if reduce is None:
        scores = torch.linalg.vector_norm(work, ord=norm, dim=1 - dim)
    else:  # a row shard: the per-column norms combined over the processes, as DCT-AdamW's scores
        scores = reduced_norm(work, norm, 1 - dim, reduce)
    indices = torch.topk(scores, rank, sorted=False).indices.sort().values
    return indices, grad.index_select(dim, indices)


def one_hot_rows(indices: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``(r, n)`` basis whose rows are the unit vectors of ``indices`` (the coordinate basis in
    :func:`~.dct.project`'s layout)."""
    basis = torch.zeros(indices.numel(), n, dtype=dtype, device=device)
    basis[torch.arange(indices.numel(), device=device), indices.to(device)] = 1
    return basis


def power_refresh(
    grad: torch.Tensor, basis: torch.Tensor, side: str, reduce: ScoreReduce | None = None
) -> torch.Tensor:
    """One block power iteration: the new orthonormal ``(r, n)`` basis ``orth(G^T (G B^T))^T`` (right) or
    ``orth(G (B G)^T)^T`` (left), in ``basis``'s dtype.

    Args:
        grad: The ``(R, C)`` gradient.
        basis: The current basis, ``(r, C)`` (right) or ``(r, R)`` (left), orthonormal rows.
        side: ``"right"`` or ``"left"``.
        reduce: For a row shard with ``side="right"``: sums ``G^T (G B^T)`` (a sum over rows) over the processes.

    The QR runs in float32 (float64 for float64 inputs); column signs are made deterministic (non-negative diagonal
    of ``R``) so that every process of a data-parallel run gets the same basis from the same gradient.
    """
    work = torch.float64 if grad.dtype == torch.float64 else torch.float32
    g, b = grad.to(work), basis.to(work)
    if side == "right":
        z = g.T @ (g @ b.T)  # (C, r)
        if reduce is not None:
            reduce(z, "sum")
    else:
        z = g @ (b @ g).T  # (R, r)
    if not bool(torch.isfinite(z).all()) or float(z.abs().max()) == 0.0:
        return basis  # a zero gradient carries no direction: keep the current basis
    q, r = torch.linalg.qr(z)
    signs = torch.sign(torch.diagonal(r))
    q = q * torch.where(signs == 0, torch.ones_like(signs), signs)
    return q.T.contiguous().to(basis.dtype)


def rotate_by_overlap(
    m: torch.Tensor, v: torch.Tensor, old: torch.Tensor, new: torch.Tensor, side: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry Adam's moments from basis ``old`` into basis ``new`` (both ``(r, n)``, orthonormal rows).

    ``O = old new^T``; right side (moments ``(R, r)``): ``m O`` and ``v (O * O)``; left side (``(r, C)``):
    ``O^T m`` and ``(O * O)^T v``.
    """
    overlap = (old.to(m.dtype) @ new.to(m.dtype).T).to(m.dtype)
    squared = overlap * overlap
    if side == "right":
        return m @ overlap, v @ squared
    return overlap.T @ m, squared.T @ v


def channel_scaled_update(
    grad: torch.Tensor, low: torch.Tensor, direction: torch.Tensor, side: str, reduce: ScoreReduce | None = None
) -> torch.Tensor:
    """APOLLO's update: ``grad`` scaled per channel by ``||direction_i|| / ||low_i||``.

    Channels are the rows of ``grad`` for ``side="right"`` (``low``, ``direction``: ``(R, r)``) and its columns for
    ``"left"`` (``(r, C)``). A channel whose projected gradient is zero gets scale 0 (nothing to estimate from).

    Args:
        grad: The full ``(R, C)`` gradient.
        low: Its projection.
        direction: Adam's direction computed on ``low``.
        side: ``"right"`` or ``"left"``.
        reduce: Unused for the channel norms (a channel's entries live on one process for ``side="right"``); kept
            for a uniform signature.
    """
    dim = 1 if side == "right" else 0
    num = torch.linalg.vector_norm(direction, dim=dim)
    den = torch.linalg.vector_norm(low, dim=dim)
    scale = torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.zeros_like(num))
    return grad * (scale.unsqueeze(1) if side == "right" else scale.unsqueeze(0))


def limit_norm_growth(
    update: torch.Tensor, state: dict, gamma: float | None, reduce: ScoreReduce | None = None
) -> torch.Tensor:
    """APOLLO's norm-growth limiter: scale ``update`` so that its norm is at most ``gamma`` times the previous
    update's (kept in ``state["update_norm"]``); ``gamma=None`` turns it off."""
    if gamma is None:
        return update
    sq = update.float().square().sum().reshape(1)
    if reduce is not None:
        reduce(sq, "sum")
    norm = sq.sqrt()
    previous = state.get("update_norm")
    if previous is not None and float(previous) > 0 and float(norm) > gamma * float(previous):
        factor = gamma * previous.to(norm.device) / norm
        update = update * factor.to(update.dtype)
        norm = norm * factor
    state["update_norm"] = norm.reshape(())
    return update
