"""The benchmarks: one script per comparison, run from the repository root as ``python -m benchmarks.NAME``.

``python -m benchmarks.run_all`` runs every one at its report size and writes docs/benchmarks.md. The code the
scripts share (the protocol, the run cache, the table writer, the interleaved timer, the machine line, the common
options) is the package :mod:`benchmarks._lib`; no script imports another. Not part of the installed wheel.
"""
