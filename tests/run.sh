#!/usr/bin/env bash
# Builds and runs every test: the Python package (pytest) and the C++ suites (ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}

"$PY" -m pip install -q ".[test]"

# The C++ suites build for one CUDA architecture: enough to compile every kernel.
cmake -S . -B build/tests -G Ninja -DGGRAPH_BUILD_TESTS=ON -DGGRAPH_BUILD_PYTHON=OFF \
  -DGGRAPH_CUDA_ARCHS="${GGRAPH_TEST_CUDA_ARCHS:-90}" -DPython3_EXECUTABLE="$(command -v "$PY")" \
  >/dev/null
cmake --build build/tests -j "$JOBS"
ctest --test-dir build/tests --output-on-failure -j "$JOBS"

"$PY" -m pytest -q -rs tests/python
