"""DCT-AdamW: AdamW whose moments live in a rank-r subspace picked from a fixed DCT basis, without any SVD.

Reference: Modoranu, Safaryan, Alistarh et al., "SVD-Free Low-Rank Adaptive Gradient Optimization" / "FFT-based
Dynamic Subspace Selection" (arXiv 2505.17967); formulas in docs/methods.md (DCT-AdamW). The DCT math is in
:mod:`peft_ext.optim.dct`, the basis object in :mod:`peft_ext.optim.bases` (:class:`~peft_ext.optim.bases.DCTBasis`),
and the optimizer is :class:`~peft_ext.optim.SubspaceAdamW` with the DCT basis refreshed every step: :class:`DCTAdamW`
only sets those defaults.

Against GaLore (the usual alternative), what changes for a user:

* No SVD: a subspace refresh is one DCT of the gradient (an FFT or a product with a matrix shared by every layer of
  that size) plus a top-k, so refreshing every step (the paper's default) is affordable.
* The per-layer projector is ``r`` integers instead of an ``r x n`` float matrix, and ``state_dict()`` holds only
  tensors and plain numbers, so it loads with ``torch.load(weights_only=True)`` and a resumed run is bit-identical to
  an uninterrupted one.
* Data parallel: the selection is a deterministic function of the (all-reduced) gradient, and with
  ``torch.distributed`` initialized the indices are also broadcast from rank 0, so every rank applies the same
  update.
* FSDP2 (``fully_shard``): each rank projects its own rows of a row-sharded matrix (the DCT runs along the columns)
  and only the ``C`` column scores are all-reduced, so no gradient is gathered and the moments stay sharded (about
  ``1 / world`` per rank). GaLore's SVD needs the whole matrix (docs/dct_adamw.md, "FSDP2").
"""

from __future__ import annotations

from typing import Any

from .subspace_adamw import Params, SubspaceAdamW
from .subspace_checks import matches_target

__all__ = ["DCTAdamW", "SubspaceAdamW", "matches_target"]


class DCTAdamW(SubspaceAdamW):
    """AdamW with low-rank moments in a dynamically selected DCT subspace (DCT-AdamW, arXiv 2505.17967).

    The paper's preset of :class:`~peft_ext.optim.SubspaceAdamW`: ``basis="dct"`` and ``update_proj_gap=1``;
    every other argument, its default and its meaning are :class:`~peft_ext.optim.SubspaceAdamW`'s (see there, and
    its notes on rank clamping, non-finite gradients, column bias correction and half precision).

    For a projected ``(R, C)`` matrix with ``R >= C`` (else mirrored, see :mod:`peft_ext.optim.dct`), every
    ``update_proj_gap`` steps the gradient's DCT-II ``S = G Q^T`` is computed and the ``r`` columns with the largest
    L1 norm become the subspace ``I``; each step then runs Adam on ``a = G Q[I]^T`` (``R x r``) and applies
    ``p <- p (1 - lr wd) - lr * scale * adam(a) Q[I]``. Only ``r`` indices are stored per layer; the ``n x n`` DCT
    matrix is built once per size and shared. Everything else (vectors, matrices with a dimension ``>= max_shape``
    such as embeddings and LM heads, matrices outside ``target_modules``) gets plain AdamW inside the same optimizer.

    When to use it: full fine-tuning or pre-training where Adam's moments dominate memory and GaLore's SVD refresh is
    too slow or its state cannot be checkpointed. When not to: tiny models (the projection saves nothing worth its
    approximation), LoRA-style adapters whose matrices already have a dimension of ``r`` (nothing to compress), or
    tensor-parallel / DeepSpeed ZeRO training (column shards and flat partitions are rejected with a ``ValueError``;
    DDP and FSDP2's row shards are supported, see docs/distributed.md).

    Args:
        params: Parameters or param groups, as for :class:`~peft_ext.optim.SubspaceAdamW`.
        lr: Learning rate.
        rank: Subspace dimension ``r`` per projected matrix.
        update_proj_gap: Refresh the selection every this many steps. The paper's default is 1 (a refresh costs one
            DCT); raise it only if the refresh shows up in profiles.
        betas: Adam's ``(beta1, beta2)``.
        eps: Adam's epsilon.
        weight_decay: Decoupled weight decay, applied to the full parameter as in AdamW.
        **kwargs: Every keyword option of :class:`~peft_ext.optim.SubspaceAdamW` (``scale``, ``target_modules``,
            ``rotate_moments``, ``moments_8bit``, ``side``, ``nonfinite``, ``update``, ...) and of the basis and
            update rule (``dct_method``, ``column_bias_correction``, ``error_feedback``, ...). ``basis`` is
            ``"dct"`` (the paper) unless given: ``"coordinates"`` or ``"power"`` turn this into the other presets.
    """

    def __init__(
        self, params: Params, lr: float = 1e-3, rank: int = 128, update_proj_gap: int = 1, *args: Any, **kwargs: Any
    ) -> None:
        # betas, eps and weight_decay follow positionally, as SubspaceAdamW takes them (and with its defaults); the
        # preset's basis is "dct" unless a keyword (or the deprecated `projection`) says otherwise
        if "basis" not in kwargs and "projection" not in kwargs:
            kwargs["basis"] = "dct"
        super().__init__(params, lr, rank, update_proj_gap, *args, **kwargs)
