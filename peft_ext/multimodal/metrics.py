"""Classification metrics of the missing-modality benchmarks: accuracy (Food-101), F1-macro (MM-IMDb), AUROC
(Hateful Memes). Plain NumPy, so the package needs no scikit-learn at run time; the tests compare with it."""

from __future__ import annotations

import numpy as np

__all__ = ["accuracy", "auroc", "f1_macro"]


def _labels(y_true: np.ndarray, y_pred: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    if y_true.shape != y_pred.shape or y_true.ndim != 1 or len(y_true) == 0:
        raise ValueError(
            f"expected two non-empty 1-D label arrays of equal length, got shapes {y_true.shape} and {y_pred.shape}"
        )
    return y_true, y_pred


def accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Fraction of exact matches.

    Args:
        y_true: True class ids.
        y_pred: Predicted class ids.
    """
    y_true, y_pred = _labels(y_true, y_pred)
    return float(np.mean(y_true == y_pred))


def f1_macro(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int | None = None) -> float:
    """Unweighted mean over classes of F1 = 2 TP / (2 TP + FP + FN).

    A class that neither occurs nor is predicted is left out (scikit-learn's ``labels=None`` convention); one that
    occurs or is predicted but has TP = 0 counts as 0.

    Args:
        y_true: True class ids.
        y_pred: Predicted class ids.
        num_classes: If given, classes are ``0..num_classes-1`` (still skipping absent-and-unpredicted ones).
    """
    y_true, y_pred = _labels(y_true, y_pred)
    classes = np.union1d(y_true, y_pred) if num_classes is None else np.arange(num_classes)
    scores = []
    for c in classes:
        tp = np.sum((y_true == c) & (y_pred == c))
        fp = np.sum((y_true != c) & (y_pred == c))
        fn = np.sum((y_true == c) & (y_pred != c))
        if tp + fp + fn == 0:
            continue
        scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores))


def _binary_auroc(positive: np.ndarray, score: np.ndarray) -> float:
    # Mann-Whitney U: the probability that a random positive outscores a random negative, ties counting one half.
    order = np.argsort(score, kind="mergesort")
    sorted_scores = score[order]
    ranks = np.empty(len(score))
    start = 0
    while start < len(score):
        end = start
        while end + 1 < len(score) and sorted_scores[end + 1] == sorted_scores[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def auroc(y_true: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve; for several classes the unweighted one-vs-rest mean over classes present.

    Args:
        y_true: True labels: ``{0, 1}`` for binary ``scores`` of shape ``(n,)``, class ids for ``(n, C)``.
        scores: Positive-class scores ``(n,)`` or class scores / probabilities ``(n, C)``.

    Raises:
        ValueError: If only one class occurs (AUROC is undefined) or the shapes disagree.
    """
    y_true = np.asarray(y_true)
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim == 1:
        if len(scores) != len(y_true) or not np.isin(y_true, (0, 1)).all():
            raise ValueError(f"binary AUROC needs 0/1 labels and one score per label, got {y_true!r}, {scores.shape}")
        positive = y_true == 1
        if positive.all() or not positive.any():
            raise ValueError("AUROC is undefined when only one class occurs in `y_true`")
        return _binary_auroc(positive, scores)
    if scores.ndim != 2 or len(scores) != len(y_true):
        raise ValueError(f"`scores` must be (n,) or (n, C) with n = {len(y_true)}, got {scores.shape}")
    present = [c for c in np.unique(y_true) if 0 <= c < scores.shape[1]]
    if len(present) < 2:
        raise ValueError("AUROC is undefined when only one class occurs in `y_true`")
    return float(np.mean([_binary_auroc(y_true == c, scores[:, c]) for c in present]))
