#!/usr/bin/env bash
# Prepared GPU check for the Triton kernels; not run yet (no GPU has been lent to this project so far).
#
# On one H100/H200, from the repository root:   bash benchmarks/gpu_check.sh
# Budget: under 5 minutes (install ~1 min if the dependencies are missing, tests ~1 min, benchmark ~1-2 min).
# It installs the package against the machine's own torch (pip keeps an installed torch that satisfies torch>=2.4),
# runs the gpu-marked tests and the sm_80/sm_90 compile tests, then the benchmark with --check, which prints the
# kernel speedup (target >= 3x), bandwidth fraction (target >= 60% of peak) and retraction time vs the step
# estimate (target < 10%). Set PYTHON to choose the interpreter; PEAK_GBPS to override the bandwidth peak.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
status=0

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "no CUDA device visible to torch"; exit 1; }

echo "== install"
if ! "$PY" -c "import peft_ext, triton, pytest" 2>/dev/null; then
    # the package and its dependencies from the registry; torch is already satisfied and stays as it is
    timeout 120 "$PY" -m pip install -q -e . pytest || {
        echo "pip install failed (offline?); trying the source tree as it is"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    }
fi
"$PY" -c "import peft_ext, triton; print('peft_ext', peft_ext.__version__, 'triton', triton.__version__)" || exit 1

echo "== tests (gpu-marked + ahead-of-time compilation)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TRITON_DEFAULT_FP_FUSION=1
timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_kernels_triton.py -k "gpu or compile" || status=1

echo "== benchmark"
timeout 180 "$PY" -m benchmarks.kernel_speed --device cuda --check ${PEAK_GBPS:+--peak-gbps "$PEAK_GBPS"} || status=1
exit $status
