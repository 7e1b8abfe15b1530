#!/usr/bin/env bash
# fxremat against what users pick today, on one CUDA GPU: a thin wrapper around benchmarks/gpu_check.py,
# whose docstring says what it measures; knobs (PYTHON, TOTAL_S, REPS, ...): `bash benchmarks/gpu_check.sh --help`.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; about 5-8 minutes on an H100/H200
#   GPU_CHECK_ALLOW_CPU=1 LAYERS=1 HIDDEN=64 HEADS=4 SEQ=64 BATCH=2 VOCAB=256 bash benchmarks/gpu_check.sh  # smoke
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
# gpu_check.py sets these too (and WORK, TORCHINDUCTOR_CACHE_DIR, the knobs' defaults) for its subprocesses.
export TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0   # every row really compiles
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
unset FXREMAT_BUDGET || true
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
