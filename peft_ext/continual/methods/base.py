"""The base of every continual-learning method: its options, its hooks, its capabilities, and the registry configs
name methods from.

A method turns a freshly built base model into the model it trains (``build``), may act before and after each task
(``before_task`` / ``after_task`` / ``between_tasks``: fold adapters, collect statistics, re-wrap), may add a
regularizer (``extra_loss``), and picks what is trained (``trainable_parameters``) and how (``make_optimizer``). Every
hook gets the run context. What a method keeps across tasks lives in ``self.state`` and travels through
``state_dict`` / ``load_state_dict``, so a resumed run restores it. Each method declares its options as a dataclass,
validated before any work starts, and its capabilities as class attributes that the job, the preflight, the tuning
and the report read instead of its name.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from peft import LoraConfig
from torch import nn

from ...fingerprint import added_later
from ...optim.choices import check_optimizer, optimizer_spec
from ..heads.base import HEADS, feature_heads, head_options
from ..state_codec import decode_state, encode_state
from ..task_kinds import task_kind

if TYPE_CHECKING:
    from ...data.tasks import Example, Task
    from ..context import RunContext


ADAPT_MODES = ("every_task", "first_task")


@dataclass
class MethodOptions:
    """Options every method has.

    Args:
        lr: Learning rate of the method's optimizer.
        weight_decay: Decoupled weight decay (AdamW).
        label: Name shown in tables and plots (default: the method name).
        head: How features become class scores (:mod:`peft_ext.continual.heads`): a head's name (``linear``,
            ``cosine``, ``prototype``, ``lda``, ``analytic``, ``aligned``) or a mapping with its ``name`` and options
            (``{name: analytic, dim: 4096}``); default: the method's own (``linear`` for the trained methods).
        compare_heads: Further heads fed and scored on the same run, side by side in the report (any head that does
            not change training: not ``cosine``); their accuracy matrices go to the result's ``extras["heads"]``.
        adapt: ``every_task`` (train on every task) or ``first_task`` (APER / RanPAC's first-session adaptation:
            train on the first task only, then freeze the model; later classes are learned by the head alone, so the
            head must be one that learns from features).
    """

    #: What the method hands the optimizer its ``optimizer`` field names (:data:`peft_ext.optim.choices.STEPS`), on
    #: methods whose options have that field: the field is checked against the registry and replaced by its
    #: effective settings (every option written out: what the run's fingerprint holds).
    optimizer_steps: ClassVar[tuple[str, ...]] = ()
    #: Old flat option names that became keys of the method's ``optimizer`` section (``rank`` -> ``rank``).
    legacy_optimizer_keys: ClassVar[dict[str, str]] = {}

    lr: float = 1e-3
    weight_decay: float = 0.0
    label: str | None = None
    head: str | dict[str, Any] | None = added_later(None)
    compare_heads: list[str | dict[str, Any]] = added_later(default_factory=list)
    adapt: str = added_later("every_task")

    @classmethod
    def nest_flat_keys(cls, data: dict[str, Any], where: str = "") -> dict[str, Any]:
        """Move old flat keys of ``data`` into the sections that now hold them (here: ``optimizer``), with a
        ``DeprecationWarning`` showing the new form.

        Args:
            data: Option values by name.
            where: Key prefix for the warning (``methods[2].``).
        """
        moved = {old: new for old, new in cls.legacy_optimizer_keys.items() if old in data}
        if not moved:
            return data
        data = dict(data)
        default = next(f.default for f in dataclasses.fields(cls) if f.name == "optimizer")
        name = data.get("optimizer", default)
        data["optimizer"] = {"name": name} if isinstance(name, str) else name
        return nest_into_section(data, moved, "optimizer", where)

    def validate(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"`lr` must be > 0, got {self.lr}")
        if self.optimizer_steps:
            self.optimizer = check_optimizer(self.optimizer, self.optimizer_steps)
        if self.weight_decay < 0:
            raise ValueError(f"`weight_decay` must be >= 0, got {self.weight_decay}")
        if self.adapt not in ADAPT_MODES:
            raise ValueError(f"`adapt` must be one of {list(ADAPT_MODES)}, got {self.adapt!r}")
        head = None if self.head is None else head_options(self.head)[0]
        if self.adapt == "first_task" and (head is None or not HEADS[head].reads_features):
            raise ValueError(
                f"`adapt: first_task` freezes the model after the first task, so later classes are learned by the "
                f"head alone: set `head` to one that learns from features ({', '.join(feature_heads())}), got "
                f"{head or 'linear'!r}"
            )
        names = []
        for spec in self.compare_heads:
            try:
                name = head_options(spec)[0]
            except ValueError as err:
                raise ValueError(str(err).replace("`head", "`compare_heads", 1)) from None
            if HEADS[name].shapes_training:
                raise ValueError(
                    f"`compare_heads` {name!r} changes what the model trains, so it cannot be scored on another "
                    f"head's run: give it its own method entry with `head: {name}`"
                )
            if not HEADS[name].reads_features and head is not None and HEADS[head].shapes_training:
                raise ValueError(
                    f"`compare_heads` {name!r} reads the model's own classifier, which the {head!r} head replaces"
                )
            names.append(name)
        if len(set(names)) != len(names):
            raise ValueError(f"`compare_heads` lists a head twice: {names}")


#: Fields every PEFT config has that describe the saved adapter, not the adapter itself; no method config sets them.
PEFT_BOOKKEEPING = ("peft_type", "task_type", "auto_mapping", "base_model_name_or_path", "revision", "inference_mode")


def nest_into_section(data: dict[str, Any], moved: dict[str, str], section: str, where: str = "") -> dict[str, Any]:
    """Move the old flat keys ``moved`` (old name -> name in the section) of ``data`` into its ``section`` mapping,
    warning with the new form (``DeprecationWarning``); returns the new mapping.

    Args:
        data: Option values by name.
        moved: Flat keys to move, with their names inside the section.
        section: The nested section, e.g. ``"adapter"``.
        where: Key prefix for the warning (``methods[2].``).
    """
    data = dict(data)
    nested = data.get(section) or {}
    if not isinstance(nested, dict):
        raise TypeError(f"pass the fields {sorted(moved)} inside `{section}`, not beside a config object")
    nested = dict(nested)
    for old, new in moved.items():
        nested[new] = data.pop(old)
    data[section] = nested
    shown = ", ".join(f"{key}: {value!r}" for key, value in nested.items())
    warnings.warn(
        f"`{where}{next(iter(moved))}` and the other {section} fields moved into the {section} section: write "
        f"`{section}: {{{shown}}}` (flat {section} keys will stop working)",
        DeprecationWarning,
        stacklevel=4,
    )
    return data


@dataclass
class AdapterOptions(MethodOptions):
    """Options of a method that trains one adapter type: the method's own settings, and ``adapter``, the adapter's
    own config (a YAML mapping under ``adapter:``, validated by the config class itself).

    Every adapter setting has one default, the config class's. Subclasses declare the field ``adapter`` with the
    config class as type and default factory, and set the class attributes below.
    """

    #: Adapter fields the method sets itself (e.g. ``modules_to_save``: the head); a config may not set them.
    method_owned: ClassVar[tuple[str, ...]] = ("modules_to_save",)
    #: Old flat option names that became adapter fields of another name (``alpha`` -> ``lora_alpha``).
    legacy_names: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        if isinstance(self.adapter, dict):
            self.adapter = self.adapter_cls()(**self.adapter)

    @classmethod
    def adapter_cls(cls) -> type:
        """The adapter's config class (the type of the ``adapter`` field)."""
        return next(f for f in dataclasses.fields(cls) if f.name == "adapter").default_factory  # type: ignore

    @classmethod
    def adapter_keys(cls) -> list[str]:
        """The adapter fields a config may set."""
        skip = {*PEFT_BOOKKEEPING, *cls.method_owned}
        return [f.name for f in dataclasses.fields(cls.adapter_cls()) if f.init and f.name not in skip]

    @classmethod
    def nest_flat_keys(cls, data: dict[str, Any], where: str = "") -> dict[str, Any]:
        """Move old flat adapter keys of ``data`` (e.g. ``pool_size``) into its ``adapter`` section, with a warning.

        Args:
            data: Option values by name.
            where: Key prefix for the warning (``methods[2].``).
        """
        data = super().nest_flat_keys(data, where)
        own = {f.name for f in dataclasses.fields(cls)}
        adapter_keys = set(cls.adapter_keys())
        moved = {k: cls.legacy_names.get(k, k) for k in data if k not in own}
        moved = {k: new for k, new in moved.items() if new in adapter_keys}
        if not moved:
            return data
        return nest_into_section(data, moved, "adapter", where)

    def adapter_config(self, **method_set: Any) -> Any:
        """A copy of ``adapter`` with the fields the method sets (``method_owned``) filled in."""
        unknown = set(method_set) - set(self.method_owned)
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not among the method-set adapter fields {self.method_owned}")
        return dataclasses.replace(self.adapter, **method_set) if method_set else copy.deepcopy(self.adapter)


@dataclass
class HeadRateOptions(AdapterOptions):
    """Options of an adapter method whose head (a ``modules_to_save`` copy) trains by AdamW at its own rate beside
    the adapter's optimizer, so that comparing optimizers isolates the adapters.

    Args:
        head_lr: AdamW learning rate of the head (default ``lr``).
    """

    head_lr: float | None = None

    @property
    def head_rate(self) -> float:
        """The head's learning rate: ``head_lr``, or ``lr`` when unset."""
        return self.lr if self.head_lr is None else self.head_lr

    def validate(self) -> None:
        super().validate()
        if self.head_lr is not None and not self.head_lr > 0:
            raise ValueError(f"`head_lr` must be > 0 (or unset), got {self.head_lr}")


@dataclass
class LoraOptions(AdapterOptions):
    """Options of the LoRA-based baselines.

    Args:
        adapter: PEFT's :class:`~peft.LoraConfig` (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ...);
            YAML ``adapter: {r: 8, lora_alpha: 16, target_modules: [query, value]}``. The method sets
            ``modules_to_save`` (the head).
    """

    legacy_names: ClassVar[dict[str, str]] = {"alpha": "lora_alpha", "dropout": "lora_dropout"}

    adapter: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> None:
        super().validate()
        # PEFT's LoraConfig accepts these and fails only when the model is wrapped; a run config should fail first.
        adapter = self.adapter
        if isinstance(adapter.r, bool) or not isinstance(adapter.r, int) or adapter.r < 1:
            raise ValueError(f"`adapter.r` must be a positive integer, got {adapter.r!r}")
        if not 0 <= adapter.lora_dropout < 1:
            raise ValueError(f"`adapter.lora_dropout` must be in [0, 1), got {adapter.lora_dropout!r}")
        if adapter.target_modules is not None and not adapter.target_modules:
            raise ValueError("`adapter.target_modules` must name at least one module (or be unset), got none")


class ContinualMethod:
    """Base class of a continual-learning method.

    Subclasses set ``name`` and ``options_cls``, declare their capabilities below, and override the hooks they need.
    Register them with :func:`register_continual_method` so configs can name them. Every hook gets the run context
    (:class:`~peft_ext.continual.RunContext`); what the method keeps across tasks goes in :attr:`state`, which
    :meth:`state_dict` / :meth:`load_state_dict` save and restore (snapshots, resumed runs).
    """

    name: ClassVar[str] = ""
    options_cls: ClassVar[type[MethodOptions]] = MethodOptions

    # Capabilities: what the job, the preflight, the tuning and the report read instead of the method's name.
    #: The sequence kinds (``TaskSequence.kind``) the method runs; the engine refuses others.
    task_kinds: ClassVar[tuple[str, ...]] = ("classification",)
    #: Trains once on the union of all tasks instead of task after task (one phase, evaluated as the last row).
    trains_on_union: ClassVar[bool] = False
    #: An upper bound the continual methods are measured against (joint training): the report gives each method's
    #: gap to it and leaves it out of who won.
    is_upper_bound: ClassVar[bool] = False
    #: Learns the tasks in sequence with an adapter or the backbone (``False`` for the references a continual method
    #: must beat: a frozen backbone with a trained or training-free head, and joint training).
    is_continual_adapter: ClassVar[bool] = True
    #: Its adapter rank ``r`` is drawn from an input-width covariance, so it cannot exceed a layer's input width.
    rank_bounded_by_input_width: ClassVar[bool] = False
    #: Trains on the tasks (``False``: a training-free method; only its head learns, from features; no lr to tune).
    trains: ClassVar[bool] = True
    #: ``before_task`` / ``between_tasks`` return a new model around new modules (merge, then a new adapter): such a
    #: method trains with whole parameters under ``train.sharding: fsdp2`` (:mod:`..sharding`).
    rewraps_model: ClassVar[bool] = False
    #: The head used when the options name none.
    default_head: ClassVar[str] = "linear"
    #: The name under which the report compares every method with this one (``"SimpleCIL"`` for ``ncm``: a "vs
    #: SimpleCIL" column of final-accuracy differences); ``None``: not a reference.
    reference_name: ClassVar[str | None] = None
    #: How published sentences name the method in words (``"RanPAC"`` for ``ranpac``); ``None``: its
    #: ``reference_name``, else its registered name.
    known_as: ClassVar[str | None] = None

    def __init__(self, options: MethodOptions | None = None, **kwargs: Any) -> None:
        if options is None:
            kwargs = self.options_cls.nest_flat_keys(kwargs)
            options = self.options_cls(**kwargs)
        elif kwargs:
            raise TypeError("pass either an options object or keyword options, not both")
        options.validate()
        self.options = options
        head = head_options(self.head)[0]
        supported = self.supported_heads()
        if head not in supported:
            raise ValueError(
                f"method {self.name!r} cannot score with the {head!r} head: {self.unsupported_head_reason()}; "
                f"use one of {list(supported)}"
            )
        #: What the method keeps across tasks (tensors, lists, numbers, generators), saved with every snapshot.
        self.state: dict[str, Any] = {}

    @classmethod
    def supported_heads(cls) -> tuple[str, ...]:
        """The heads (``head`` option) the method can score with (default: every registered head)."""
        return tuple(HEADS)

    @classmethod
    def unsupported_head_reason(cls) -> str:
        """Why a head outside :meth:`supported_heads` is refused (for the error message)."""
        return "it does not support it"

    @property
    def label(self) -> str:
        return self.options.label or self.name

    @property
    def head(self) -> str | dict[str, Any]:
        """The ``head`` option the method runs with (its :attr:`default_head` when the options name none)."""
        return self.options.head if self.options.head is not None else self.default_head

    def needs_validation(self) -> str | None:
        """What makes this method choose on a validation split (one of its heads and the option), or ``None``."""
        for spec in (self.head, *self.options.compare_heads):
            name, options = head_options(spec)
            needs = HEADS[name](options).needs_validation()
            if needs:
                return f"its {name!r} head's `{needs}`"
        return None

    def trains_task(self, task_id: int) -> bool:
        """Whether the method trains on phase ``task_id`` (not: a training-free method, or ``adapt: first_task``
        after the first task)."""
        return self.trains and (self.options.adapt == "every_task" or task_id == 0)

    @property
    def needs_whole_parameters(self) -> str | None:
        """Why the method cannot train on FSDP2 shards (``train.sharding: fsdp2``), or ``None`` when it can; such a
        method trains data-parallel with whole parameters on every process."""
        if self.rewraps_model:
            return "it re-wraps its model every task"
        optimizer = getattr(self.options, "optimizer", None)
        return None if optimizer is None else optimizer_spec(optimizer)[0].whole_parameters

    def state_dict(self) -> dict[str, Any]:
        """:attr:`state` as data ``torch.load(weights_only=True)`` reads back (generators as their state tensor)."""
        return encode_state(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``{}``: a fresh run, nothing kept yet)."""
        self.state = decode_state(state)

    def build(self, base_model: nn.Module, ctx: RunContext) -> nn.Module:
        """Return the model to train; ``base_model`` is a fresh copy that the method may modify."""
        return base_model

    def before_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        """Called before training task ``task_id``; may return a different (re-wrapped) model."""
        return model

    def after_task(self, model: nn.Module, task_id: int, task: Task, ctx: RunContext) -> nn.Module:
        """Called after training task ``task_id`` and before its evaluation; may return a different model."""
        return model

    def between_tasks(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        """Called after a task's evaluation when another task follows; returns the model the next ``before_task``
        gets. End-of-task snapshots are taken of it, so it must have the structure :meth:`build` makes (a method
        that re-wraps the model per task folds its adapter here instead of in ``before_task``)."""
        return model

    def training_examples(self, task_id: int, task: Task, ctx: RunContext) -> list[Example]:
        """What task ``task_id`` trains on (default: ``task.train`` itself; replay adds remembered examples of earlier
        tasks). Called after :meth:`before_task`."""
        return task.train

    def trainable_parameters(self, model: nn.Module, ctx: RunContext) -> list[nn.Parameter]:
        """The parameters one task trains (default: every parameter that requires a gradient)."""
        return [p for p in model.parameters() if p.requires_grad]

    def make_optimizer(self, model: nn.Module, params: list[nn.Parameter], ctx: RunContext) -> torch.optim.Optimizer:
        """The optimizer for one task (a fresh one per task); ``params`` are :meth:`trainable_parameters`."""
        return torch.optim.AdamW(params, lr=self.options.lr, weight_decay=self.options.weight_decay)

    def extra_loss(
        self, model: nn.Module, batch: dict[str, Any], task_id: int, ctx: RunContext
    ) -> torch.Tensor | None:
        """An optional regularizer added to the task loss (e.g. O-LoRA's orthogonality loss)."""
        return None

    def report(self, ctx: RunContext) -> dict[str, Any]:
        """Method-specific, JSON-serializable figures of the run for its result (``MethodResult.extras``)."""
        return {}


CONTINUAL_METHODS: dict[str, type[ContinualMethod]] = {}


def register_continual_method(cls: type[ContinualMethod]) -> type[ContinualMethod]:
    """Class decorator: make ``cls`` available to configs under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} must set a non-empty `name`")
    existing = CONTINUAL_METHODS.get(cls.name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"a continual method named {cls.name!r} is already registered ({existing.__qualname__})")
    CONTINUAL_METHODS[cls.name] = cls
    return cls


def get_continual_method(name: str) -> type[ContinualMethod]:
    """The method class registered as ``name``: shipped, registered in this process, or declared by an installed
    package's ``peft_ext.continual_methods`` entry point (loaded on a miss too, for one installed since).

    Raises:
        ValueError: No such method, with the nearest registered name and the list.
    """
    if name not in CONTINUAL_METHODS:
        from ...plugins import ENTRY_POINT_GROUPS, load_entry_points

        load_entry_points(ENTRY_POINT_GROUPS["continual_methods"])
    try:
        return CONTINUAL_METHODS[name]
    except KeyError:
        import difflib

        near = difflib.get_close_matches(str(name), CONTINUAL_METHODS, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ValueError(
            f"unknown continual method {name!r}; {hint}registered methods: {sorted(CONTINUAL_METHODS)}"
        ) from None


def method_capability(name: str, attribute: str, default: Any = False) -> Any:
    """The capability ``attribute`` of the method registered as ``name`` (results files name their method), or
    ``default`` for a name no method registers here (a result of a method defined elsewhere).

    Args:
        name: The method's registered name (``MethodResult.method``).
        attribute: A capability of :class:`ContinualMethod` (``is_upper_bound``, ``is_continual_adapter``, ...).
        default: What an unregistered name gets.
    """
    if not hasattr(ContinualMethod, attribute):
        raise AttributeError(f"{attribute!r} is not a capability of ContinualMethod")
    cls = CONTINUAL_METHODS.get(name)
    return getattr(cls, attribute) if cls is not None else default


def head_module_name(model: nn.Module) -> str:
    """Name of the classification head the runner's models expose (``classifier``)."""
    if not isinstance(getattr(model, "classifier", None), nn.Module):
        raise TypeError(f"{type(model).__name__} has no `classifier` module; continual baselines need one")
    return "classifier"


def saved_head(base_model: nn.Module, ctx: RunContext | None) -> list[str] | None:
    """The ``modules_to_save`` of a method's adapter: the classification head (:func:`head_module_name`), or ``None``
    for a generation sequence, whose model keeps its pretrained LM head frozen.

    Args:
        base_model: The model the adapter wraps.
        ctx: The run context (``None``: a classification run).
    """
    if ctx is not None and not task_kind(ctx.sequence).trains_output_head:
        return None
    return [head_module_name(base_model)]
