"""Our model loads print no transformers load report or progress bar, but still say when weights were missing."""

from __future__ import annotations

import logging

import pytest
from transformers import AutoModel, BertConfig, BertModel
from transformers.utils import logging as hf_logging

from peft_ext.models import load_pretrained_quietly, load_text_classifier
from peft_ext.multimodal.dual_encoder import build_dual_encoder


def _assert_quiet(text: str) -> None:
    assert "LOAD REPORT" not in text and "UNEXPECTED" not in text
    assert "\x1b[" not in text, "ANSI escapes on the console"
    assert "Loading weights" not in text, "progress bar"


def test_minilm_loads_print_nothing(capfd, caplog):
    """The dual encoder drops MiniLM's pooler (transformers reports its weights as UNEXPECTED, in colour)."""
    bar_before = hf_logging.is_progress_bar_enabled()
    filters_before = list(logging.getLogger("transformers.modeling_utils").filters)
    build_dual_encoder("minilm", vision_layers=1, vision_width=32, vision_heads=2, embed_dim=16)
    load_text_classifier("minilm", num_labels=3)
    out, err = capfd.readouterr()
    _assert_quiet(out + err + caplog.text)  # under pytest, transformers' log records reach caplog, not the console
    assert hf_logging.is_progress_bar_enabled() == bar_before
    assert logging.getLogger("transformers.modeling_utils").filters == filters_before


def test_missing_weights_still_warn_in_one_line(tmp_path, capfd, caplog):
    config = BertConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    BertModel(config, add_pooling_layer=False).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"2 weights of BertModel .*newly initialized: pooler\.dense\.bias") as rec:
        model = load_pretrained_quietly(AutoModel, str(tmp_path))
    assert len(rec) == 1 and "\n" not in str(rec[0].message)
    assert model.pooler is not None
    _assert_quiet("".join(capfd.readouterr()) + caplog.text)
