"""PCLR's routing query and per-sample routing on architectures beyond plain decoders (docs/pclr.md, "Routing query
by architecture"): layers fed flattened tokens (OPT), encoder-decoders (T5, BART), image models (ViT, CLIP's vision
tower) and feature models without token inputs (PEFT's test MLPs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from peft import get_peft_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from peft_ext import PCLRConfig
from peft_ext.tuners.pclr import default_query, group_layers, routed_as, select_top_k
from peft_ext.tuners.pclr.distill import default_forward

from .architectures import ARCHS

ARCH = {a.name: a for a in ARCHS}


def _pclr(model: nn.Module, **kw) -> nn.Module:
    settings = dict(target_modules="all-linear", pool_size=8, ranks_schedule=[6], top_k=3, init_weights=False)
    return get_peft_model(model, PCLRConfig(**{**settings, **kw}))


def _state(model: nn.Module):
    return model.base_model.routing_state


# --- layers fed flattened tokens ----------------------------------------------------------------------------------


def test_only_opt_feeds_a_linear_layer_flattened_tokens():
    # the finding behind selection.per_sample's docstring: every linear input of every architecture, recorded
    flattening = set()
    for arch in ARCHS:
        model, batch = arch.model(), arch.batch(size=3, length=7)
        seen: list[tuple[int, ...]] = []
        handles = [
            m.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(tuple(args[0].shape[:-1])))
            for m in model.modules()
            if isinstance(m, (nn.Linear, Conv1D))
        ]
        with torch.no_grad():
            model(**batch)
        for handle in handles:
            handle.remove()
        if any(len(shape) == 1 and shape[0] > 3 for shape in seen):  # (batch x seq,) rather than (batch,)
            flattening.add(arch.name)
    assert flattening == {"opt"}


def _opt_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(4, 96, (3, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    mask[2, :4] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_opt_flattened_rows_are_routed_by_their_samples_query():
    model = _pclr(ARCH["opt"].model()).eval()
    batch = _opt_batch()
    fc1 = model.base_model.model.model.decoder.layers[0].fc1
    seen = {}
    fc1.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    with torch.no_grad():
        model(**batch)
    x, y = seen["x"], seen["y"]
    assert x.shape == (3 * 6, 32)  # OPT flattens (batch x seq, d) before fc1

    # by hand: each sample's query, the group's keys, the top-3 ranks, sum of (a_i . x) b_i for each row's sample
    query = default_query(model.base_model.model, (), batch)
    owner = fc1.group_owner("default")
    indices, gates = select_top_k(query, owner.keys("default"), 3)
    assert not all(torch.equal(indices[0], row) for row in indices)  # the samples route differently
    A, B = fc1.pool("default")
    want = fc1.get_base_layer()(x).clone()
    for row in range(x.shape[0]):
        sample = row // 6
        for slot, rank in enumerate(indices[sample].tolist()):
            want[row] += fc1.pclr_scale["default"] * gates[sample, slot] * (A[rank] @ x[row]) * B[rank]
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def test_opt_generate_routes_by_the_prompt_with_and_without_cache_and_padding():
    model = _pclr(ARCH["opt"].model()).eval()
    batch = _opt_batch()
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(**batch, use_cache=True, **kwargs)
        plain = model.generate(**batch, use_cache=False, **kwargs)
        alone = model.generate(input_ids=batch["input_ids"][2:, 4:], use_cache=True, **kwargs)
    assert torch.equal(cached, plain)
    assert torch.equal(cached[2, 4:], alone[0])  # a left-padded row generates what it generates alone


def test_opt_mixed_adapter_batch_is_right_or_refused():
    model = _pclr(ARCH["opt"].model())
    model.add_adapter("other", PCLRConfig(target_modules="all-linear", pool_size=8, ranks_schedule=[6], top_k=3))
    model.eval()
    batch = _opt_batch()
    names = ["default", "other", "__base__"]
    try:
        with torch.no_grad():
            mixed = model(**batch, adapter_names=names).logits
    except ValueError as error:  # the flattened MLP's rows are not one per name: refused, never silently wrong
        assert "adapter_names" in str(error)
        return
    for row, name in enumerate(names):
        single = {k: v[row : row + 1] for k, v in batch.items()}
        with torch.no_grad():
            if name == "__base__":
                with model.disable_adapter():
                    want = model(**single).logits
            else:
                model.set_adapter(name)
                want = model(**single).logits
        torch.testing.assert_close(mixed[row : row + 1], want, atol=1e-5, rtol=1e-5)


def test_a_layer_input_that_is_not_per_sample_is_refused_naming_the_layer():
    class Unpadded(nn.Module):  # feeds its linear only the real tokens: rows are no multiple of the batch
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.proj, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 2)

        def get_input_embeddings(self) -> nn.Module:
            return self.embed

        def forward(self, input_ids, attention_mask):
            hidden = self.embed(input_ids)[attention_mask.bool()]
            return self.head(self.proj(hidden))

    model = get_peft_model(Unpadded(), PCLRConfig(target_modules=["proj"], pool_size=4, ranks_schedule=[2], top_k=2))
    ids, mask = torch.randint(0, 16, (2, 4)), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    mask[1, 0] = 1  # 7 real tokens for 2 samples
    with pytest.raises(ValueError, match=r"layer 'proj' got an input of shape \(7, 8\) but the routing query has 2"):
        model(input_ids=ids, attention_mask=mask)


# --- encoder-decoders ---------------------------------------------------------------------------------------------


def test_t5_default_distillation_forward_gives_the_decoder_its_inputs_from_the_labels():
    model = _pclr(ARCH["t5"].model()).eval()
    batch = ARCH["t5"].batch()
    batch["labels"][0, -2:] = -100  # ignored label positions become the pad token, as the model's own forward does
    with torch.no_grad():
        torch.testing.assert_close(default_forward(model.base_model, batch).logits, model(**batch).logits)


def _cycle_t5(integrate_epochs: int) -> tuple[nn.Module, object]:
    # "index" drops every other rank: both tasks keep some
    model = _pclr(
        ARCH["t5"].model(), pool_size=16, ranks_schedule=[4], compress_schedule=[0.0, 0.5], compress_rule="index"
    ).eval()
    first, second = ARCH["t5"].batch(seed=0), ARCH["t5"].batch(seed=1)
    model.end_task(0, model.query_prototype([first]), [first], integrate_epochs=0)
    proto = model.query_prototype([second])
    model.begin_task(1, proto)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "pclr_B." in name:
                p.add_(0.1 * torch.randn_like(p))  # task 1 "trained"
    torch.manual_seed(0)
    return model, model.end_task(1, proto, [second], integrate_epochs=integrate_epochs, integrate_lr=1e-2)


def test_t5_end_task_distills_into_the_surviving_ranks_and_shared_lora_of_both_stacks():
    distilled, result = _cycle_t5(integrate_epochs=2)
    compressed, _ = _cycle_t5(integrate_epochs=0)
    assert result.steps == 2
    state, reference = distilled.state_dict(), compressed.state_dict()
    changed = {key for key, value in state.items() if not torch.equal(value, reference[key])}
    # the distillation trains task 1's surviving ranks (folded into the static pool by end_task) and their keys
    assert changed, "the distillation changed nothing"
    assert all(any(part in key for part in ("pclr_A_static", "pclr_B_static", "pclr_keys")) for key in changed)
    assert any(".encoder." in key for key in changed) and any(".decoder." in key for key in changed)
    for key in changed:  # only rows of task 1's ranks: task 0's static ranks stay frozen
        rows = (state[key] != reference[key]).any(-1).nonzero().flatten()
        for store in ("pclr_A_static", "pclr_B_static", "pclr_keys_static"):
            key = key.replace(store, "pclr_rank_task")
        assert set(state[key][rows].tolist()) == {1}


def _bart() -> nn.Module:
    return _pclr(ARCH["bart"].model()).eval()


def _record_queries(model: nn.Module) -> list[torch.Tensor]:
    queries = []
    state = _state(model)
    model.base_model.model.register_forward_hook(lambda m, a, out: queries.append(state.query.clone()))
    return queries


@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_encoder_decoder_generate_routes_every_decoder_step_by_the_encoder_input(arch):
    model = _pclr(ARCH[arch].model()).eval()
    ids = torch.randint(4, 96, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding of the encoder input
    prompt = default_query(model.base_model.model, (), {"input_ids": ids, "attention_mask": mask})
    queries = _record_queries(model)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)

    def generate(generate_fn=model.generate, **extra):
        model(input_ids=ids[:1], labels=ids[:1])  # a forward on other inputs first: no stale query may survive
        queries.clear()
        return generate_fn(**kwargs, **extra), list(queries)

    with torch.no_grad():
        cached, steps = generate(use_cache=True)
        plain, plain_steps = generate(use_cache=False)
        base, base_steps = generate(model.base_model.model.generate)  # no PEFT session: kept on the encoder output
        beams, beam_steps = generate(num_beams=2)
        alone = model.generate(input_ids=ids[1:, :5], max_new_tokens=4, do_sample=False)
    assert len(steps) >= 4 and all(torch.equal(q, prompt) for q in steps + plain_steps + base_steps)
    assert torch.equal(cached, plain) and torch.equal(cached, base)
    assert torch.equal(cached[1], alone[0])  # the padded row generates what it generates alone
    # generate repeats each encoder output per beam: every beam routes by its prompt
    assert beams.shape[0] == 2 and all(torch.equal(q, prompt.repeat_interleave(2, 0)) for q in beam_steps)


def test_encoder_decoder_prototype_is_the_encoder_inputs_mean_query():
    model = _bart()
    batches = [ARCH["bart"].batch(seed=s) for s in range(2)]
    want = F.normalize(sum(default_query(model.base_model.model, (), b).sum(0) for b in batches), dim=0)
    torch.testing.assert_close(model.query_prototype(batches), want)


# --- image models -------------------------------------------------------------------------------------------------


def _clip_vision() -> nn.Module:
    config = tf.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4
    )
    torch.manual_seed(0)
    return tf.CLIPVisionModel(config).eval()


def _patch_mean(embedding: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        patches = embedding(pixels)
    patches = patches.flatten(2).mT if patches.dim() == 4 else patches
    return F.normalize(patches.mean(1), dim=-1)


@pytest.mark.parametrize("arch", ["vit", "clip-vision"])
def test_image_models_route_by_the_mean_patch_embedding_without_query_dim(arch):
    base = ARCH["vit"].model() if arch == "vit" else _clip_vision()
    embedding = base.get_input_embeddings()
    model = _pclr(base)
    owner = next(iter(group_layers(model, "default").values()))[0]
    assert owner.keys("default").shape[1] == 32  # the patch embedding's width
    tasks = [torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(s)) + 2 * s for s in range(2)]
    with torch.no_grad():
        model(pixel_values=tasks[0])
    torch.testing.assert_close(_state(model).query, _patch_mean(embedding, tasks[0]))
    protos = [model.query_prototype([{"pixel_values": pixels}]) for pixels in tasks]
    for proto, pixels in zip(protos, tasks):
        torch.testing.assert_close(proto, F.normalize(_patch_mean(embedding, pixels).sum(0), dim=0))
    assert float(protos[0] @ protos[1]) < 0.99  # the prototypes tell the tasks' data apart


# --- feature models without token or patch inputs -----------------------------------------------------------------


class MLP(nn.Module):
    """PEFT's test MLP (tests/test_custom_models.py): called with ``X=`` integer features, cast inside."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0, self.relu, self.lin1 = nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.lin1(self.relu(self.lin0(X.float()))), dim=-1)


def _mlp_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    return {"X": torch.randint(0, 9, (6, 10), generator=torch.Generator().manual_seed(seed))}


@pytest.mark.parametrize("targets", [["lin0", "lin1"], ["lin1"]])
def test_feature_model_routes_by_the_pooled_input_of_its_first_adapted_layer(targets):
    torch.manual_seed(0)
    model = get_peft_model(MLP(), PCLRConfig(target_modules=targets, pool_size=4, ranks_schedule=[2], top_k=2))
    first = getattr(model.base_model.model, targets[0])
    assert first.keys("default").shape[1] == first.in_features  # query_dim inferred: 10, or 20 for lin1 alone
    seen = {}
    first.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    batch = _mlp_batch()
    model.train()
    out = model(**batch)
    torch.testing.assert_close(_state(model).query, F.normalize(seen["x"].float(), dim=-1))
    (out.sum() + model.base_model.query_loss()).backward()  # the keys learn from the query
    assert all(p.grad is None for name, p in model.named_parameters() if "pclr_" not in name)

    protos = [model.query_prototype([_mlp_batch(seed)]) for seed in range(2)]
    with torch.no_grad():
        model.eval()(**_mlp_batch(0))
    torch.testing.assert_close(protos[0], F.normalize(_state(model).query.sum(0), dim=0))
    with torch.no_grad(), routed_as(model, protos[1]):
        model(**batch)
    torch.testing.assert_close(_state(model).query, protos[1].expand(6, -1))  # routed as a task: its prototype


def test_feature_model_runs_the_task_cycle():
    torch.manual_seed(0)
    config = PCLRConfig(target_modules=["lin0", "lin1"], pool_size=6, ranks_schedule=[4, 2], top_k=2)
    model = get_peft_model(MLP(), config)
    for task in range(2):
        batches = [_mlp_batch(seed) for seed in (2 * task, 2 * task + 1)]
        proto = model.query_prototype(batches)
        model.begin_task(task, proto)
        model.end_task(task, proto, batches)
    assert model.finished_tasks() == 2


def test_a_layer_running_before_the_query_layer_is_refused():
    class Reversed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin0, self.lin1 = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin0(self.lin1(x))  # lin1 first, though lin0 comes first in module order

    model = get_peft_model(
        Reversed(), PCLRConfig(target_modules=["lin0", "lin1"], pool_size=4, ranks_schedule=[2], top_k=2)
    )
    with pytest.raises(ValueError, match="first adapted layer 'lin0' is the query, but another PCLR layer ran"):
        model(torch.randn(2, 4))
