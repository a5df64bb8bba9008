"""Configuration of PCLR: a capped LoRA rank pool with keyed per-sample routing (docs/methods.md (PCLR))."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from peft.utils import PeftType

from ..adapter_config import AdapterConfig

COMPRESS_RULES = ("index", "importance", "contribution", "contribution_max")
#: The rules that measure the ranks on the task's data (``end_task`` needs ``batches``), each with how
#: :func:`~.scoring.contribution_scores` combines a rank's share over the stored tasks (``aggregate``).
MEASURED_RULES = {"contribution": "sum", "contribution_max": "max"}

#: How ``end_task`` routes the distillation data (see :mod:`peft_ext.tuners.pclr.distill`).
INTEGRATE_ROUTING = ("input", "tasks")

#: ``PCLRConfig.ranks_schedule`` when it is not set (paper: 64 new ranks per task, later 32).
_DEFAULT_RANKS_SCHEDULE = [64, 64, 64, 64, 64, 32]
#: ``PCLRConfig.top_k`` when it is not set (public code).
_DEFAULT_TOP_K = 64

__all__ = ["COMPRESS_RULES", "INTEGRATE_ROUTING", "PCLRConfig", "PCLRCycleConfig"]


@dataclass
class PCLRConfig(AdapterConfig):
    """Config of a PCLR adapter: a pool of rank-1 components per target linear, routed per sample by keys.

    Every target linear ``W`` gets ``y = W x + (alpha / top_k) * sum_{i in S(x)} (a_i . x) b_i + shared(x)``, where
    ``S(x)`` are the ``top_k`` ranks whose keys best match the sample's query (cosine) among the ranks the sample may
    use. All linears of one layer group (one transformer block, found with ``group_pattern``) share one key set and
    one selection. The pool holds frozen *static* ranks (earlier tasks) and trainable *new* ranks (the current task);
    static plus new never exceed ``pool_size``. A freshly created adapter is learning task 0 with
    ``ranks_schedule[0]`` new ranks. The task cycle (``PCLRModel.begin_task`` / ``end_task``, docs/task_cycle.md)
    moves ranks from new to static, compresses and integrates.

    The target-selection fields (``target_modules``, ``exclude_modules``, ``modules_to_save``,
    ``layers_to_transform``, ``layers_pattern``) are :class:`~peft_ext.tuners.AdapterConfig`'s.

    Args:
        pool_size: Cap on the number of ranks (static + new) per linear (public code: 256).
        ranks_schedule: New ranks per task ``t`` (entry ``t``; the last entry repeats). Paper: 64, later 32. Task 0
            may fill the pool (entry 0 <= ``pool_size``); later tasks must leave room for at least one earlier rank
            (the other entries, and the last one, < ``pool_size``).
        compress_schedule: Fraction of the pool dropped after task ``t`` (entry ``t``; the last entry repeats).
            Paper (8 tasks): nothing for the first tasks, then 25 %, then 12.5 %.
        compress_rule: ``"index"`` (public code: drop every s-th rank), ``"importance"`` (drop the ranks with the
            smallest ``||a_i|| ||b_i||`` summed over the group's linears) or ``"contribution"`` (drop the ranks with
            the smallest measured contribution ``E[gate_i |a_i . x|] ||b_i||`` on the task's data routed as each
            stored task, every task weighted equally; the default: it kept the most accuracy and forgot least in
            benchmarks/continual_wordnet.py, see docs/pclr.md), or ``"contribution_max"`` (the same measurement, a
            rank scored by its largest share of any one task instead of the sum over tasks, so the ranks one task
            relies on are kept even when older ranks serve several tasks). Both need the task's data: pass
            ``batches`` to ``end_task``.
        top_k: Ranks selected per sample (public code: 64); at most ``pool_size``.
        alpha: Output scale numerator; the pool's output is scaled by ``alpha / top_k``.
        shared_r: Rank of the always-on shared dense LoRA (0 disables it; public code: 32).
        shared_alpha: Scale numerator of the shared LoRA (scale ``shared_alpha / shared_r``).
        query_dim: Width of the routing query; default: the model's input-embedding width.
        group_pattern: Regex whose first group names a module's layer group; modules that do not match form a group
            of their own.
        query_loss_weight: Weight of the query-key loss ``1 - cos(q, k)`` over the selected keys (code: 0.2).
        prototype_routing: At inference, the nearest stored task prototype ``t*`` restricts a sample to ranks of
            tasks ``<= t*`` (plus ranks of the task still being learnt).
        init_from_static: Initialize new ranks' ``a_i`` from the static ranks whose keys best match the new task.
        init_weights: ``True``: ``b_i = 0`` and shared ``B = 0`` (the adapter starts as the identity). ``False``:
            random ``b_i`` too (tests of merge and switching).
        max_tasks: Capacity of the stored task prototypes.
    """

    #: (tensor name, dimension, config field): that dimension of every saved tensor so named equals the config value
    #: (checked by :func:`peft_ext.verify_checkpoint` without building a model; the trainable ranks grow: not listed)
    saved_sizes: ClassVar[tuple[tuple[str, int, str], ...]] = (
        ("pclr_A_static", 0, "pool_size"),
        ("pclr_B_static", 0, "pool_size"),
        ("pclr_keys_static", 0, "pool_size"),
        ("pclr_shared_A", 0, "shared_r"),
        ("pclr_shared_B", 1, "shared_r"),
    )

    pool_size: int = field(default=256, metadata={"help": "Cap on ranks (static + new) per linear."})
    ranks_schedule: list[int] = field(
        default_factory=lambda: list(_DEFAULT_RANKS_SCHEDULE), metadata={"help": "New ranks per task; last repeats."}
    )
    compress_schedule: list[float] = field(
        default_factory=lambda: [0.0, 0.0, 0.0, 0.25, 0.125],
        metadata={"help": "Fraction of the pool dropped after each task; last repeats."},
    )
    compress_rule: str = field(
        default="contribution", metadata={"help": "'index', 'importance', 'contribution' or 'contribution_max'."}
    )
    top_k: int = field(default=_DEFAULT_TOP_K, metadata={"help": "Ranks selected per sample."})
    alpha: float = field(default=64.0, metadata={"help": "Pool output scale numerator (scale alpha / top_k)."})
    shared_r: int = field(default=0, metadata={"help": "Rank of the always-on shared LoRA (0: none)."})
    shared_alpha: float = field(default=16.0, metadata={"help": "Shared LoRA scale numerator."})
    query_dim: Optional[int] = field(default=None, metadata={"help": "Query width; default input-embedding width."})
    group_pattern: str = field(
        default=r"^(.*?\.(?:layer|layers|h|blocks|block)\.\d+)\.",
        metadata={"help": "Regex whose group 1 is a module's layer group."},
    )
    query_loss_weight: float = field(default=0.2, metadata={"help": "Weight of the 1 - cos(q, k) key loss."})
    prototype_routing: bool = field(default=True, metadata={"help": "Restrict ranks by nearest task prototype."})
    init_from_static: bool = field(default=True, metadata={"help": "Init new a_i from best-matching static ranks."})
    init_weights: bool = field(default=True, metadata={"help": "True: identity at init; False: random b_i."})
    max_tasks: int = field(default=64, metadata={"help": "Capacity of stored task prototypes."})

    def __post_init__(self) -> None:
        super().__post_init__()
        # Looked up on the enum: register_peft_type instantiates this class before its return value exists.
        self.peft_type = PeftType.PCLR
        for name in ("pool_size", "top_k", "max_tasks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if isinstance(self.shared_r, bool) or not isinstance(self.shared_r, int) or self.shared_r < 0:
            raise ValueError(f"`shared_r` must be a non-negative integer (0 disables it), got {self.shared_r!r}")
        self.ranks_schedule = list(self.ranks_schedule)
        self.compress_schedule = list(self.compress_schedule)
        self._check_pool_fits()
        if not self.compress_schedule or any(
            not isinstance(c, (int, float)) or not 0 <= c < 1 for c in self.compress_schedule
        ):
            raise ValueError(
                f"`compress_schedule` must be a non-empty list of fractions in [0, 1), got {self.compress_schedule!r}"
            )
        if self.compress_rule not in COMPRESS_RULES:
            raise ValueError(f"`compress_rule` must be one of {COMPRESS_RULES}, got {self.compress_rule!r}")
        for name in ("alpha", "shared_alpha", "query_loss_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}")
        if self.query_dim is not None and (not isinstance(self.query_dim, int) or self.query_dim < 1):
            raise ValueError(f"`query_dim` must be a positive integer or None, got {self.query_dim!r}")
        for name in ("prototype_routing", "init_from_static", "init_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}")

    def _check_pool_fits(self) -> None:
        """Refuse a ``pool_size`` / ``top_k`` / ``ranks_schedule`` combination the task cycle cannot run.

        Static plus new ranks never exceed ``pool_size``, and ``end_task`` compresses the pool so the next task's
        new ranks fit. Task 0 may fill the pool; every later task must leave room for at least one rank of the
        earlier tasks, or ``end_task`` would have to drop them all (and route over an empty pool).
        """
        if self.top_k > self.pool_size:
            top_k = f"`top_k`={self.top_k}"
            if self.top_k == _DEFAULT_TOP_K:
                top_k = f"the default {top_k} (used when top_k is not set)"
            raise ValueError(
                f"{top_k} exceeds `pool_size`={self.pool_size}: a sample selects its top_k ranks from a "
                f"pool of at most pool_size ranks; set top_k <= {self.pool_size} or pool_size >= {self.top_k}"
            )
        schedule = self.ranks_schedule
        # The user may not have written ranks_schedule at all: say it is the default and that they can set it.
        which = "`ranks_schedule`"
        if schedule == _DEFAULT_RANKS_SCHEDULE:
            which = f"the default `ranks_schedule` ({_DEFAULT_RANKS_SCHEDULE}, used when not set)"
        if not schedule or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in schedule):
            raise ValueError(f"`ranks_schedule` must be a non-empty list of positive integers, got {schedule!r}")
        fit = f"set `ranks_schedule`, e.g. ranks_schedule=[{max(1, self.pool_size // 2)}]"
        for task, ranks in enumerate(schedule):
            if ranks > self.pool_size:
                raise ValueError(
                    f"{which} gives task {task} {ranks} new ranks, more than `pool_size`={self.pool_size} can hold "
                    f"(static + new ranks never exceed pool_size); {fit} or raise pool_size to >= {max(schedule)}"
                )
        # the last entry repeats, so it applies to a later task even when it is the only one
        for task, ranks in enumerate(schedule[1:] or schedule, start=1):
            if ranks >= self.pool_size:
                raise ValueError(
                    f"{which} gives task {task} {ranks} new ranks, which fill `pool_size`={self.pool_size}: every "
                    "rank of the earlier tasks would be dropped to make room (entries after the first, and the last, "
                    f"which repeats, must be < pool_size); {fit} or raise pool_size to >= {ranks + 1}"
                )

    @property
    def new_capacity(self) -> int:
        """Room for trainable ranks: the largest entry of ``ranks_schedule``."""
        return max(self.ranks_schedule)

    @property
    def scale(self) -> float:
        """The pool's output scale ``alpha / top_k`` (docs/methods.md (PCLR))."""
        return self.alpha / self.top_k

    def ranks_for_task(self, task_id: int) -> int:
        """New ranks of task ``task_id`` (the schedule's last entry repeats)."""
        return self.ranks_schedule[min(task_id, len(self.ranks_schedule) - 1)]

    def compress_ratio_after(self, task_id: int) -> float:
        """Fraction of the pool dropped after task ``task_id`` (the schedule's last entry repeats)."""
        return float(self.compress_schedule[min(task_id, len(self.compress_schedule) - 1)])


@dataclass
class PCLRCycleConfig:
    """Settings of PCLR's task cycle (``PCLRModel.begin_task`` / ``end_task``), apart from the adapter's own config.

    The adapter's :class:`PCLRConfig` says what the pool is (its cap, schedules, compression rule); these say how one
    run drives it: how the new keys start and how the compressed pool is distilled and its keys pulled.

    Args:
        key_noise: Relative noise added to the task's (unit) prototype for each new key, so new ranks are not
            tied: a Gaussian vector of expected norm ``key_noise`` (cosine to the prototype about
            ``1 / sqrt(1 + key_noise^2)``).
        integrate_epochs: Distillation passes over the task's data after compression (0: no integration).
        integrate_lr: Distillation (AdamW) learning rate.
        integrate_routing: ``"input"`` (each sample routed by its own query) or ``"tasks"`` (public code: each batch
            routed as a stored task drawn by ``sqrt`` of its last distillation loss).
        temperature: Distillation temperature.
        top_logits: Distill only the teacher's top logits (docs/methods.md (PCLR)); ``None``: all.
        key_pull_threshold: Cosine above which a static key counts as close to a task prototype.
        key_pull_strength: How far keys close to several prototypes move toward them, in [0, 1].
        measure_integration: Also measure the distillation loss over the task's data right before and after the
            distillation (``IntegrateResult.kl_before`` / ``kl_after``): two extra evaluation passes (and, with
            ``"tasks"`` routing, teacher outputs for them). Off: both are ``None``.
    """

    key_noise: float = 0.05
    integrate_epochs: int = 1
    integrate_lr: float = 1e-3
    integrate_routing: str = "input"
    temperature: float = 2.0
    top_logits: Optional[int] = None
    key_pull_threshold: float = 0.8
    key_pull_strength: float = 0.5
    measure_integration: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.measure_integration, bool):
            raise ValueError(f"`measure_integration` must be True or False, got {self.measure_integration!r}")
        if not self.key_noise >= 0:
            raise ValueError(f"`key_noise` must be >= 0, got {self.key_noise!r}")
        if isinstance(self.integrate_epochs, bool) or not isinstance(self.integrate_epochs, int):
            raise ValueError(f"`integrate_epochs` must be an integer >= 0, got {self.integrate_epochs!r}")
        if self.integrate_epochs < 0:
            raise ValueError(f"`integrate_epochs` must be >= 0, got {self.integrate_epochs}")
        if not self.integrate_lr > 0:
            raise ValueError(f"`integrate_lr` must be > 0, got {self.integrate_lr!r}")
        if self.integrate_routing not in INTEGRATE_ROUTING:
            raise ValueError(f"`integrate_routing` must be one of {INTEGRATE_ROUTING}, got {self.integrate_routing!r}")
        if not self.temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {self.temperature!r}")
        if self.top_logits is not None and (not isinstance(self.top_logits, int) or self.top_logits < 1):
            raise ValueError(f"`top_logits` must be a positive integer or None, got {self.top_logits!r}")
        if not 0 <= self.key_pull_strength <= 1:
            raise ValueError(f"`key_pull_strength` must be in [0, 1], got {self.key_pull_strength!r}")
