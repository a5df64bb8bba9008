"""Registers peft-ext's adapter types with PEFT whenever PEFT is imported, so that ``PeftModel.from_pretrained``
(or ``AutoPeftModel...``) loads a saved Riemannion / SplitLoRA / PCLR / MoRA adapter without ``import peft_ext``.

The wheel installs ``peft_ext_autoload.pth`` next to the packages; Python's ``site`` runs it at start-up, which only
puts :class:`_AfterPeft` on ``sys.meta_path`` (this module imports nothing beyond ``sys`` and ``os``; an interpreter
that never imports peft pays its import, about 2 ms: ``python -X importtime -c pass``). When ``peft`` is first
imported, the finder lets the real finders load peft and imports ``peft_ext`` right after peft's own module ran,
which registers the types. Set ``PEFT_EXT_NO_AUTOLOAD=1`` to turn it off; a failure to register is a
warning, never a failed ``import peft``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["install", "quiet_kernel_notices"]


def quiet_kernel_notices() -> None:
    """Drop two log records that are not actionable for peft-ext users: on CPUs with AVX512-BF16, importing
    bitsandbytes looks for an optional 4-bit kernel on the Hugging Face Hub (through the ``kernels`` package, which
    recent transformers install) and, offline or without that package, logs why it could not load it (and
    ``kernels`` logs that it skipped the publisher check). CPU 4-bit layers work without it; every other record
    passes. Installed before anything imports peft (and with it bitsandbytes)."""
    import logging

    class DropOptionalKernelNotice(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "kernels-community" not in record.getMessage()

    for name in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):
        log = logging.getLogger(name)
        if not any(type(f).__name__ == "DropOptionalKernelNotice" for f in log.filters):
            log.addFilter(DropOptionalKernelNotice())


def _register() -> None:
    try:
        import peft_ext.tuners  # noqa: F401  (runs peft_ext/__init__, which registers every adapter type with PEFT)
    except Exception as err:  # noqa: BLE001 - peft itself imported fine: say why ours did not, do not break it
        import warnings

        warnings.warn(
            f"peft-ext could not register its adapter types with PEFT ({type(err).__name__}: {err}); "
            "`import peft_ext` to see the full error",
            stacklevel=2,
        )


class _AfterPeft:
    """A ``sys.meta_path`` finder that finds nothing itself: for ``peft`` it hands back the real finders' spec with
    the loader wrapped, so that ``peft_ext`` is imported once peft's module has run (a spec that is only looked at,
    as ``importlib.util.find_spec`` probes do, is never run and changes nothing); then it leaves ``sys.meta_path``."""

    def __init__(self) -> None:
        self._asking = False

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != "peft" or self._asking:
            return None
        import importlib.util

        self._asking = True  # the real finders answer the question below, not this one again
        try:
            spec = importlib.util.find_spec("peft")
        finally:
            self._asking = False
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_peft = loader.exec_module

        def exec_module(module: object) -> None:
            quiet_kernel_notices()
            run_peft(module)
            sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not self]
            _register()

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Put the finder on ``sys.meta_path`` (first), unless ``PEFT_EXT_NO_AUTOLOAD`` is set, it is there already, or
    peft is imported already (then register now)."""
    if os.environ.get("PEFT_EXT_NO_AUTOLOAD", "").strip() not in ("", "0"):
        return
    if "peft" in sys.modules:
        _register()
    elif not any(type(finder).__name__ == "_AfterPeft" for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterPeft())
