"""A dual encoder of a pretrained BERT-style text tower (MiniLM-L6 by default) and a small ViT, with the hooks the
missing-modality benchmark needs: running a tower from a given layer on (so frozen lower layers can be cached) and
missing-aware prompts at the top layers.

Contrastive pretraining is LiT-style (Zhai et al., 2022): the pretrained text tower stays locked, the ViT and both
projections learn CLIP's loss on image + name pairs. The text tower is a ``transformers.BertModel`` and the vision
tower a ``transformers.ViTModel``, so MoRA pairs them with :func:`mora_patterns` (attention ``query`` / ``key`` /
``value`` / ``attention.output.dense`` and the ViT's ``q/k/v/o_proj``, square in both towers, widths may differ).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import get_peft_model
from torch import nn
from transformers import AutoModel, AutoTokenizer, BertModel, PreTrainedTokenizerBase, ViTConfig, ViTModel

from ..models.text import load_pretrained_quietly, resolve_backbone
from ..tuners.mora import MoRAConfig, plan_targets
from .prompts import MissingAwarePrompts

__all__ = [
    "ATTENTION_PROJECTIONS",
    "DualEncoder",
    "build_dual_encoder",
    "clip_loss",
    "matched_lora_ranks",
    "mora_patterns",
    "pixels",
    "pretrain_contrastive",
]

# transformers 5's BertLayer (attention.self.{query,key,value}, attention.output.dense) and ViTLayer
# (attention.{q,k,v,o}_proj); each is a d x d projection. `attention.output.dense` as a suffix leaves out BERT's FFN
# `output.dense` (1536 -> 384), which MoRA could not adapt (not square).
ATTENTION_PROJECTIONS = ("query", "key", "value", "attention.output.dense", "q_proj", "k_proj", "v_proj", "o_proj")


def mora_patterns() -> dict[str, Any]:
    """``MoRAConfig`` keyword arguments that pair the towers of a :class:`DualEncoder`."""
    return {
        "text_pattern": r"(?:^|\.)text\.encoder\.layer\.(\d+)\.",
        "vision_pattern": r"(?:^|\.)vision\.layers\.(\d+)\.",
        "target_modules": list(ATTENTION_PROJECTIONS),
    }


def matched_lora_ranks(model: DualEncoder, r: int, alpha: float, top_layers: int) -> dict[str, int]:
    """LoRA ranks per module (the modules MoRA adapts) whose adapter trains as many parameters as MoRA's, or the
    nearest count below it: every module at the largest uniform rank that stays within MoRA's count, then one more
    rank for modules in plan order while the count stays within it. The benchmark's settings (r = 4, top 2 layers of
    MiniLM and the 192-wide ViT) match exactly: 50,688 adapter parameters, 6 text projections at rank 6 and the rest
    at rank 5.

    Args:
        model: The dual encoder (not modified: MoRA is counted on a copy).
        r: MoRA's rank.
        alpha: MoRA's scale numerator.
        top_layers: Layers per tower MoRA adapts.
    """
    backbone = copy.deepcopy(model)
    config = MoRAConfig(r=r, alpha=alpha, top_layers=top_layers, **mora_patterns())
    plan = plan_targets(backbone, config)
    modules = dict(backbone.named_modules())
    cost = {name: modules[name].in_features + modules[name].out_features for name in plan}  # one rank of LoRA
    budget = sum(p.numel() for p in get_peft_model(backbone, config).parameters() if p.requires_grad)
    base = max(1, budget // sum(cost.values()))
    ranks = dict.fromkeys(plan, base)
    left = budget - base * sum(cost.values())
    for name in plan:
        if cost[name] <= left:
            ranks[name] += 1
            left -= cost[name]
    return ranks


def pixels(images: np.ndarray) -> torch.Tensor:
    """``uint8`` ``(n, H, W, 3)`` images -> ``float`` ``(n, 3, H, W)`` in ``[-1, 1]``."""
    return (torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # (batch, seq) 0/1 -> (batch, 1, 1, seq) additive, which both eager and SDPA attention of transformers accept
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def _run_layers(
    layers: nn.ModuleList,
    hidden: torch.Tensor,
    mask: torch.Tensor | None,
    start: int,
    prompts: MissingAwarePrompts | None,
    pattern: torch.Tensor | None,
    end: int | None,
) -> torch.Tensor:
    """Run ``layers[start:end]`` on ``hidden``, with the prompts prepended in the last ``prompts.num_layers`` layers
    and cut off again after each; ``mask`` (the text tower's key mask) is ``None`` for the vision tower, whose layers
    take no mask."""
    first_prompted = len(layers) - (prompts.num_layers if prompts is not None else 0)
    for i in range(start, len(layers) if end is None else end):
        m = mask
        prompted = prompts is not None and i >= first_prompted
        if prompted:
            hidden, m = prompts.prepend(hidden, mask, pattern, i - first_prompted)
        out = layers[i](hidden) if m is None else layers[i](hidden, _additive_mask(m, hidden.dtype))
        hidden = out[0] if isinstance(out, tuple) else out
        if prompted:
            hidden = hidden[:, prompts.length :]
    return hidden


class DualEncoder(nn.Module):
    """Text tower + vision tower + linear projections into a joint space (CLIP-like).

    Args:
        text: A ``BertModel`` (e.g. MiniLM-L6). Pooling: masked mean of the last hidden states (how MiniLM was
            trained), then ``text_proj``.
        vision: A ``ViTModel`` without pooler. Pooling: the final layer norm's CLS token, then ``vision_proj``.
        embed_dim: Width of the joint space.
    """

    def __init__(self, text: BertModel, vision: ViTModel, embed_dim: int = 128) -> None:
        super().__init__()
        self.text = text
        self.vision = vision
        self.text_proj = nn.Linear(text.config.hidden_size, embed_dim, bias=False)
        self.vision_proj = nn.Linear(vision.config.hidden_size, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.embed_dim = embed_dim

    @property
    def text_layers(self) -> nn.ModuleList:
        return self.text.encoder.layer

    @property
    def vision_layers(self) -> nn.ModuleList:
        return self.vision.layers

    def text_hidden(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor,
        start: int = 0,
        prompts: MissingAwarePrompts | None = None,
        pattern: torch.Tensor | None = None,
        end: int | None = None,
    ) -> torch.Tensor:
        """Run text layers ``start..end-1`` (default: to the top) on ``hidden`` (the embeddings when ``start == 0``);
        prompts go into the last ``prompts.num_layers`` layers of the tower."""
        return _run_layers(self.text_layers, hidden, mask, start, prompts, pattern, end)

    def vision_hidden(
        self,
        hidden: torch.Tensor,
        start: int = 0,
        prompts: MissingAwarePrompts | None = None,
        pattern: torch.Tensor | None = None,
        end: int | None = None,
    ) -> torch.Tensor:
        """Run vision layers ``start..end-1`` (default: to the top) on ``hidden`` (the patch embeddings when
        ``start == 0``); prompts go into the last ``prompts.num_layers`` layers of the tower."""
        return _run_layers(self.vision_layers, hidden, None, start, prompts, pattern, end)

    def text_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text.embeddings(input_ids=input_ids)

    def vision_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision.embeddings(pixel_values)

    def pool_text(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return self.text_proj((hidden * m).sum(1) / m.sum(1).clamp_min(1.0))

    def pool_vision(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vision_proj(self.vision.layernorm(hidden)[:, 0])

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor,
        text_prompts: MissingAwarePrompts | None = None,
        vision_prompts: MissingAwarePrompts | None = None,
        pattern: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint-space embeddings ``(text, image)``, each ``(batch, embed_dim)``, not normalized."""
        text = self.text_hidden(self.text_embeddings(input_ids), attention_mask, 0, text_prompts, pattern)
        image = self.vision_hidden(self.vision_embeddings(pixel_values), 0, vision_prompts, pattern)
        return self.pool_text(text, attention_mask), self.pool_vision(image)


def build_dual_encoder(
    text: str = "minilm",
    vision_width: int = 192,
    vision_layers: int = 4,
    vision_heads: int = 4,
    image_size: int = 32,
    patch_size: int = 8,
    embed_dim: int = 128,
    seed: int = 0,
) -> tuple[DualEncoder, PreTrainedTokenizerBase]:
    """The text tower from ``text`` (``"minilm"``: the packaged offline MiniLM-L6, or a local BERT directory) and a
    randomly initialized ViT; returns ``(model, tokenizer)``."""
    path = resolve_backbone(text)
    text_model = load_pretrained_quietly(AutoModel, path, add_pooling_layer=False)
    if not isinstance(text_model, BertModel):
        raise ValueError(f"the text tower must be a BERT-style model (BertModel), {text!r} is {type(text_model)}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(seed)
    vision_config = ViTConfig(
        image_size=image_size,
        patch_size=patch_size,
        hidden_size=vision_width,
        intermediate_size=4 * vision_width,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    vision_model = ViTModel(vision_config, add_pooling_layer=False)
    return DualEncoder(text_model, vision_model, embed_dim).eval(), tokenizer


def clip_loss(text: torch.Tensor, image: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric InfoNCE over a batch of paired embeddings."""
    text = nn.functional.normalize(text, dim=-1)
    image = nn.functional.normalize(image, dim=-1)
    logits = logit_scale.clamp(max=math.log(100)).exp() * text @ image.T
    target = torch.arange(len(text), device=text.device)
    return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.T, target)) / 2


def _pooled_text(model: DualEncoder, ids: torch.Tensor, mask: torch.Tensor, batch: int = 256) -> torch.Tensor:
    # The locked text tower's mean-pooled output (before text_proj), computed once.
    out = []
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            m = mask[i : i + batch]
            hidden = model.text_hidden(model.text_embeddings(ids[i : i + batch]), m)
            w = m.unsqueeze(-1).to(hidden.dtype)
            out.append((hidden * w).sum(1) / w.sum(1).clamp_min(1.0))
    return torch.cat(out)


def pretrain_contrastive(
    model: DualEncoder,
    ids: torch.Tensor,
    mask: torch.Tensor,
    px: torch.Tensor,
    epochs: int,
    *,
    lr: float = 1e-3,
    batch_size: int = 128,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    cache_key: dict[str, Any] | None = None,
    echo: Callable[[str], Any] = print,
) -> dict[str, float]:
    """LiT pretraining: the text tower stays locked; the ViT, both projections and the temperature learn CLIP's loss.

    With ``cache_dir``, the learned state is saved to ``cache_dir/dual_<hash>.pt``, the hash covering ``cache_key``
    (all settings that change the result) and the data; a later call with the same key loads it instead of training.

    Returns:
        ``{"first_loss", "last_loss", "seconds", "cached"}``.
    """
    path = None
    if cache_dir is not None:
        digest = hashlib.sha1(json.dumps(cache_key or {}, sort_keys=True).encode())
        digest.update(ids.numpy().tobytes())
        digest.update(px[:, :, ::4, ::4].numpy().tobytes())
        path = Path(cache_dir) / f"dual_{digest.hexdigest()[:16]}.pt"
        if path.is_file():
            saved = torch.load(path, map_location="cpu")
            model.load_state_dict(saved["state"], strict=False)
            echo(f"  loaded the pretrained dual encoder from {path}")
            return {**saved["log"], "cached": True}
    start = time.perf_counter()
    text_feats = _pooled_text(model, ids, mask)
    model.text.requires_grad_(False)
    params = [p for n, p in model.named_parameters() if not n.startswith("text.")]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.05)
    steps = epochs * math.ceil(len(ids) / batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(steps))
    gen = torch.Generator().manual_seed(seed)
    model.vision.train()
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(ids), generator=gen)
        total = 0.0
        for begin in range(0, len(ids), batch_size):
            b = order[begin : begin + batch_size]
            image = model.pool_vision(model.vision_hidden(model.vision_embeddings(px[b])))
            loss = clip_loss(model.text_proj(text_feats[b]), image, model.logit_scale)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += loss.item() * len(b)
        losses.append(total / len(ids))
        if epoch == 0 or epoch == epochs - 1 or (epoch + 1) % 10 == 0:
            echo(f"  pretrain epoch {epoch + 1}/{epochs}: contrastive loss {losses[-1]:.3f}")
    model.eval()
    model.requires_grad_(True)
    log = {"first_loss": losses[0], "last_loss": losses[-1], "seconds": time.perf_counter() - start}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v for k, v in model.state_dict().items() if not k.startswith("text.")}
        torch.save({"state": state, "log": log, "key": cache_key}, path)
        echo(f"  saved the pretrained dual encoder to {path}")
    return {**log, "cached": False}


def cosine_with_warmup(steps: int, warmup: float = 0.1) -> Callable[[int], float]:
    """LambdaLR factor: linear warmup over ``warmup * steps``, then cosine decay to 0 (docs/methods.md (MoRA)
    schedule)."""
    warm = max(1, int(warmup * steps))
    return lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))
