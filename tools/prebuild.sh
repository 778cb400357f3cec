#!/usr/bin/env bash
# Builds the Python package's extension and the CUDA op tests for sm_90 on this machine (no GPU
# needed) for another machine's Python, into .carry/prebuilt, so that a GPU call can skip its
# build: carry .carry and run `tools/gpu_run.sh prebuilt ...` there.
#   tools/prebuild.sh PYTHON [GTEST_PREFIX]
# PYTHON: the interpreter of the GPU machine's version (with pybind11); GTEST_PREFIX: where
# GoogleTest is installed (default /tmp/gtest). The build folder is /tmp/ggraph-prebuild.
# GGRAPH_CUDA_ATTN_TRACE=ON and GGRAPH_CUDA_STEP_TRACE=ON make measurement builds
# (tools/attn_trace.py, tools/step_trace.py); PREBUILD_BENCH=1
# adds the kernel benchmarks (ggraph_bench_cuda, for gpu_run.sh's kernels stage).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:?usage: tools/prebuild.sh PYTHON [GTEST_PREFIX]}
build=/tmp/ggraph-prebuild
cmake -S . -B "$build" -G Ninja -DGGRAPH_CUDA=ON -DGGRAPH_CUDA_ARCHS=90 -DGGRAPH_BUILD_TESTS=ON \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="${2:-/tmp/gtest}" \
  -DGGRAPH_CUDA_ATTN_TRACE="${GGRAPH_CUDA_ATTN_TRACE:-OFF}" \
  -DGGRAPH_CUDA_STEP_TRACE="${GGRAPH_CUDA_STEP_TRACE:-OFF}" \
  -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$py" >/dev/null
bench=${PREBUILD_BENCH:+ggraph_bench_cuda}
cmake --build "$build" --target _core ggraph_cuda_tests $bench
rm -rf .carry/prebuilt && mkdir -p .carry/prebuilt
cp "$build"/_core*.so "$build"/ggraph_cuda_tests ${bench:+"$build"/$bench} .carry/prebuilt/
strip .carry/prebuilt/*
du -sh .carry/prebuilt
