#!/usr/bin/env bash
# One pass of the CUDA backend's checks on a GPU machine: build for this GPU's architecture, the
# CUDA op suite, compute-sanitizer memcheck and racecheck on a reduced suite, the kernel
# benchmark, the Python CUDA-vs-CPU model tests and `ggraph bench` on random-weight models.
# Logs and a summary table go to $OUT (default /tmp/ggraph-device-check).
#
#   tools/device_check.sh [--quick]     (--quick: build and op suite only)
#
# Needs CMake, nvcc and Python with pybind11 and numpy. GoogleTest comes from the system, or
# is built from a source tree at .carry/googletest (copied from /usr/src/googletest).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ggraph-device-check}
mkdir -p "$OUT"
BUILD=${GGRAPH_BUILD_DIR:-/tmp/ggraph-build}
ARCHS=${GGRAPH_CUDA_ARCHS:-90}
BUDGET=${GGRAPH_CHECK_SECONDS:-400}  # stop starting new steps past this many seconds
JOBS=$(nproc)
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
T0=$(date +%s)
SUMMARY="$OUT/summary.md"
echo "| step | result | seconds |" >"$SUMMARY"
echo "|---|---|---|" >>"$SUMMARY"

elapsed() { echo $(($(date +%s) - T0)); }

# step NAME LOG LIMIT CMD...: runs CMD with a time limit, appending to LOG; records the result.
step() {
  local name=$1 log=$2 limit=$3
  shift 3
  if [ "$(elapsed)" -ge "$BUDGET" ]; then
    echo "| $name | skipped (time budget) | 0 |" >>"$SUMMARY"
    return 1
  fi
  local left=$((BUDGET + 15 - $(elapsed)))
  [ "$limit" -gt "$left" ] && limit=$left
  local s=$(date +%s)
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local result="ok"
  [ $rc -ne 0 ] && result="FAILED (rc $rc)"
  [ $rc -eq 124 ] && result="TIMED OUT"
  echo "| $name | $result | $(($(date +%s) - s)) |" >>"$SUMMARY"
  echo "=== $name: $result" >>"$log"
  return $rc
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  nvcc --version | tail -1
  python3 --version
} >"$OUT/build.log" 2>&1

# GoogleTest
GTEST_ARGS=()
if [ -d .carry/googletest ]; then
  step gtest "$OUT/build.log" 120 bash -c "cmake -S .carry/googletest -B /tmp/gtest-build \
    -DBUILD_GMOCK=OFF -DCMAKE_INSTALL_PREFIX=/tmp/gtest -DCMAKE_BUILD_TYPE=Release -G Ninja \
    && cmake --build /tmp/gtest-build -j $JOBS && cmake --install /tmp/gtest-build"
  GTEST_ARGS=(-DCMAKE_PREFIX_PATH=/tmp/gtest)
fi

PYBIND=$(python3 -m pybind11 --cmakedir 2>/dev/null)
# Newer host compilers warn where the project's CI compiler does not (redundant-move): keep
# those warnings visible but not fatal here.
CONFIGURE=(cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGRAPH_CUDA=ON
  -DGGRAPH_CUDA_ARCHS="$ARCHS" -DGGRAPH_BUILD_TESTS=ON -DCMAKE_CXX_FLAGS=-Wno-error=redundant-move
  "${GTEST_ARGS[@]}")
step configure "$OUT/build.log" 120 "${CONFIGURE[@]}" -DGGRAPH_BUILD_PYTHON=ON \
  -Dpybind11_DIR="$PYBIND" -DPython_EXECUTABLE="$(command -v python3)" ||
  step configure-without-python "$OUT/build.log" 120 "${CONFIGURE[@]}" -DGGRAPH_BUILD_PYTHON=OFF
step build "$OUT/build.log" 300 cmake --build "$BUILD" -j "$JOBS" --target ggraph_cuda_tests \
  ggraph_bench_cuda || { cat "$SUMMARY"; exit 1; }
HAVE_PY=0
step build-python "$OUT/build.log" 200 cmake --build "$BUILD" -j "$JOBS" --target _core && HAVE_PY=1

step op-suite "$OUT/tests.log" 240 "$BUILD/ggraph_cuda_tests"
# The alternatives kept for comparison: plain launches (no programmatic dependent launch) and
# the 32-deep tensor-core tiles.
step op-suite-nopdl-bk32 "$OUT/tests.log" 120 env GGRAPH_CUDA_PDL=0 \
  GGRAPH_CUDA_MMA_BK=32 "$BUILD/ggraph_cuda_tests" --gtest_filter='CudaOps.MulMat*:CudaOps.Decoder*'
if [ "$QUICK" = 0 ]; then
  step kernel-bench "$OUT/bench.log" 150 "$BUILD/ggraph_bench_cuda"
  step kernel-bench-nopdl-bk32 "$OUT/bench.log" 150 env GGRAPH_CUDA_PDL=0 \
    GGRAPH_CUDA_MMA_BK=32 "$BUILD/ggraph_bench_cuda"

  if [ "$HAVE_PY" = 1 ]; then
    # The package from the source tree with the freshly built extension beside it.
    rm -rf /tmp/ggraph-py && mkdir -p /tmp/ggraph-py && cp -r python/ggraph /tmp/ggraph-py/
    cp "$BUILD"/_core*.so /tmp/ggraph-py/ggraph/
    export PYTHONPATH=/tmp/ggraph-py
    step pytest-cuda "$OUT/model.log" 180 python3 -m pytest -q -rs -p no:cacheprovider \
      tests/python/test_cuda_backend.py
    step gguf-smollm2-shape "$OUT/model.log" 120 python3 -m ggraph.testing /tmp/smol.gguf \
      --shape smollm2-135m --type Q4_1 --seed 1
    step bench-smollm2-shape "$OUT/model.log" 120 python3 -m ggraph.bench -m /tmp/smol.gguf \
      -p 512 -n 128 -r 5 --device cuda --cuda-graphs off
    [ "${GGRAPH_CHECK_SKIP_7B:-0}" = 1 ] ||
      step gguf-llama2-7b-shape "$OUT/model.log" 150 python3 -m ggraph.testing /tmp/l7b.gguf \
      --shape llama2-7b --type Q4_0 --seed 1
    [ "${GGRAPH_CHECK_SKIP_7B:-0}" = 1 ] ||
      step bench-llama2-7b-shape "$OUT/model.log" 150 python3 -m ggraph.bench -m /tmp/l7b.gguf \
      -p 512 -n 128 -r 3 --device cuda --cuda-graphs off
  fi

  # The whole suite under memcheck; racecheck on the kernels that share memory between threads.
  # (less the out-of-memory test, whose refused cudaMalloc memcheck reports as an API error)
  step memcheck "$OUT/sanitizer.log" 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$BUILD/ggraph_cuda_tests" --gtest_filter='-CudaOps.OutOfMemory*'
  RACE_FILTER='CudaOps.RmsNorm*:CudaOps.Attention*:CudaOps.MulMat*:CudaOps.Decoder*'
  step racecheck "$OUT/sanitizer.log" 200 compute-sanitizer --tool racecheck \
    --racecheck-report all --error-exitcode 9 "$BUILD/ggraph_cuda_tests" \
    --gtest_filter="$RACE_FILTER"
fi

{
  echo
  echo "## op suite"
  grep -E "^\[  (PASSED|FAILED) |^\[==========\]|Failure|Expected|Which is|CUDA vs|error:" \
    "$OUT/tests.log" | head -60
  if [ -f "$OUT/bench.log" ]; then
    echo
    echo "## kernels"
    grep -vE "^===" "$OUT/bench.log"
  fi
  if [ -f "$OUT/model.log" ]; then
    echo
    echo "## models"
    grep -E "^\||passed|failed|Error|assert" "$OUT/model.log" | head -40
  fi
  if [ -f "$OUT/sanitizer.log" ]; then
    echo
    echo "## sanitizer"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|=== " "$OUT/sanitizer.log" | head -20
  fi
  echo
  echo "total seconds: $(elapsed)"
} >>"$SUMMARY"
cat "$SUMMARY"
