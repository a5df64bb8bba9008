"""The benchmarks: one script per comparison, run from the repository root as ``python -m benchmarks.NAME``.

``python -m benchmarks.run_all`` runs every one at its report size and writes docs/benchmarks.md. The code the
scripts share (the protocol, the run cache, the table writer, the interleaved timer, the machine line, the common
options) is the package :mod:`benchmarks._lib`; no script imports another. Not part of the installed wheel.
"""

import os

# Every script loads local models and data only: a run never reaches for the Hugging Face hub (set either variable
# to 0 to allow it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
