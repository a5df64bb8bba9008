"""Continual heads: how a run turns features into class scores, chosen per method with ``head:``.

- ``linear``: the model's linear classifier, trained with each task's logit mask (the default of trained methods);
- ``cosine``: SEQ*'s cosine classifier, earlier classes' rows frozen when a new task starts;
- ``prototype``: SimpleCIL's class means, cosine scores;
- ``lda``: a shared, shrunk covariance (linear discriminant analysis);
- ``analytic``: RanPAC's random ReLU projection and closed-form ridge regression;
- ``aligned``: SLCA's classifier alignment on stored class means and covariances.

docs/continual_heads.md says what each stores, costs and scores on the shipped sequences. A new head is one module
here (every public module of this folder is imported, :mod:`peft_ext.plugins`) or in another package, declared as a
``peft_ext.heads`` entry point: docs/adding_a_head.md.
"""

from __future__ import annotations

from ...plugins import load_plugins
from .aligned import AlignedHead, AlignedOptions
from .analytic import AnalyticHead, AnalyticOptions
from .base import HEADS, ContinualHead, HeadOptions, build_head, classifier_module, head_spec, register_head
from .means import LDAHead, LDAOptions, PrototypeHead
from .trained import CosineClassifier, CosineHead, CosineOptions, LinearHead

# every head module of this folder registers its head; then the ones other packages declare
load_plugins(__name__, __path__, "heads")

__all__ = [
    "HEADS",
    "AlignedHead",
    "AlignedOptions",
    "AnalyticHead",
    "AnalyticOptions",
    "ContinualHead",
    "CosineClassifier",
    "CosineHead",
    "CosineOptions",
    "HeadOptions",
    "LDAHead",
    "LDAOptions",
    "LinearHead",
    "PrototypeHead",
    "build_head",
    "classifier_module",
    "head_spec",
    "register_head",
]
