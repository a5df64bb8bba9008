"""Quantized bases on CPU: keeping bitsandbytes 4-bit layers trainable.

bitsandbytes 0.50 repacks a ``Linear4bit`` weight for its AVX512-BF16 CPU kernel on the layer's first eval-mode
no-grad forward (``Linear4bit.forward``; the flag is ``support_avx512bf16_for_cpu``, set from the CPU's features when
the layer is built). The repacking is meant for inference only and stays in place afterwards:

- The repacked weight has no autograd support: a training forward after any evaluation (Trainer's eval loop,
  ``generate()``) runs the inference kernel and drops the gradient to the layer's input, so every adapter below that
  layer gets a wrong or no gradient, silently.
- ``dequantize_4bit`` reads the repacked weight as if it were in the standard layout: merging an adapter into it
  (PEFT's ``merge_adapter``) writes a corrupted base weight.
- Repacking refuses shapes outside the kernel's blocks (out_features % 32, in_features % blocksize) with a shape
  error instead of falling back, and unpacking a double-quantized weight re-quantizes its scales (lossy if repeated).

:func:`disable_bnb_cpu_repacking` opts a model's 4-bit layers out, so eval and training forwards both run
bitsandbytes' standard 4-bit path. peft-ext's adapter layers apply it to the base they wrap;
``peft_ext.integrations.optimizer_for_trainer`` applies it to the whole model it is given.
"""

from __future__ import annotations

from torch import nn

__all__ = ["disable_bnb_cpu_repacking"]


def disable_bnb_cpu_repacking(module: nn.Module) -> None:
    """Keep every bitsandbytes ``Linear4bit`` in ``module`` (the module itself included) in its standard weight
    layout on CPU, so it can be trained, merged and evaluated in any order.

    A weight already repacked is unpacked the way bitsandbytes itself does before saving
    (``Linear4bit._save_to_state_dict``). Afterwards CPU inference runs bitsandbytes' generic 4-bit path, the one
    training uses (outputs agree with the repacked kernel's to bf16 rounding; the fused kernel is faster). Layers that
    are not bitsandbytes 4-bit are left alone, and nothing changes on GPU, where the flag is not read.

    Call it on a PEFT model with a 4-bit base before training on CPU, e.g. when building an optimizer yourself::

        model = get_peft_model(base, LoraConfig(...))
        peft_ext.disable_bnb_cpu_repacking(model)

    Every 4-bit layer counts, not only those with adapters: the gradient of an adapter flows back through the
    4-bit layers above it.

    Args:
        module: A model or a single (possibly quantized) layer.
    """
    for layer in module.modules():
        if not hasattr(layer, "support_avx512bf16_for_cpu"):  # only bitsandbytes' Linear4bit repacks
            continue
        layer.support_avx512bf16_for_cpu = False
        weight = getattr(layer, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
