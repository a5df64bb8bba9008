"""Configuration of SplitLoRA adapters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from peft.utils import PeftType

from ...fingerprint import added_later
from .._common import require_positive_int
from ..adapter_config import AdapterConfig

STATISTICS = ("auto", "dense", "sketch")
INIT_SCALINGS = ("inverse_task", "constant")


@dataclass
class SplitLoRAConfig(AdapterConfig):
    """Configuration of a SplitLoRA adapter (continual learning in the minor subspace; docs/methods.md (SplitLoRA)).

    A SplitLoRA layer computes ``y = W x + (dW_old + B A) x``: ``A`` (``r x in``) is frozen, ``B`` (``out x r``) is
    the only trainable part, and ``dW_old`` is the frozen sum of the finished tasks' ``B A``, kept as stacked low-rank
    factors (densified only when that is smaller). Between tasks, :meth:`SplitLoRAModel.end_task` picks, per module,
    the split ``k*`` of the running input covariance, folds ``B A`` into ``dW_old`` and draws the next task's ``A`` in
    the minor subspace. There is no ``alpha / r`` scaling, as in the authors' public code.

    The target-selection fields (``target_modules``, ``exclude_modules``, ``modules_to_save``,
    ``layers_to_transform``, ``layers_pattern``) are :class:`~peft_ext.tuners.AdapterConfig`'s.

    Args:
        r: Rank of each task's adapter (the paper uses 10).
        trade_off: The stability/plasticity coefficient ``a`` of ``f(j)`` (default 20, the paper's value). Larger
            values keep fewer primary directions (more plasticity).
        statistics: How the running input covariance is kept: ``"dense"`` (exact ``in x in`` sum), ``"sketch"`` (a
            frequent-directions sketch of ``sketch_rank`` rows, for wide layers) or ``"auto"`` (dense when
            ``in_features <= dense_max_features``, else sketch).
        sketch_rank: Rows ``l`` of the frequent-directions sketch. The primary subspace can have at most ``l``
            directions; ``end_task`` warns when the split wants more.
        dense_max_features: Widest input for which ``"auto"`` keeps a dense covariance (2048: 16 MB per module in
            float32).
        init_scaling: Frobenius norm of a new task's ``A``: ``"inverse_task"`` (``||A_kaiming|| / (t + 1)`` before task
            ``t``, docs/methods.md (SplitLoRA)) or ``"constant"`` (``||A_kaiming||``, as the authors' public code).
        seed: Seed of the frozen ``A`` draws; with the module name and task index it fixes every ``A``, so a sequence
            continued after ``from_pretrained`` or run under DDP draws the same matrices.
        init_weights: ``True`` (default) starts ``B`` at zero, so a new adapter leaves the model unchanged. ``False``
            starts ``B`` random (for tests that need a non-trivial adapter).
        shard_statistics: Under FSDP2 (``B`` a DTensor over a one-dimensional mesh of several processes), each
            process keeps only its share of the input features of the statistics, running and in progress (``True``,
            default: about ``1 / world`` of them per process; each batch's inputs are reduced as they arrive).
            ``False`` keeps them whole on every process and reduces the task's increment at ``end_task``, as under
            DDP. docs/distributed.md compares the two.
    """

    #: (tensor name, dimension, config field): that dimension of every saved tensor so named equals the config value
    #: (checked by :func:`peft_ext.verify_checkpoint` without building a model; the folded factors grow: not listed)
    saved_sizes: ClassVar[tuple[tuple[str, int, str], ...]] = (("splitlora_A", 0, "r"), ("splitlora_B", 1, "r"))

    r: int = field(default=10, metadata={"help": "Rank of each task's adapter (the paper uses 10)."})
    trade_off: float = field(
        default=20.0, metadata={"help": "Stability/plasticity coefficient `a` of the split objective f(j)."}
    )
    statistics: Literal["auto", "dense", "sketch"] = field(
        default="auto",
        metadata={"help": "How the input covariance is kept: 'dense', 'sketch' (frequent directions) or 'auto'."},
    )
    sketch_rank: int = field(default=256, metadata={"help": "Rows of the frequent-directions sketch."})
    dense_max_features: int = field(
        default=2048, metadata={"help": "Widest input for which statistics='auto' keeps a dense covariance."}
    )
    init_scaling: Literal["inverse_task", "constant"] = field(
        default="inverse_task",
        metadata={"help": "Norm of a new task's A: 'inverse_task' (||A_kaiming|| / (t + 1)) or 'constant'."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the frozen A draws."})
    init_weights: bool = field(default=True, metadata={"help": "Start B at zero (True) or random (False, for tests)."})
    shard_statistics: bool = added_later(
        True, metadata={"help": "Under FSDP2, keep each process's share of the input features' statistics."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        # Looked up on PeftType directly (not through a module global): register_peft_type instantiates this config
        # to check the round trip before the module-level assignment of its return value exists.
        self.peft_type = PeftType.SPLITLORA
        require_positive_int(self, "r")
        if isinstance(self.trade_off, bool) or not isinstance(self.trade_off, (int, float)):
            raise TypeError(f"`trade_off` must be a number, got {type(self.trade_off).__name__} {self.trade_off!r}")
        if not (math.isfinite(self.trade_off) and self.trade_off > 0):
            raise ValueError(f"`trade_off` must be a positive finite number, got {self.trade_off!r}")
        self.trade_off = float(self.trade_off)
        if self.statistics not in STATISTICS:
            raise ValueError(f"`statistics` must be one of {STATISTICS}, got {self.statistics!r}")
        require_positive_int(self, "sketch_rank", "dense_max_features")
        if self.init_scaling not in INIT_SCALINGS:
            raise ValueError(f"`init_scaling` must be one of {INIT_SCALINGS}, got {self.init_scaling!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"`seed` must be an integer, got {type(self.seed).__name__} {self.seed!r}")
        if not isinstance(self.shard_statistics, bool):
            raise TypeError(
                f"`shard_statistics` must be True or False, got {type(self.shard_statistics).__name__} "
                f"{self.shard_statistics!r}"
            )

    def statistics_for(self, in_features: int) -> Literal["dense", "sketch"]:
        """The statistics kind a layer with ``in_features`` inputs uses under this config."""
        if self.statistics == "dense":
            return "dense"
        if self.statistics == "sketch":
            return "sketch"
        # A sketch with at least as many rows as the layer has inputs is no smaller than the dense matrix.
        if in_features <= self.dense_max_features or self.sketch_rank >= in_features:
            return "dense"
        return "sketch"
