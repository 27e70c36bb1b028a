#!/usr/bin/env bash
# Every CUDA check of hqtflow in one call, for a machine with an FP8 GPU (CI has none): the CUDA tests, then
# bench/fp8_cuda.py. Logs and the bench's JSON go to $OUT (default /tmp/hqtflow-cuda).
#     HQTFLOW_TEST_DATA=../shared/data bash bench/run_cuda.sh [MODELS, default 1b,8b]
set -u
OUT=${OUT:-/tmp/hqtflow-cuda}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HQTFLOW_CACHE=${HQTFLOW_CACHE:-/tmp/hqtflow-cache}
export HQTFLOW_TEST_DATA=${HQTFLOW_TEST_DATA:-$PWD/../shared/data}
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
$PY -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/quantize/test_backends.py tests/runtime/test_cuda_graphs.py -k "${TESTS_K:-not nothing}" \
    2>&1 | tee "$OUT/pytest.log" | tail -20
timeout ${BENCH_TIMEOUT:-400} $PY bench/fp8_cuda.py --models "${1:-1b,8b}" --ms "${MS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096}" --json "$OUT/fp8_cuda.json" 2>&1 \
    | grep --line-buffered -v Warning | tee "$OUT/bench.log"
