#!/usr/bin/env bash
# One call on a GPU machine: build, test and benchmark. Usage: tools/gpu_run.sh [build|test|bench]...
# (default: all three). Logs land in $OUT when set, else build/gpu-logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-build test bench}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader

for stage in $stages; do
  case $stage in
    build)
      start=$(date +%s)
      python3 -m pip install -q --no-build-isolation --no-deps . \
        -Ccmake.define.GGRAPH_CUDA_ARCHS=90 >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
      echo "build: $(($(date +%s) - start)) s"
      cmake -S . -B build/gpu-tests -G Ninja -DGGRAPH_CUDA_ARCHS=90 -DGGRAPH_BUILD_PYTHON=OFF \
        >>"$OUT/build.log" 2>&1 && cmake --build build/gpu-tests -j 16 >>"$OUT/build.log" 2>&1 ||
        { tail -40 "$OUT/build.log"; exit 1; }
      echo "build with tests: $(($(date +%s) - start)) s"
      ;;
    test)
      (cd build/gpu-tests && ctest --output-on-failure -j 4 2>&1 | tail -15) | tee "$OUT/ctest.log"
      python3 -m pytest -q -rs -x --timeout 500 tests/python -k "not smollm2" 2>&1 | tail -25 |
        tee "$OUT/pytest.log"
      ;;
    sanitize)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 1 build/gpu-tests/ggraph_tests \
          --gtest_filter='CudaOps*' >"$OUT/sanitizer-$tool.log" 2>&1
        echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY' "$OUT/sanitizer-$tool.log") summaries)"
        grep 'ERROR SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1
      done
      ;;
    bench)
      python3 -m ggraph.testing /tmp/smollm2-shape.gguf --shape smollm2-135m --type Q4_1 >/dev/null
      python3 -m ggraph.testing /tmp/llama2-7b-shape.gguf --shape llama2-7b --type Q4_0 >/dev/null
      for m in /tmp/smollm2-shape.gguf /tmp/llama2-7b-shape.gguf; do
        python3 -m ggraph bench -m "$m" -p 512 -n 128 -r 5 --device cuda \
          --cuda-graphs off,recapture,update,patch | tee -a "$OUT/bench.md"
      done
      ;;
  esac
done
