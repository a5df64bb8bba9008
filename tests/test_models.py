import pytest
import torch

from peft_ext.models import (
    SentenceClassifier,
    load_text_classifier,
    minilm_path,
    resolve_backbone,
    tiny_bert,
    tiny_clip,
    tiny_llama,
    tiny_qwen2,
    tiny_vit,
)


def _names(model):
    return {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}


def test_tiny_factories_have_the_real_module_names_and_run():
    llama = tiny_llama()
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= _names(llama)
    assert llama(torch.randint(0, 128, (2, 5))).logits.shape == (2, 5, 128)
    qwen2 = tiny_qwen2()
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= _names(qwen2)
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None  # unlike Llama's
    assert qwen2(torch.randint(0, 128, (2, 5))).logits.shape == (2, 5, 128)
    bert = tiny_bert(num_labels=3)
    assert {"query", "key", "value", "dense"} <= _names(bert)
    assert bert(torch.randint(0, 128, (2, 5))).logits.shape == (2, 3)
    vit = tiny_vit(num_labels=10)
    assert vit(torch.randn(2, 3, 16, 16)).logits.shape == (2, 10)
    clip = tiny_clip()
    assert clip.text_model.config.hidden_size != clip.vision_model.config.hidden_size
    out = clip(input_ids=torch.randint(3, 128, (2, 6)), pixel_values=torch.randn(2, 3, 16, 16))
    assert out.logits_per_image.shape == (2, 2)


def test_tiny_factories_are_seeded():
    for factory in (tiny_llama, tiny_qwen2):
        a, b, c = factory(seed=1), factory(seed=1), factory(seed=2)
        pa, pb, pc = (dict(m.named_parameters())["model.layers.0.self_attn.q_proj.weight"] for m in (a, b, c))
        assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_resolve_backbone_keeps_hub_ids_and_paths():
    assert resolve_backbone("bert-base-uncased") == "bert-base-uncased"
    assert resolve_backbone("/some/dir") == "/some/dir"
    assert resolve_backbone("MiniLM") == str(minilm_path())


def test_sentence_classifier_loss_and_masked_pooling():
    model = SentenceClassifier(tiny_bert().bert, num_labels=4, dropout=0.0).eval()
    ids = torch.randint(0, 128, (3, 7))
    mask = torch.ones_like(ids)
    out = model(ids, mask, labels=torch.tensor([0, 1, 3]))
    assert out.logits.shape == (3, 4)
    expected = torch.nn.functional.cross_entropy(out.logits, torch.tensor([0, 1, 3]))
    assert out.loss.item() == pytest.approx(expected.item())
    # padding must not change a sentence's embedding
    padded = torch.cat([ids, torch.zeros(3, 4, dtype=torch.long)], 1)
    pmask = torch.cat([mask, torch.zeros(3, 4, dtype=torch.long)], 1)
    torch.testing.assert_close(model.embed(padded, pmask), model.embed(ids, mask), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_labels"):
        SentenceClassifier(tiny_bert().bert, num_labels=0)


def test_missing_local_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_text_classifier(str(tmp_path), num_labels=2)


def test_minilm_loads_offline_with_real_pretrained_weights():
    model, tok = load_text_classifier("minilm", num_labels=3)
    model.eval()
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6

    def emb(text):
        enc = tok([text], return_tensors="pt")
        with torch.no_grad():
            return torch.nn.functional.normalize(model.embed(enc["input_ids"], enc["attention_mask"]), dim=-1)[0]

    dog, puppy, tax = emb("a young dog"), emb("a puppy playing"), emb("the income tax rate")
    # only trained weights put the paraphrase far closer than the unrelated sentence
    assert dog @ puppy > (dog @ tax) + 0.3


def test_head_initialization_is_seeded_independently_of_global_state():
    torch.manual_seed(1)
    a = SentenceClassifier(tiny_bert().bert, num_labels=4, seed=3)
    torch.manual_seed(2)
    b = SentenceClassifier(tiny_bert().bert, num_labels=4, seed=3)
    c = SentenceClassifier(tiny_bert().bert, num_labels=4, seed=4)
    assert torch.equal(a.classifier.weight, b.classifier.weight) and torch.equal(a.classifier.bias, b.classifier.bias)
    assert not torch.equal(a.classifier.weight, c.classifier.weight)
    assert a.classifier.weight.abs().max() <= 1 / 32**0.5  # nn.Linear's default bound for 32 inputs


def test_a_tokenizer_without_a_pad_token_pads_with_eos_or_is_refused():
    from transformers import AutoTokenizer

    from peft_ext.models import minilm_path
    from peft_ext.models.text import ensure_pad_token

    tok = AutoTokenizer.from_pretrained(minilm_path())
    assert ensure_pad_token(tok, "minilm").pad_token == "[PAD]"  # its own pad token stays
    tok.pad_token = None
    tok.eos_token = "[SEP]"
    with pytest.warns(UserWarning, match=r"no pad token; padding with its end-of-sequence token '\[SEP\]'"):
        assert ensure_pad_token(tok, "m").pad_token == "[SEP]"
    tok.pad_token = None
    tok.eos_token = None
    with pytest.raises(ValueError, match=r"'m' has no pad token and no end-of-sequence token"):
        ensure_pad_token(tok, "m")
