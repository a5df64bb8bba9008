"""The run configuration (a YAML file) and its validation.

Every key is checked before any work starts: unknown keys, wrong types, missing files and impossible values raise
one :class:`ConfigError` that names the key (``train.epochs``) and says what would be valid.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..data import DATASETS, SHIPPED, SHIPPED_INSTRUCTIONS, check_dataset, sequence_kind
from ..data.tasks import PROTOCOLS
from ..fingerprint import FINGERPRINT, added_later, not_a_setting
from ..models.kinds import MODEL_KINDS, model_kind
from .config_schema import (  # noqa: F401 (re-exported: the config's error and builders)
    ConfigError,
    build_adapter_section,
    build_nested_section,
    build_section,
    check_local_model_path,
    unknown_key,
    unknown_value,
)
from .context import TrainConfig
from .methods import MethodOptions, get_continual_method


@dataclass
class ModelSection:
    """The backbone.

    Args:
        backbone: ``"minilm"`` (offline, packaged), a hub id, or a local model directory.
        max_length: Truncation length in tokens (``causal_lm``: of prompt, separator, answer and end of sequence).
        dropout: Dropout before the classification head.
        kind: ``classifier`` (an encoder with a linear head, for classification data) or ``causal_lm`` (a causal LM
            trained on instruction tasks, ``data.dataset: instruct`` or ``instructions``).
        dtype: ``causal_lm``: the weights' dtype (``float32``, ``bfloat16`` or ``float16``).
        load_in_4bit: ``causal_lm``: an NF4 base through bitsandbytes (compute in ``dtype``); adapters stay float32.
        separator: ``causal_lm``: the token that ends every prompt (default: the tokenizer's separator token); it
            must be a single token of the vocabulary that appears in no prompt.
        max_new_tokens: ``causal_lm``: tokens greedy generation may produce per answer when scored (default: the
            longest reference answer of the batch plus its end of sequence).
        chat_template: ``causal_lm``: render each prompt as a chat's user turn with the tokenizer's chat template and
            train the answer as the assistant's reply (what a chat model was tuned on); the separator is then the
            token that opens the assistant's turn unless ``separator`` names one.
        system_prompt: ``causal_lm`` with ``chat_template``: the system message before every prompt (default: the
            template's own, if any).
    """

    backbone: str = "minilm"
    max_length: int = 32
    dropout: float = 0.1
    kind: Literal["classifier", "causal_lm"] = "classifier"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    load_in_4bit: bool = False
    separator: str | None = None
    max_new_tokens: int | None = None
    chat_template: bool = added_later(False)
    system_prompt: str | None = added_later(None)

    def validate(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"`max_length` must be >= 2, got {self.max_length}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be a positive integer, got {self.max_new_tokens}")
        model_kind(self.kind).check_options(self)  # the options of another kind are refused
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("`system_prompt` is a message of the chat template: set `chat_template: true` with it")
        check_local_model_path("backbone", self.backbone)

    def causal_collate(self, tokenizer: Any) -> Any:
        """The :class:`~peft_ext.data.collate.CausalLMCollator` this ``causal_lm`` section describes."""
        return causal_collate(tokenizer, self)


def separator_id(tokenizer: Any, token: str | None) -> int:
    """The id of the token that ends every prompt of an instruction sequence: ``token`` (``model.separator``), else
    the tokenizer's separator token.

    Raises:
        ValueError: ``token`` is not one token of the vocabulary, or neither is set.
    """
    if token is None:
        if getattr(tokenizer, "sep_token_id", None) is None:
            raise ValueError(
                f"the tokenizer ({type(tokenizer).__name__}) has no separator token to end prompts with: set "
                "`model.separator` to a special token of its vocabulary that no prompt contains (e.g. an unused "
                "reserved token)"
            )
        return int(tokenizer.sep_token_id)
    ids = tokenizer.convert_tokens_to_ids([token])
    unk = getattr(tokenizer, "unk_token_id", None)
    if not ids or ids[0] is None or (unk is not None and ids[0] == unk and token != tokenizer.unk_token):
        raise ValueError(f"`model.separator` {token!r} is not a token of the tokenizer's vocabulary")
    return int(ids[0])


def causal_collate(tokenizer: Any, model: Any) -> Any:
    """The :class:`~peft_ext.data.collate.CausalLMCollator` a ``causal_lm`` job's ``model`` section describes (its
    separator, lengths and chat rendering)."""
    from ..data.collate import CausalLMCollator

    # a chat-rendered prompt's separator is the template's own unless the config names one
    separator = None if model.chat_template and model.separator is None else separator_id(tokenizer, model.separator)
    return CausalLMCollator(
        tokenizer,
        model.max_length,
        separator,
        model.max_new_tokens,
        chat_template=model.chat_template,
        system_prompt=model.system_prompt,
    )


@dataclass
class DataSection:
    """The task sequence.

    Args:
        dataset: ``wordnet`` (WordNet 3.0 gloss -> supersense, shipped), ``fortunes`` (Debian fortune -> topic file,
            shipped: docs/own_data.md), ``instruct`` (instruction tasks built from both, shipped, for a
            ``causal_lm``: docs/continual_instruct.md), ``files`` (your own classification data, read by Hugging Face
            ``datasets``: docs/own_data.md) or ``instructions`` (instruction tasks in TRL's formats for a
            ``causal_lm``: docs/continual_instruct.md).
        n_tasks: Number of tasks (``files``: default all classes in tasks of ``classes_per_task``, or one per
            ``task_column`` value).
        classes_per_task: Classes each task introduces.
        train_per_class: Training examples per class (cap; ``wordnet`` default 80, ``fortunes`` 60, ``files`` default
            all).
        test_per_class: Test examples per class (cap; ``wordnet`` default 40, ``fortunes`` 30, ``files`` default
            all).
        val_per_class: ``wordnet`` / ``fortunes``: validation examples per class, carved from the shipped training
            split (for ``tune``; ``files`` use ``validation`` / ``validation_share``).
        protocol: ``class-incremental`` or ``task-incremental``.
        seed: Seed that picks and orders the classes (and, for ``files``, carves the splits).
        classes: Explicit class names in task order (overrides the seed's choice).
        train: ``files``: the training data (a CSV / JSON / JSONL / Parquet file or a list of them, a
            ``save_to_disk`` folder, or a hub id); relative paths are read from the config file's folder.
        test: ``files``: the test data; unset: carved from ``train`` by a seeded hash (``test_share``).
        validation: ``files``: held-out data for tuning; unset: carved when ``validation_share`` > 0.
        text_column: ``files``: the text column, or a list of columns joined by a space.
        label_column: ``files``: the label column.
        task_column: ``files``: a column naming each row's task (one task per value, each with its own classes).
        test_share: ``files``: share of ``train`` carved off as test when ``test`` is unset.
        validation_share: ``files``: share of ``train`` carved off as validation when ``validation`` is unset.
        tasks: ``instructions``: one file (or folder, hub id) per task, in order; relative paths are read from the
            config file's folder. ``instruct``: the instruction task families in task order (default all:
            ``supersense``, ``gloss_to_word``, ``part_of_speech``, ``fortune_topic``, ``define``,
            ``example_to_word``).
        train_per_task: ``instruct``: training examples per task (default 64).
        test_per_task: ``instruct``: test examples per task (default 32).
        val_per_task: ``instruct``: validation examples per task, from the train split (default 16; 0: none).
    """

    dataset: str = "wordnet"
    n_tasks: int | None = None
    classes_per_task: int | None = None
    train_per_class: int | None = None
    test_per_class: int | None = None
    val_per_class: int | None = added_later(None)
    protocol: str = "class-incremental"
    seed: int = 0
    classes: list[str] | None = None
    train: str | list[str] | None = None
    test: str | list[str] | None = None
    validation: str | list[str] | None = None
    text_column: str | list[str] = "text"
    label_column: str = "label"
    task_column: str | None = None
    test_share: float = 0.2
    validation_share: float = 0.0
    tasks: list[str] | None = None
    train_per_task: int | None = added_later(None)
    test_per_task: int | None = added_later(None)
    val_per_task: int | None = added_later(None)

    #: The keys of the shipped instruction tasks (``instruct``), unset for every other data set.
    PER_TASK: typing.ClassVar[tuple[str, ...]] = ("train_per_task", "test_per_task", "val_per_task")
    #: The keys of the classification data sets, which the shipped instruction tasks do not take.
    PER_CLASS: typing.ClassVar[tuple[str, ...]] = (
        "n_tasks",
        "classes_per_task",
        "train_per_class",
        "test_per_class",
        "val_per_class",
        "classes",
    )
    FILES_ONLY: typing.ClassVar[tuple[str, ...]] = (
        "train",
        "test",
        "validation",
        "text_column",
        "label_column",
        "task_column",
        "test_share",
        "validation_share",
        "tasks",
    )

    def validate(self) -> None:
        check_dataset(self.dataset)
        per_task = [key for key in self.PER_TASK if getattr(self, key) is not None]
        if per_task and self.dataset not in SHIPPED_INSTRUCTIONS:
            raise ValueError(
                f"`{per_task[0]}` is for `dataset: {' / '.join(SHIPPED_INSTRUCTIONS)}` (the shipped instruction "
                f"tasks), not `{self.dataset}`"
            )
        shipped = SHIPPED.get(self.dataset)  # a data set that ships with the package: its defaults fill the caps
        if shipped is not None:
            for key, value in shipped.defaults.items():
                if getattr(self, key) is None:
                    setattr(self, key, value)
            defaults = DataSection()
            given = [k for k in self.FILES_ONLY if getattr(self, k) != getattr(defaults, k)]
            if given:
                raise ValueError(f"`{given[0]}` is for `dataset: files`, not `{self.dataset}`")
        elif self.dataset in SHIPPED_INSTRUCTIONS:
            self._validate_instruct()
        elif self.val_per_class is not None:
            raise ValueError(
                f"`val_per_class` is for the shipped data sets (`dataset: {' / '.join(SHIPPED)}`); your own files "
                "take `validation` (a file) or `validation_share` (carved from `train`)"
            )
        elif self.dataset == "instructions":
            if (self.tasks is None) == (self.train is None):
                raise ValueError(
                    "`dataset: instructions` needs `tasks` (one file per task) or `train` with a `task_column`"
                )
            if self.train is not None and self.task_column is None:
                raise ValueError("`train` of `dataset: instructions` needs a `task_column` naming each row's task")
        elif self.train is None:
            raise ValueError("`dataset: files` needs `train`: the file(s), folder or hub id of the training data")
        if self.val_per_class is not None and self.val_per_class < 0:
            raise ValueError(f"`val_per_class` must be >= 0, got {self.val_per_class}")
        for key in ("n_tasks", "classes_per_task", "train_per_class", "test_per_class"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"`{key}` must be a positive integer, got {value}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"`protocol` must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.classes is not None and self.n_tasks and self.classes_per_task:
            if len(self.classes) != self.n_tasks * self.classes_per_task:
                raise ValueError(
                    f"`classes` lists {len(self.classes)} names but n_tasks * classes_per_task = "
                    f"{self.n_tasks * self.classes_per_task}"
                )
        for key in ("test_share", "validation_share"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"`{key}` must be in [0, 1), got {getattr(self, key)}")

    def _validate_instruct(self) -> None:
        """The shipped instruction tasks take the task families (``tasks``) and per-task sizes, nothing else."""
        from ..data.instruct_tasks import check_families

        defaults = DataSection()
        given = [
            k for k in (*self.PER_CLASS, *self.FILES_ONLY) if k != "tasks" and getattr(self, k) != getattr(defaults, k)
        ]
        if given:
            raise ValueError(
                f"`{given[0]}` is not a key of `dataset: {self.dataset}`: it takes `tasks` (the task families in "
                f"order), `{'`, `'.join(self.PER_TASK)}` and `seed`"
            )
        if self.tasks is not None:
            check_families(self.tasks)
        for key in self.PER_TASK:
            value, least = getattr(self, key), 0 if key == "val_per_task" else 1
            if value is not None and (isinstance(value, bool) or value < least):
                raise ValueError(f"`{key}` must be an integer >= {least}, got {value}")


TUNE_PROTOCOLS = ("sequence", "first_task")


@dataclass
class TuneSection:
    """Choosing each method's learning rate on a validation split inside the job (``peft-ext run --tune``).

    Every method gets the same budget: one run per point of a grid around its configured ``lr``, scored by the final
    accuracy on the validation examples (the tasks' ``validation`` split: ``data.val_per_class`` for WordNet,
    ``data.validation`` / ``data.validation_share`` for your files); the best point is then run on the test split.

    Args:
        enabled: Tune (``--tune`` sets it).
        protocol: ``sequence``: each grid point runs the whole sequence and is scored on every task's validation
            split (the common offline protocol: it looks at tasks a continual learner has not seen yet).
            ``first_task``: each grid point trains and scores the first task only (what a continual learner could
            really do before the sequence goes on).
        lr_factors: The grid: each method's ``lr`` times each factor (default half a decade each way).
        settings: At most one method-specific setting per method, tried at the chosen ``lr``: ``{method: {key:
            [values]}}``, the method by its label (or name) and the key a dotted path into its options
            (``adapter.trade_off`` for SplitLoRA, ``adapter.compress_schedule`` for PCLR's schedule). The configured
            value is the lr grid's own run; every other value costs one run.
    """

    enabled: bool = False
    protocol: str = "sequence"
    lr_factors: list[float] = field(default_factory=lambda: [0.316, 1.0, 3.16])
    settings: dict[str, dict[str, list[Any]]] = field(default_factory=dict)

    def validate(self) -> None:
        if self.protocol not in TUNE_PROTOCOLS:
            raise ValueError(f"`protocol` must be one of {TUNE_PROTOCOLS}, got {self.protocol!r}")
        if not self.lr_factors or any(not (f > 0) for f in self.lr_factors):
            raise ValueError(f"`lr_factors` must be a non-empty list of numbers > 0, got {self.lr_factors}")
        if len(set(self.lr_factors)) != len(self.lr_factors):
            raise ValueError(f"`lr_factors` lists a factor twice: {self.lr_factors}")
        for method, setting in self.settings.items():
            if len(setting) != 1:
                raise ValueError(
                    f"`settings.{method}` must name exactly one setting (at most one per method), got {list(setting)}"
                )
            ((key, values),) = setting.items()
            if not values:
                raise ValueError(f"`settings.{method}.{key}` must list at least one value")
            if any(values.count(v) > 1 for v in values):
                raise ValueError(f"`settings.{method}.{key}` lists a value twice: {values}")


@dataclass
class OutputSection:
    """Where results go.

    Args:
        dir: Output folder for results.json, results.md and accuracy_matrix.png (created if missing); a relative
            path is read from the working directory (data paths: from the config file's folder).
        save_adapters: Save each classification method's trained model (adapter in PEFT's layout, head, what
            rebuilds the backbone) under ``dir/adapters/<label>/``, for ``peft-ext predict`` and
            ``peft_ext.load_trained``.
    """

    dir: str = "runs/quickstart"
    save_adapters: bool = not_a_setting(True)

    def validate(self) -> None:
        path = Path(self.dir)
        if path.exists() and not path.is_dir():
            raise ValueError(f"`dir` {self.dir!r} exists and is not a directory")
        if not isinstance(self.save_adapters, bool):
            raise ValueError(f"`save_adapters` must be true or false, got {self.save_adapters!r}")


@dataclass
class MethodEntry:
    """One method of the run: its registered name and its validated options."""

    name: str
    options: MethodOptions


@dataclass
class RunConfig:
    """A whole run: one task sequence, one backbone, several methods compared side by side."""

    name: str = "run"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputSection = field(default_factory=OutputSection)
    methods: list[MethodEntry] = field(default_factory=list)
    tune: TuneSection = field(default_factory=TuneSection, metadata={FINGERPRINT: lambda tune: not tune.enabled})


def _build_method(data: Any, index: int) -> MethodEntry:
    prefix = f"methods[{index}]."
    if not isinstance(data, dict) or "name" not in data:
        raise ConfigError(f"`methods[{index}]` must be a mapping with a `name`, got {data!r}")
    try:
        cls = get_continual_method(data["name"])
    except ValueError as err:
        raise ConfigError(f"`{prefix}name`: {err}") from None
    data = cls.options_cls.nest_flat_keys(data, prefix)
    options = build_section(cls.options_cls, data, prefix, skip=("name",))
    if cls.trains and "lr" not in data and hasattr(options, "lr"):
        warnings.warn(
            f"`methods[{index}]` ({data.get('label') or cls.name}) gives no `lr`: it trains at the default "
            f"{options.lr:g}; set one, or let `--tune` choose it",
            UserWarning,
            stacklevel=2,
        )
    return MethodEntry(name=cls.name, options=options)


def get_setting(options: Any, key: str) -> Any:
    """The value of the dotted ``key`` (``adapter.trade_off``) in ``options``, as :func:`with_setting` reads it."""
    for part in key.split("."):
        options = options[part] if isinstance(options, dict) else getattr(options, part)
    return options


def with_setting(options: Any, key: str, value: Any, prefix: str = "") -> Any:
    """A copy of ``options`` with the dotted ``key`` (``adapter.trade_off``, ``optimizer.rank``) set to ``value``;
    nested dataclasses (an adapter config) are copied with :func:`dataclasses.replace`, so their own checks run, a
    section held as a mapping (``optimizer``) is copied with the key set, and the method's options are validated
    again.

    Raises:
        ConfigError: ``key`` names no option (with the valid ones), or ``value`` is not valid for it.
    """
    head, _, rest = key.partition(".")
    names = [f.name for f in dataclasses.fields(options) if f.init]
    if head not in names:
        raise unknown_key(head, prefix, names)
    current = getattr(options, head)
    if rest and isinstance(current, dict) and "." not in rest:  # a section held as a mapping (`optimizer.rank`)
        inner = {**current, rest: value}
    elif rest and not dataclasses.is_dataclass(current):
        raise ConfigError(f"`{prefix}{head}` is a {type(current).__name__}, not a section with a `{rest}`")
    else:  # a ConfigError from below names its whole key
        inner = with_setting(current, rest, value, f"{prefix}{head}.") if rest else value
    try:
        new = dataclasses.replace(options, **{head: inner})
        if hasattr(new, "validate"):
            new.validate()
    except (TypeError, ValueError) as err:
        raise ConfigError(f"`{prefix}{key}: {value!r}`: {err}") from None
    return new


def _check_tuned_settings(tune: TuneSection, entries: list[MethodEntry]) -> None:
    """Each ``tune.settings`` method is one of the run's (by label or name) and each value applies to its options."""
    labels = [e.options.label or e.name for e in entries]
    for method, setting in tune.settings.items():
        matching = [e for e, label in zip(entries, labels) if method in (label, e.name)]
        if not matching:
            raise unknown_value("tune.settings", method, labels)
        ((key, values),) = setting.items()
        for entry in matching:
            for value in values:
                try:
                    with_setting(entry.options, key, value)
                except ConfigError as err:
                    raise ConfigError(f"`tune.settings.{method}`: {err}") from None


def _check_model_fits_data(model: ModelSection, dataset: str) -> None:
    """The model kind learns the kind of task sequence the data set holds (a classifier classification data, a causal
    LM instruction tasks)."""
    kind, holds = model_kind(model.kind), sequence_kind(dataset)
    if holds == kind.sequence_kind:
        return
    if kind is model_kind(ModelSection.kind):  # the default kind: the data set is what asks for another
        fitting = " / ".join(k.name for k in MODEL_KINDS.values() if k.sequence_kind == holds)
        lead = f"`data.dataset: {dataset}` and `model.kind: {fitting}` go together"
    else:
        fitting = " / ".join(name for name in DATASETS if sequence_kind(name) == kind.sequence_kind)
        lead = f"`model.kind: {kind.name}` and `data.dataset: {fitting}` go together"
    said = "; ".join(f"{k.name}: {k.summary}" for k in MODEL_KINDS.values())
    raise ConfigError(f"{lead} ({said}), got dataset {dataset!r} with kind {model.kind!r}")


def config_from_dict(data: Any) -> RunConfig:
    """Validate a parsed YAML document and build a :class:`RunConfig`."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping at the top level, got {type(data).__name__}")
    sections = {
        "model": ModelSection,
        "data": DataSection,
        "train": TrainConfig,
        "output": OutputSection,
        "tune": TuneSection,
    }
    valid = ["name", *sections, "methods"]
    for key in data:
        if key not in valid:
            raise unknown_key(str(key), "", valid)
    name = data.get("name", "run")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"`name` must be a non-empty string, got {name!r}")
    built = {key: build_section(cls, data.get(key), f"{key}.") for key, cls in sections.items()}
    _check_model_fits_data(built["model"], built["data"].dataset)
    methods = data.get("methods")
    if not isinstance(methods, list) or not methods:
        raise ConfigError(f"`methods` must be a non-empty list of methods, got {methods!r}")
    entries = [_build_method(m, i) for i, m in enumerate(methods)]
    labels = [e.options.label or e.name for e in entries]
    dup = {x for x in labels if labels.count(x) > 1}
    if dup:
        raise ConfigError(f"`methods` has two entries labelled {sorted(dup)[0]!r}; give them distinct `label`s")
    _check_tuned_settings(built["tune"], entries)
    return RunConfig(name=name, methods=entries, **built)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as YAML). In ``methods`` a path part is an index or a name.

    Example: ``train.epochs=2``, ``methods.seq_lora.lr=5e-4``, ``data.classes=[noun.animal, verb.motion]``.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        path, raw = item.split("=", 1)
        parts = path.strip().split(".")
        if not all(parts):
            raise ConfigError(f"--set key {path!r} has an empty part")
        value = yaml.safe_load(raw)
        node: Any = data
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                node = node[_list_index(node, part, where)]
            else:
                node = node.setdefault(part, {})
                if not isinstance(node, (dict, list)):
                    raise ConfigError(f"--set {path}: `{where}` is a value, not a section")
        last = parts[-1]
        if isinstance(node, list):
            node[_list_index(node, last, path)] = value
        else:
            node[last] = value
    return data


def _list_index(items: list, part: str, where: str) -> int:
    if part.isdigit():
        if int(part) >= len(items):
            raise ConfigError(f"--set {where}: index {part} is out of range (the list has {len(items)} entries)")
        return int(part)
    names = [m.get("label") or m.get("name") if isinstance(m, dict) else None for m in items]
    if part not in names:
        raise ConfigError(f"--set {where}: no entry named {part!r}; entries: {names}")
    return names.index(part)


def read_config(path: str | Path, overrides: list[str] | None = None) -> Any:
    """Read a YAML config file and apply ``key=value`` overrides; no validation yet."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config path {str(path)!r} is a directory, expected a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    return apply_overrides(data if data is not None else {}, overrides or [])


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read, override and validate a YAML run config."""
    return config_from_dict(read_config(path, overrides))
