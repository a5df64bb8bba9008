"""peft-ext's optimizers in ``transformers.Trainer``, without subclassing it.

Two entry points, both returning the ``(optimizer class, kwargs)`` pair that ``Trainer(optimizer_cls_and_kwargs=...)``
takes:

- :func:`optimizer_for_trainer` (``name``, ``model``, keyword options): for code that builds the Trainer.
- :func:`optimizer_from_args` (``TrainingArguments``, ``model``): for scripts configured by ``TrainingArguments`` /
  ``HfArgumentParser``. The optimizer is named in ``optim_args``, e.g. ``--optim_args
  "name=riemannion,momentum=0.95,aux_lr=1e-3"``; ``learning_rate``, ``weight_decay`` and Adam's betas/eps come from
  the arguments unless ``optim_args`` sets them.

``TrainingArguments.optim`` is an enum that Transformers validates, so no value of it can name an optimizer of
another package; ``optim_args`` is a free string that ``HfArgumentParser`` already exposes, and
``optimizer_cls_and_kwargs`` overrides ``optim`` whenever it is given. A ``TrainingArguments`` subclass with a new
field would work too, but every script would then need its own parser class; this needs none.

The model goes into the kwargs, not into Trainer's parameter groups: Riemannion must know which parameters form an
adapter (``"model"``, which Trainer passes as the first argument, as it does for LOMO), and DCT-AdamW's
``target_modules`` needs parameter names (``"params"``: the trainable named parameters). Trainer pops those keys
from the dict it is given, so build a fresh pair per Trainer.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Optional

from torch import nn
from torch.optim import Optimizer

from ..optim import OPTIMIZERS
from ..quantization import disable_bnb_cpu_repacking
from ..tuners.riemannion.layer import find_adapters

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = ["optimizer_for_trainer", "optimizer_from_args", "parse_optim_args"]

# Keys of optim_args whose values are pairs, and the TrainingArguments fields they default to.
_PAIRS = ("betas", "aux_betas")


def _accepted(cls: type[Optimizer]) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is Optimizer or not issubclass(klass, Optimizer):
            break
        names |= {n for n in inspect.signature(klass.__init__).parameters if n not in ("self", "params", "kwargs")}
    return names


def _resolve(name: str) -> type[Optimizer]:
    key = name.strip().lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown peft-ext optimizer {name!r}; valid names: {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[key]


def optimizer_for_trainer(name: str, model: nn.Module, **kwargs: Any) -> tuple[type[Optimizer], dict[str, Any]]:
    """The ``(class, kwargs)`` pair for ``Trainer(optimizer_cls_and_kwargs=...)`` that builds optimizer ``name``.

    Trainer passes the kwargs as they are (its ``learning_rate`` is not added): give ``lr`` here. Every bitsandbytes
    4-bit layer of ``model`` is opted out of bitsandbytes' CPU inference repacking
    (:func:`peft_ext.disable_bnb_cpu_repacking`), so training after an evaluation gets correct gradients.

    Args:
        name: ``"riemannion"``, ``"riemannlora"`` or ``"dct_adamw"`` (the keys of :data:`peft_ext.optim.OPTIMIZERS`).
        model: The model the Trainer trains (a ``PeftModel`` with Riemannion adapters for the first two).
        **kwargs: Options of the optimizer class (e.g. ``lr``, ``momentum``, ``aux_lr``; ``rank``,
            ``target_modules``).

    Returns:
        ``(optimizer class, kwargs)``; the kwargs hold ``"model"`` (Riemannion, RiemannLoRA) or ``"params"`` (the
        trainable named parameters, DCT-AdamW), which Trainer uses in place of its own parameter groups.

    Raises:
        ValueError: On an unknown name, or a Riemannion optimizer for a model without trainable Riemannion adapters.
        TypeError: On an option the optimizer does not take.
    """
    cls = _resolve(name)
    unknown = set(kwargs) - _accepted(cls)
    if unknown:
        raise TypeError(f"{cls.__name__} got unknown options {sorted(unknown)}; valid: {sorted(_accepted(cls))}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be the nn.Module the Trainer trains, got {type(model).__name__}")
    if "model" in _accepted(cls):  # the Riemannion family
        if not any(ref.A.requires_grad for ref in find_adapters(model)):
            raise ValueError(
                f"{cls.__name__} needs a model with trainable Riemannion adapters; build it with "
                "get_peft_model(model, RiemannionConfig(...)) before the Trainer"
            )
        source = {"model": model}
    else:
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{cls.__name__}: the model has no trainable parameters")
        source = {"params": params}
    # Why here: this is where peft-ext learns that `model` will be trained, and Trainer evaluates under no_grad in eval
    # mode between training steps (eval loop, generate() in callbacks). On an AVX512-BF16 CPU bitsandbytes then
    # repacks each 4-bit layer for inference and keeps it so; every later backward loses the gradient through those
    # layers, for PEFT's own adapters too. Opting out changes no training computation (a training forward never runs
    # the repacked kernel); eval forwards run the same standard path as training. The optimizer's constructor cannot
    # do it: it sees parameters, not modules. After the checks above, so a refused model is left as it was.
    disable_bnb_cpu_repacking(model)
    return cls, {**kwargs, **source}


def _coerce(key: str, text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if ":" in text:
        items = [_coerce(key, part) for part in text.split(":") if part]
        return tuple(items) if key in _PAIRS else items
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_optim_args(optim_args: Optional[str]) -> dict[str, Any]:
    """Parse ``"name=riemannion,lr=1e-3,betas=0.9:0.99,target_modules=query:value"`` into typed options.

    Values: ``true``/``false``, ``none``, integers, floats, ``a:b:c`` lists (``betas``/``aux_betas`` become tuples),
    else strings. A one-element list is written with a trailing colon (``target_modules=query:``).
    """
    if not optim_args:
        return {}
    options: dict[str, Any] = {}
    for item in optim_args.replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"`optim_args` entries must be key=value, got {item!r} in {optim_args!r}")
        if key in options:
            raise ValueError(f"`optim_args` sets {key!r} twice: {optim_args!r}")
        options[key] = _coerce(key, value)
    return options


def optimizer_from_args(args: TrainingArguments, model: nn.Module) -> tuple[type[Optimizer], dict[str, Any]]:
    """The peft-ext optimizer that ``args.optim_args`` names, for ``Trainer(optimizer_cls_and_kwargs=...)``.

    ``args.optim_args`` must contain ``name=<riemannion|riemannlora|dct_adamw>``; the other entries are options of
    that optimizer (parsed by :func:`parse_optim_args`). Unless set there, ``lr`` is ``args.learning_rate``,
    ``weight_decay`` is ``args.weight_decay``, and ``betas``/``eps`` (DCT-AdamW) or ``aux_betas``/``aux_eps``
    (Riemannion's AdamW part) are ``args.adam_beta1``, ``args.adam_beta2``, ``args.adam_epsilon``.

    Example::

        args = TrainingArguments("out", learning_rate=1e-3, optim_args="name=riemannion,aux_lr=3e-3")
        trainer = Trainer(model, args, train_dataset=data, optimizer_cls_and_kwargs=optimizer_from_args(args, model))

    Raises:
        ValueError: If ``optim_args`` names no optimizer or an unknown one.
    """
    options = parse_optim_args(getattr(args, "optim_args", None))
    name = options.pop("name", None)
    if not isinstance(name, str):
        raise ValueError(
            f"`optim_args` must name a peft-ext optimizer as name=<one of {sorted(OPTIMIZERS)}>, got "
            f"{getattr(args, 'optim_args', None)!r}"
        )
    accepted = _accepted(_resolve(name))
    betas = (args.adam_beta1, args.adam_beta2)
    defaults = {"lr": args.learning_rate, "weight_decay": args.weight_decay}
    if "aux_betas" in accepted:
        defaults.update(aux_betas=betas, aux_eps=args.adam_epsilon)
    else:
        defaults.update(betas=betas, eps=args.adam_epsilon)
    return optimizer_for_trainer(name, model, **{**defaults, **options})
