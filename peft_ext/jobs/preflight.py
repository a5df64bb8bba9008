"""What ``peft-ext check`` (and ``run``, before any training) verifies beyond the config's own validation: finite
numbers everywhere, a writable output folder, the data constraints, a resolvable backbone with a usable tokenizer,
and each method's adapter against the backbone's structure, built on the meta device (no weights are read or
allocated): every ``target_modules`` entry must match a linear layer.

Every check raises one :class:`~peft_ext.continual.config.ConfigError` naming the key and the value.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from ..continual.config import ConfigError, RunConfig, unknown_value
from ..continual.methods import get_continual_method
from ..models.kinds import model_kind
from ..tuners import matches_targets

__all__ = [
    "check_adapters",
    "check_backbone",
    "check_data",
    "check_finite",
    "check_output_dir",
    "check_tokenizer",
    "preflight",
]


def check_finite(data: Any, key: str = "") -> None:
    """Raise ``ConfigError`` naming the first non-finite number (``inf``, ``nan``) anywhere in a parsed config.

    Args:
        data: The parsed YAML document (after ``--set`` overrides).
        key: Dotted path of ``data`` (for the message); entries of ``methods`` are named by their ``name``, as
            ``--set`` addresses them.
    """
    if isinstance(data, float) and not math.isfinite(data):
        raise ConfigError(f"`{key}` must be a finite number, got {data}")
    if isinstance(data, dict):
        for k, v in data.items():
            check_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            name = v.get("name") if isinstance(v, dict) and key == "methods" else None
            check_finite(v, f"{key}.{name if isinstance(name, str) else i}")


def check_output_dir(path: str, key: str = "output.dir") -> None:
    """Raise ``ConfigError`` unless results can be written under ``path``: no part of it is a file, and a probe file
    can be created in it (or, when it does not exist yet, in its nearest existing parent). Creates nothing that
    stays.

    Args:
        path: The output folder.
        key: The config key, for the message.
    """
    target = Path(path).expanduser()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"`{key}` {path!r} cannot be created: {str(existing)!r} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".peft-ext-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"`{key}` {path!r} is not writable ({str(existing)!r}: {err.strerror})") from None


def check_data(config: RunConfig, tokenizer: Any = None) -> Any:
    """Raise ``ConfigError`` when the ``data`` section asks for classes the data set does not have: an unknown
    ``data.classes`` name, or more classes than the data set has at the per-class caps (``data.n_tasks``)."""
    from ..data import SHIPPED
    from .sequence import build_sequence

    data = config.data
    shipped = SHIPPED.get(data.dataset)
    if shipped is not None:
        names = shipped.names()
        for i, name in enumerate(data.classes or []):
            if name not in names:
                raise unknown_value(f"data.classes[{i}]", name, list(names))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the job itself warns (once) when it builds the sequence
            sequence = build_sequence(config, tokenizer)
    except (ValueError, FileNotFoundError, ImportError) as err:
        if shipped is None:
            raise ConfigError(f"`data`: {err}") from None
        raise ConfigError(
            f"`data` (n_tasks={data.n_tasks}, classes_per_task={data.classes_per_task}): {err}"
        ) from None
    from ..continual.task_kinds import check_heads

    if config.tune.enabled:  # what `run --tune` refuses, `check --tune` refuses too
        from .tuning import validation_sequence

        validation_sequence(sequence, config.tune.protocol)
    for entry in config.methods:
        cls = get_continual_method(entry.name)
        kinds = list(cls.task_kinds)
        if sequence.kind not in kinds:
            raise ConfigError(
                f"`methods.{entry.name}` runs {kinds} sequences, not the {sequence.kind} tasks of `data`"
            )
        try:
            check_heads(sequence, cls(entry.options))
        except ValueError as err:
            raise ConfigError(f"`methods.{entry.options.label or entry.name}`: {err}") from None
    return sequence


def _offline() -> bool:
    return any(
        os.environ.get(k, "").lower() in ("1", "true", "yes", "on") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _hub_host() -> tuple[str, int]:
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)


def hub_unreachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub is known to be out of reach: its host does not resolve or refuses a connection
    within ``timeout`` seconds (behind a proxy, never: the proxy decides). Saves the half minute of retries a hub id
    costs offline when ``HF_HUB_OFFLINE`` is not set."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    return _refused(*_hub_host(), timeout)


@functools.cache
def _refused(host: str, port: int, timeout: float) -> bool:
    """Whether a connection to ``host:port`` fails; asked once per process and address (the backbone's and the
    tokenizer's checks would otherwise each wait ``timeout``)."""
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return True
    return False


def _local_only(name: str) -> bool:
    """Load ``name`` from the local cache only: offline, or a hub id while the hub cannot be reached."""
    return not Path(name).expanduser().is_dir() and (_offline() or hub_unreachable())


def _not_cached(key: str, name: str) -> ConfigError:
    why = "the hub is offline (HF_HUB_OFFLINE)" if _offline() else f"the hub ({_hub_host()[0]}) cannot be reached"
    return ConfigError(
        f"`{key}` {name!r} is not in the local Hugging Face cache and {why}: download it once with network access, "
        "or give a local model directory"
    )


def check_backbone(name: str, key: str = "model.backbone") -> Any:
    """Resolve the backbone's config without loading weights; return the ``transformers`` config.

    Raises ``ConfigError`` naming the model id when it cannot be resolved: offline and not in the local cache (say
    so), or any other reason (one line).

    Args:
        name: The backbone name, hub id or local directory.
        key: The config key, for the message.
    """
    from transformers import AutoConfig

    from ..models import resolve_backbone

    resolved = resolve_backbone(name)
    local_only = _local_only(str(resolved))
    try:
        return AutoConfig.from_pretrained(resolved, local_files_only=local_only)
    except Exception as err:  # noqa: BLE001 - any failure to resolve is reported as one line naming the model
        if local_only:
            raise _not_cached(key, name) from None
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"`{key}` {name!r} cannot be loaded: {first}") from None


#: Files a tokenizer is read from (one of them must be in a local model folder).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
#: Fewer entries than this and the tokenizer is taken for transformers' placeholder (special tokens only).
MIN_VOCAB = 100


def check_tokenizer(name: str, key: str = "model.backbone") -> Any:
    """Raise ``ConfigError`` unless the backbone has a usable tokenizer.

    Without tokenizer files, a local model folder still loads: transformers builds a placeholder tokenizer of a few
    special tokens, every word becomes ``[UNK]`` and training runs at chance without a word of warning.

    Args:
        name: The backbone name, hub id or local directory.
        key: The config key, for the message.
    """
    from transformers import AutoTokenizer

    from ..models import resolve_backbone

    path = Path(resolve_backbone(name)).expanduser()
    fix = "save it beside the weights (`tokenizer.save_pretrained(folder)`)"
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"`{key}` {name!r} has no tokenizer files (none of {list(TOKENIZER_FILES)}); {fix}, or point "
            "`model.backbone` at a folder or hub id that has one"
        )
    local_only = not path.is_dir() and _local_only(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name, local_files_only=local_only)
    except Exception as err:  # noqa: BLE001 - any failure to load is reported as one line naming the model
        if local_only:
            raise _not_cached(key, name) from None
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"`{key}` {name!r}: its tokenizer cannot be loaded: {first}") from None
    if len(tokenizer) < MIN_VOCAB:
        raise ConfigError(
            f"`{key}` {name!r}: its tokenizer has only {len(tokenizer)} tokens ({sorted(tokenizer.get_vocab())[:8]}), "
            f"a placeholder, not a vocabulary; {fix}"
        )
    return tokenizer


def _targets_and_rank(options: Any) -> tuple[Any, Any]:
    adapter = getattr(options, "adapter", None)
    source = adapter if adapter is not None and hasattr(adapter, "target_modules") else options
    return getattr(source, "target_modules", None), getattr(source, "r", None)


def check_adapters(config: RunConfig, model_config: Any) -> None:
    """Raise ``ConfigError`` when a method's ``target_modules`` match no linear layer of the backbone, or (a method
    whose ``rank_bounded_by_input_width``) its ``r`` is above a matched layer's input width.

    The backbone is built on the meta device from ``model_config``, as the model kind names its layers
    (:meth:`~peft_ext.models.kinds.ModelKind.linear_layers`): no weights are read or allocated.

    Args:
        config: The validated run config.
        model_config: The backbone's ``transformers`` config (:func:`check_backbone`).
    """
    linears = model_kind(config.model.kind).linear_layers(model_config)
    for entry in config.methods:
        targets, r = _targets_and_rank(entry.options)
        if not targets or targets == "all-linear":
            continue
        where = f"methods.{entry.name}"
        matched = {n: m for n, m in linears.items() if matches_targets(n, targets)}
        if matched and not isinstance(targets, str):
            # PEFT adapts what any entry matches and says nothing of an entry that matches nothing (a typo)
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
            for entry_name in targets:
                if not any(matches_targets(n, [entry_name]) for n in linears):
                    close = difflib.get_close_matches(str(entry_name), suffixes, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise ConfigError(
                        f"`{where}` target_modules entry {entry_name!r} matches no linear layer of "
                        f"{config.model.backbone!r}{hint}; only the other entries would get adapters. Its linear "
                        f"layers end in {suffixes}"
                    )
        if not matched:
            some = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise ConfigError(
                f"`{where}` target_modules {targets!r} match no linear layer of {config.model.backbone!r}; "
                f"its linear layers end in {some}"
            )
        if get_continual_method(entry.name).rank_bounded_by_input_width and isinstance(r, int):
            width = min(m.in_features for m in matched.values())
            if r > width:
                raise ConfigError(
                    f"`{where}` r={r} is above the input width {width} of the layers target_modules match "
                    f"in {config.model.backbone!r}; use r <= {width}"
                )


def check_instruction_lengths(config: RunConfig, tokenizer: Any, sequence: Any, model_config: Any = None) -> None:
    """Raise ``ConfigError`` when the job's collate cannot be built on the tokenizer (no separator, no eos), or when
    an example needs more than ``model.max_length`` tokens: answers are never truncated (a cut answer would train
    and score the model on the wrong text), so such an example would fail its batch in the middle of training."""
    from .sequence import causal_collate

    try:
        collate = causal_collate(tokenizer, config.model)
    except ValueError as err:
        raise ConfigError(f"`model` {config.model.backbone!r}: {err}") from None
    lengths = [
        (collate.length(ex), task.name, split, ex.inputs.prompt)
        for task in sequence.tasks
        for split, examples in (("train", task.train), ("test", task.test), ("validation", task.validation))
        for ex in examples
    ]
    positions = getattr(model_config, "max_position_embeddings", None)
    if positions is not None and lengths:
        budget = config.model.max_new_tokens or 0
        longest = max(lengths)
        if longest[0] + budget > positions:
            raise ConfigError(
                f"`model.backbone` {config.model.backbone!r} reads at most {positions} positions, but an example of "
                f"task {longest[1]!r} ({longest[2]} split, prompt {longest[3][:40]!r}) needs {longest[0]} tokens"
                + (f" plus {budget} generated" if budget else "")
                + ": shorten the prompts or use a model with more positions"
            )
    over = [entry for entry in lengths if entry[0] > config.model.max_length]
    if over:
        longest = max(over)
        total = sum(len(t.train) + len(t.test) + len(t.validation) for t in sequence.tasks)
        raise ConfigError(
            f"`model.max_length` {config.model.max_length}: {len(over)} of {total} examples need more tokens (prompt, "
            f"separator, answer, eos); the longest, {longest[0]} tokens, is in the {longest[2]} split of task "
            f"{longest[1]!r} (prompt {longest[3][:40]!r}). Raise `model.max_length` (answers are never truncated)"
        )


def preflight(config: Any) -> Any:
    """Everything knowable before training, for any job's config: the output folder, and for continual jobs the data,
    the backbone and each method's adapter against the backbone's structure.

    Args:
        config: A config from :func:`peft_ext.jobs.load_job_config`.

    Returns:
        The task sequence a continual job would run (``None`` for other jobs).
    """
    from .kinds import job_kind_of

    check_output_dir(config.output.dir)
    check = job_kind_of(config).preflight
    return None if check is None else check(config)


def preflight_continual(config: RunConfig) -> Any:
    """A continual job's checks: the backbone, its tokenizer, the data and each method's adapter against the
    backbone's structure, and the model kind's own checks (a causal LM's: every instruction's length); returns the
    task sequence."""
    model_config = check_backbone(config.model.backbone)
    tokenizer = check_tokenizer(config.model.backbone)
    sequence = check_data(config, tokenizer)
    if model_kind(config.model.kind).generates:
        check_instruction_lengths(config, tokenizer, sequence, model_config)
    check_adapters(config, model_config)
    return sequence
