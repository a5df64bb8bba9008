"""The missing-modality protocol, the metrics, and the committed emoji pairs data set."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from peft_ext.multimodal import (
    MissingSpec,
    accuracy,
    apply_missing,
    auroc,
    blank_image,
    build_emoji_pairs,
    f1_macro,
    load_emoji_pairs,
    missing_masks,
    split_of,
    validation_of,
)
from peft_ext.multimodal.emoji import DEFAULT_FONT, DEFAULT_PATH, DEFAULT_TEST_FILE, parse_emoji_test

FILES = DEFAULT_PATH.parent

# -- protocol ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, n, expected",
    [
        (MissingSpec(0.7, "both"), 100, (35, 35)),
        (MissingSpec(0.7, "text"), 100, (70, 0)),
        (MissingSpec(0.7, "image"), 100, (0, 70)),
        (MissingSpec(0.3, "both", text_share=0.75), 40, (9, 3)),
        (MissingSpec(0.0, "both"), 10, (0, 0)),
        (MissingSpec(1.0, "both"), 7, (4, 3)),
    ],
)
def test_missing_counts_are_exact(spec, n, expected):
    masks = missing_masks(n, spec, seed=0)
    assert (int(masks.text.sum()), int(masks.image.sum())) == expected
    assert not (masks.text & masks.image).any(), "no example may lose both modalities"
    assert int(masks.complete.sum()) == n - sum(expected)


def test_masks_are_deterministic_and_train_test_share_the_rate():
    spec = MissingSpec(0.7, "both")
    a, b = missing_masks(1507, spec, seed=0), missing_masks(1507, spec, seed=0)
    assert np.array_equal(a.text, b.text) and np.array_equal(a.image, b.image)
    other = missing_masks(1507, spec, seed=1)
    assert not np.array_equal(a.text, other.text), "a different seed must draw different examples"
    train, test = missing_masks(1507, spec, seed=0), missing_masks(363, spec, seed=1)
    for masks, n in ((train, 1507), (test, 363)):
        assert abs(masks.text.mean() - 0.35) <= 1 / n and abs(masks.image.mean() - 0.35) <= 1 / n


def test_placeholders_replace_only_the_missing_modality():
    texts = ["cat", "dog", "sun", "car"]
    images = np.arange(4 * 2 * 2 * 3, dtype=np.uint8).reshape(4, 2, 2, 3)
    masks = missing_masks(4, MissingSpec(1.0, "both"), seed=3)
    new_texts, new_images = apply_missing(texts, images, masks)
    for i in range(4):
        assert new_texts[i] == ("" if masks.text[i] else texts[i])
        expected = blank_image((2, 2, 3)) if masks.image[i] else images[i]
        assert np.array_equal(new_images[i], expected)
    assert images[0, 0, 0, 0] == 0, "the input must not be modified"
    assert (blank_image((2, 2, 3)) == 255).all()
    with pytest.raises(ValueError, match="must have the same length"):
        apply_missing(texts[:3], images, masks)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rate": 1.5}, r"`rate` must be a number in \[0, 1\], got 1.5"),
        ({"rate": 0.5, "kind": "audio"}, "`kind` must be one of .*, got 'audio'"),
        ({"rate": 0.5, "text_share": -0.1}, r"`text_share` must be a number in \[0, 1\], got -0.1"),
    ],
)
def test_spec_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MissingSpec(**kwargs)


# -- metrics (hand-worked) --------------------------------------------------------------------------------------------


def test_accuracy_and_f1_macro_on_a_hand_worked_case():
    y_true = np.array([0, 0, 1, 1, 2, 2])
    y_pred = np.array([0, 1, 1, 1, 0, 2])
    assert accuracy(y_true, y_pred) == pytest.approx(4 / 6)
    # class 0: tp 1 fp 1 fn 1 -> 1/2; class 1: tp 2 fp 1 fn 0 -> 4/5; class 2: tp 1 fp 0 fn 1 -> 2/3
    assert f1_macro(y_true, y_pred) == pytest.approx((1 / 2 + 4 / 5 + 2 / 3) / 3)
    # with num_classes=4, class 3 (absent and never predicted) is still left out
    assert f1_macro(y_true, y_pred, num_classes=4) == pytest.approx((1 / 2 + 4 / 5 + 2 / 3) / 3)
    with pytest.raises(ValueError, match="equal length"):
        accuracy(y_true, y_pred[:3])


def test_auroc_on_hand_worked_cases():
    # positives 0.8, 0.4; negatives 0.5, 0.1: pairs (0.8>0.5, 0.8>0.1, 0.4<0.5, 0.4>0.1) -> 3/4
    assert auroc(np.array([1, 0, 1, 0]), np.array([0.8, 0.5, 0.4, 0.1])) == pytest.approx(0.75)
    # a tie counts one half: positive 0.5 vs negative 0.5
    assert auroc(np.array([1, 0]), np.array([0.5, 0.5])) == pytest.approx(0.5)
    # multi-class one-vs-rest: a perfect ranking gives 1
    scores = np.eye(3)[[0, 1, 2, 0]]
    assert auroc(np.array([0, 1, 2, 0]), scores) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="only one class"):
        auroc(np.array([1, 1]), np.array([0.2, 0.3]))


def test_metrics_agree_with_scikit_learn():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, 200)
    logits = rng.normal(size=(200, 5)) + 1.5 * np.eye(5)[y]
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    pred = probs.argmax(1)
    assert f1_macro(y, pred) == pytest.approx(sklearn_metrics.f1_score(y, pred, average="macro"))
    assert auroc(y, probs) == pytest.approx(sklearn_metrics.roc_auc_score(y, probs, multi_class="ovr"))
    binary = (y == 2).astype(int)
    rounded = np.round(probs[:, 2], 1)  # ties
    assert auroc(binary, rounded) == pytest.approx(sklearn_metrics.roc_auc_score(binary, rounded))


# -- data set ---------------------------------------------------------------------------------------------------------


def test_committed_emoji_pairs_shapes_labels_and_license():
    pairs = load_emoji_pairs()
    n = len(pairs)
    assert n == 1870
    assert pairs.images.shape == (n, 32, 32, 3) and pairs.images.dtype == np.uint8
    assert pairs.group_names == [
        "Smileys & Emotion",
        "People & Body",
        "Animals & Nature",
        "Food & Drink",
        "Travel & Places",
        "Activities",
        "Objects",
        "Symbols",
        "Flags",
    ]
    assert len(pairs.subgroup_names) == 99
    assert pairs.group.min() == 0 and pairs.group.max() == 8 and np.bincount(pairs.group).min() > 50
    first = pairs.codepoints.index("1F600")
    assert pairs.names[first] == "grinning face" and pairs.group_names[pairs.group[first]] == "Smileys & Emotion"
    assert pairs.subgroup_names[pairs.subgroup[first]] == "face-smiling"
    # white corners, coloured content: real renderings, not blank
    assert (pairs.images[:, 0, 0] >= 250).all(axis=-1).mean() > 0.5
    assert (pairs.images.reshape(n, -1) < 250).any(axis=1).all()
    # skin-tone variants were dropped, and names are unique per emoji
    assert not any(("1F3FB" <= c <= "1F3FF") for cps in pairs.codepoints for c in cps.split())
    assert len(set(pairs.codepoints)) == n
    for name in ("UNICODE_LICENSE", "NOTO_EMOJI_LICENSE", "EMOJI_README.md"):
        assert (FILES / name).stat().st_size > 500, name
    assert "SIL OPEN FONT LICENSE Version 1.1" in (FILES / "NOTO_EMOJI_LICENSE").read_text()
    assert "UNICODE, INC. LICENSE AGREEMENT" in (FILES / "UNICODE_LICENSE").read_text()


def test_split_is_fixed_and_disjoint():
    train, test = load_emoji_pairs("train"), load_emoji_pairs("test")
    assert len(train) + len(test) == 1870 and set(train.codepoints).isdisjoint(test.codepoints)
    assert all(split_of(c) == "test" for c in test.codepoints)
    assert 0.15 < len(test) / 1870 < 0.25
    assert set(np.unique(test.group)) == set(range(9)), "every group must occur in the test split"
    with pytest.raises(ValueError, match="`split` must be 'train', 'validation', 'test' or None, got 'dev'"):
        load_emoji_pairs("dev")


def test_validation_split_is_a_fixed_carve_out_of_train():
    """About 20% of the train split by a second hash; disjoint from test, and from train when held out; the default
    train split keeps its pairs (existing configs and cached backbones are unchanged)."""
    train, validation, test = load_emoji_pairs("train"), load_emoji_pairs("validation"), load_emoji_pairs("test")
    held_out = load_emoji_pairs("train", hold_out_validation=True)
    assert len(train) == 1507 and len(validation) == 293 and len(held_out) == 1507 - 293
    assert set(validation.codepoints) <= set(train.codepoints)
    assert set(validation.codepoints).isdisjoint(test.codepoints)
    assert set(validation.codepoints).isdisjoint(held_out.codepoints)
    assert set(held_out.codepoints) | set(validation.codepoints) == set(train.codepoints)
    assert set(np.unique(validation.group)) == set(range(9)), "every group must occur in the validation split"
    # an independent recomputation of the rule: bytes 4-7 of the SHA-1 of the code points, mod 100, below 20
    for cps in train.codepoints[:200]:
        value = int.from_bytes(hashlib.sha1(cps.encode("ascii")).digest()[4:8], "big") % 100
        assert validation_of(cps) == (value < 20)
    assert not any(validation_of(c) for c in test.codepoints)
    with pytest.raises(ValueError, match="applies to split='train' only"):
        load_emoji_pairs("test", hold_out_validation=True)


def test_parser_keeps_fully_qualified_and_drops_skin_tones():
    lines = [
        "# group: People & Body",
        "# subgroup: hand-fingers-open",
        "1F44B                                                  ; fully-qualified     # 👋 E0.6 waving hand",
        "1F44B 1F3FB ; fully-qualified # 👋🏻 E1.0 waving hand: light skin tone",
        "263A                                                   ; unqualified         # ☺ E0.6 smiling face",
        "# group: Component",
        "# subgroup: skin-tone",
        "1F3FB                                                  ; component           # 🏻 E1.0 light skin tone",
    ]
    records = parse_emoji_test(lines)
    assert [(r.codepoints, r.name, r.group, r.subgroup) for r in records] == [
        ("1F44B", "waving hand", "People & Body", "hand-fingers-open")
    ]
    assert len(parse_emoji_test(lines, drop_skin_tones=False)) == 2
    with pytest.raises(ValueError, match="comes before a group/subgroup header"):
        parse_emoji_test(lines[2:3])


@pytest.mark.slow
def test_rebuild_equals_committed(tmp_path: Path):
    if not (DEFAULT_TEST_FILE.is_file() and DEFAULT_FONT.is_file()):
        pytest.skip(
            f"needs Debian's unicode-data ({DEFAULT_TEST_FILE}) and fonts-noto-color-emoji ({DEFAULT_FONT}); "
            "apt-get install unicode-data fonts-noto-color-emoji"
        )
    rebuilt = build_emoji_pairs(out=tmp_path / "pairs.npz")
    committed = load_emoji_pairs()
    assert rebuilt.codepoints == committed.codepoints and rebuilt.names == committed.names
    assert np.array_equal(rebuilt.group, committed.group) and np.array_equal(rebuilt.subgroup, committed.subgroup)
    # rendering goes through FreeType/Pillow: allow +-1 levels of resampling difference across versions
    diff = np.abs(rebuilt.images.astype(int) - committed.images.astype(int))
    assert diff.max() <= 1, f"rebuilt images differ from the committed ones by up to {diff.max()} levels"
