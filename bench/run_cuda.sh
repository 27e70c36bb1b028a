#!/usr/bin/env bash
# Every CUDA check of hqtflow in one call, for a machine with an FP8 GPU (CI has none). Steps (STEPS, comma-separated,
# default tests,bench,serve):
#   tests  the CUDA tests
#   bench  bench/fp8_cuda.py (PARTS: linear,decode,engine,profile; MODELS, default 1b,8b)
#   serve  bench/serve_load.py --mode streams on a random-weight Llama (SERVE_SIZE, default 1b) made by
#          bench/random_llama.py with the tokenizer in TOKENIZER, measured on TEXT and quantized by hqtflow's own
#          commands: the FP8 server vs the bf16 server vs transformers' generate_batch, all on the GPU
# Logs and JSON go to $OUT (default /tmp/hqtflow-cuda). Settings are environment variables (no arguments); the script
# exits non-zero when a step fails (the later steps still run).
#     HQTFLOW_TEST_DATA=../shared/data TOKENIZER=DIR TEXT=FILE bash bench/run_cuda.sh
#     STEPS=tests,bench MODELS=8b bash bench/run_cuda.sh
set -u -o pipefail
if (( $# )); then
  echo "bench/run_cuda.sh takes no arguments, only environment variables (STEPS=, MODELS=, ...: see its header)." >&2
  exit 2
fi
STEPS=,${STEPS:-tests,bench,serve},
if [[ $STEPS == *,serve,* && ( -z ${TOKENIZER:-} || -z ${TEXT:-} ) ]]; then
  echo "The serve step needs TOKENIZER (a tokenizer folder) and TEXT (a text file); set them or leave serve out of STEPS." >&2
  exit 2
fi
OUT=${OUT:-/tmp/hqtflow-cuda}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HQTFLOW_CACHE=${HQTFLOW_CACHE:-/tmp/hqtflow-cache} \
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # nothing outside the machine is reached
export HQTFLOW_TEST_DATA=${HQTFLOW_TEST_DATA:-$PWD/../shared/data}
PY=${PYTHON:-python3}
failed=
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
$PY -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
if [[ $STEPS == *,tests,* ]]; then
  # The tests' CPU-side layers quantize their weights through the CPU kernel, whose first build on a machine is not
  # quick (2026-12-04, an H200's host: the first test had not started after 150 s): built first, on its own clock.
  t=$SECONDS
  timeout ${BUILD_TIMEOUT:-600} $PY -c "from hqtflow.quantize import cpu_kernel; print('CPU kernel:', cpu_kernel.build_error() or 'built')"
  echo "CPU kernel ready after $((SECONDS - t)) s"
  # the CPU-written tests that run on the GPU here too: the static decoder's CLI paths (a CUDA graph on CUDA)
  timeout ${TESTS_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider ${TESTS:-tests/quantize/test_backends.py \
      tests/runtime/test_cuda_graphs.py tests/runtime/test_static_decode.py::test_generate_engines_cli \
      tests/runtime/test_kv_cache.py::test_cli_kv_cache_paths} \
      -k "${TESTS_K:-not nothing}" 2>&1 | tee "$OUT/pytest.log" | tail -20 || failed+=" tests"
fi
if [[ $STEPS == *,bench,* ]]; then
  timeout ${BENCH_TIMEOUT:-400} $PY bench/fp8_cuda.py --models "${MODELS:-1b,8b}" --parts "${PARTS:-linear,decode,engine}" \
      --ms "${MS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096}" --batches "${BATCHES:-1,8,32}" \
      --decode-modes "${DECODE_MODES:-graph,compiled,eager}" --json "$OUT/fp8_cuda.json" 2>&1 \
      | { grep --line-buffered -v Warning || true; } | tee "$OUT/bench.log" || failed+=" bench"
fi
if [[ $STEPS == *,serve,* ]]; then
  M=/tmp/hqtflow-serve-${SERVE_SIZE:-1b}
  rm -rf "$M" && mkdir -p "$M"
  ( set -e
    $PY bench/random_llama.py "${SERVE_SIZE:-1b}" "$M/bf16" --tokenizer "$TOKENIZER" --device cuda
    $PY -m hqtflow measure "$M/bf16" -o "$M/measure" --text "$TEXT" --limit 8 --max-length 128
    $PY -m hqtflow quantize -m "$M/measure" -o "$M/fp8"
    timeout ${SERVE_TIMEOUT:-300} $PY bench/serve_load.py --mode streams --checkpoint "$M/fp8" --baseline "$M/bf16" --data "$TEXT" \
        --json "$OUT/serve_load.json" ) 2>&1 | { grep --line-buffered -v -i "warning\|it/s\]" || true; } \
      | tee "$OUT/serve.log" || failed+=" serve"
fi
if [[ -f $OUT/pytest.log ]]; then  # the tests' summary again, last: a caller keeping only the log's tail still sees it
  echo "tests:"; grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/pytest.log" | tail -15
fi
if [[ -n $failed ]]; then
  echo "bench/run_cuda.sh: failed:$failed (logs in $OUT)." >&2
  exit 1
fi
