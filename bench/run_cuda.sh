#!/usr/bin/env bash
# Every CUDA check of hqtflow in one call, for a machine with an FP8 GPU (CI has none). Steps (STEPS, comma-separated,
# default tests,bench,serve):
#   tests  the CUDA tests
#   bench  bench/fp8_cuda.py (PARTS: linear,decode,engine,profile; MODELS, default 1b,8b)
#   serve  bench/serve_load.py --mode streams on a random-weight Llama (SERVE_SIZE, default 1b) made by
#          bench/random_llama.py with the tokenizer in TOKENIZER, measured on TEXT and quantized by hqtflow's own
#          commands: the FP8 server vs the bf16 server vs transformers' generate_batch, all on the GPU
# Logs and JSON go to $OUT (default /tmp/hqtflow-cuda).
#     HQTFLOW_TEST_DATA=../shared/data bash bench/run_cuda.sh
set -u
OUT=${OUT:-/tmp/hqtflow-cuda}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HQTFLOW_CACHE=${HQTFLOW_CACHE:-/tmp/hqtflow-cache}
export HQTFLOW_TEST_DATA=${HQTFLOW_TEST_DATA:-$PWD/../shared/data}
PY=${PYTHON:-python3}
STEPS=,${STEPS:-tests,bench,serve},
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
$PY -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
if [[ $STEPS == *,tests,* ]]; then
  timeout ${TESTS_TIMEOUT:-150} $PY -m pytest -q -p no:cacheprovider ${TESTS:-tests/quantize/test_backends.py tests/runtime/test_cuda_graphs.py} \
      -k "${TESTS_K:-not nothing}" 2>&1 | tee "$OUT/pytest.log" | tail -20
fi
if [[ $STEPS == *,bench,* ]]; then
  timeout ${BENCH_TIMEOUT:-400} $PY bench/fp8_cuda.py --models "${MODELS:-1b,8b}" --parts "${PARTS:-linear,decode,engine}" \
      --ms "${MS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096}" --batches "${BATCHES:-1,8,32}" \
      --decode-modes "${DECODE_MODES:-graph,compiled,eager}" --json "$OUT/fp8_cuda.json" 2>&1 \
      | grep --line-buffered -v Warning | tee "$OUT/bench.log"
fi
if [[ $STEPS == *,serve,* ]]; then
  M=/tmp/hqtflow-serve-${SERVE_SIZE:-1b}
  rm -rf "$M" && mkdir -p "$M"
  ( set -e
    $PY bench/random_llama.py "${SERVE_SIZE:-1b}" "$M/bf16" --tokenizer "${TOKENIZER:?a tokenizer folder}" --device cuda
    $PY -m hqtflow measure "$M/bf16" -o "$M/measure" --text "${TEXT:?a text file}" --limit 8 --max-length 128
    $PY -m hqtflow quantize -m "$M/measure" -o "$M/fp8"
    timeout ${SERVE_TIMEOUT:-300} $PY bench/serve_load.py --mode streams --checkpoint "$M/fp8" --baseline "$M/bf16" --data "$TEXT" \
        --json "$OUT/serve_load.json" ) 2>&1 | grep --line-buffered -v -i "warning\|it/s\]" | tee "$OUT/serve.log"
fi
