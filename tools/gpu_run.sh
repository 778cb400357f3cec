#!/usr/bin/env bash
# One call on a GPU machine: build, test and benchmark. Usage: tools/gpu_run.sh STAGE...
# Stages: build (or unpack and prebuilt, or prebuilt), test (or quicktest), sanitize, golden,
# bench, kernels, sweep, profile, steps, attntrace, steptrace, llamacpp, refbench, batchbench, ab,
# abenv.
# Logs land in $OUT (default build/gpu-logs). BUILD_TARGETS limits build to those targets (e.g.
# "_core ggraph" for the Python package alone).
# GoogleTest is built from .carry/googletest when the machine has none; the real SmolLM2 and
# Gemma 3 270M files may arrive in pieces over several calls (`tools/split_model.sh`, then carry
# .pieces/NAME.partNN and .pieces/NAME.sha256; see assemble below). llama.cpp's source for the
# reference benchmarks comes as .carry/llama.cpp-src.tar.xz (tools/llama_cpp_src.sh makes it).
# REFBENCH_MODELS may name /tmp/gemma3-shape.gguf: Gemma 3 270M's shape and formats, random
# weights (tools/gemma3_shape.py), made there.
# DEPTHS (default 0) are the context depths that bench and refbench measure at, MODES (default
# off,recapture,update,patch) the CUDA graph modes bench runs. The ab stage builds the package
# of another commit (.carry/ref.tar, from `git archive COMMIT`; or takes the extension that
# stage unpack installed, built elsewhere: tools/pack_carry.sh) beside this one and runs tg128
# of AB_MODELS (default the SmolLM2 and 7B Q4_0 shapes; /tmp/llama2-7b-q4km.gguf and
# /tmp/gemma3-shape.gguf are made too when named) on both, in turns, at each of AB_DEPTHS
# (default "0 0,4096": the second entry measures depth 0 in a cache sized for 4,096 tokens more),
# AB_ROUNDS times (default 2), with AB_ARGS added to each bench (e.g. "--kv-type q8_0"); with
# AB_BATCH (batch sizes, e.g. "32,64"), decode batches instead (tools/batch_bench.py --tg 32). The
# abenv stage does the same within this build: tg128 as built against tg128 with the settings
# AB_ENV names (e.g. "GGRAPH_CUDA_ROPE_EPILOGUE=0"; several sides separated by ';'), in turns.
# Both stages print the gen128 rows (the generation loop) beside the tg128 ones.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUILD=/tmp/ggraph-gpu-build
JOBS=${JOBS:-$(nproc)}
if [ -d .whl ]; then
  # One at a time: a wheel built for another Python (pyyaml) must not stop the others.
  for w in .whl/*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null
  done
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=/tmp/ggraph-py${PYTHONPATH:+:$PYTHONPATH}
# A real model file too large for one call arrives as pieces, one or more a call on a warm
# machine: .pieces/NAME.partNN, with .pieces/NAME.sha256 naming the whole; the pieces collect in
# /tmp until they make /tmp/NAME.gguf.
assemble() {
  local name=$1 part
  for part in .pieces/"$name".part*; do [ -f "$part" ] && cp "$part" /tmp/; done
  if [ -f ".pieces/$name.sha256" ] && [ ! -f "/tmp/$name.gguf" ]; then
    cat /tmp/"$name".part* >"/tmp/$name-assembling" 2>/dev/null
    if [ "$(sha256sum <"/tmp/$name-assembling" | cut -d' ' -f1)" = "$(cat ".pieces/$name.sha256")" ]; then
      mv "/tmp/$name-assembling" "/tmp/$name.gguf"
    fi
  fi
}
assemble smol
assemble gemma3
[ -f /tmp/smol.gguf ] && export GGRAPH_SMOLLM2=/tmp/smol.gguf
[ -f /tmp/gemma3.gguf ] && export GGRAPH_GEMMA3=/tmp/gemma3.gguf
LLAMA_CPP=/tmp/llama.cpp-build
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# Makes the random-weight shape files among the paths given that do not exist yet.
make_shape_files() {
  local spec name shape type
  for spec in smollm2-shape:smollm2-135m:Q4_1 llama2-7b-shape:llama2-7b:Q4_0 \
    llama2-7b-q4km:llama2-7b:Q4_K_M llama3-1b-f16:llama3-1b:F16 llama3-8b-shape:llama3-8b:Q4_0; do
    IFS=: read -r name shape type <<<"$spec"
    case " $* " in *" /tmp/$name.gguf "*)
      [ -f "/tmp/$name.gguf" ] || python3 -m ggraph.testing "/tmp/$name.gguf" \
        --shape "$shape" --type "$type" --seed 1 >/dev/null ;;
    esac
  done
  case " $* " in *" /tmp/gemma3-shape.gguf "*)
    [ -f /tmp/gemma3-shape.gguf ] || python3 tools/gemma3_shape.py /tmp/gemma3-shape.gguf ;;
  esac
}

# tg128 of AB_MODELS (made here when they are shape files) at each of AB_DEPTHS, AB_ROUNDS times,
# under each side's settings in turns. Arguments: LABEL SETTINGS pairs, SETTINGS a space-separated
# list of VAR=value (empty: none).
ab_turns() {
  local models=${AB_MODELS:-/tmp/smollm2-shape.gguf /tmp/llama2-7b-shape.gguf} round m d i
  local sides=("$@")
  make_shape_files $models
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for m in $models; do
      if [ -n "${AB_BATCH:-}" ]; then
        for ((i = 0; i < ${#sides[@]}; i += 2)); do
          echo "round $round, ${sides[i]}, $(basename "$m"), -b $AB_BATCH" | tee -a "$OUT/ab.md"
          # shellcheck disable=SC2086  # the settings, one word each
          env ${sides[i + 1]} python3 tools/batch_bench.py -m "$m" -b "$AB_BATCH" --tg 32 \
            --device cuda 2>&1 | grep -E "^\| [0-9]|Error|error" | tee -a "$OUT/ab.md"
        done
        continue
      fi
      for d in ${AB_DEPTHS:-0 0,4096}; do
        for ((i = 0; i < ${#sides[@]}; i += 2)); do
          echo "round $round, ${sides[i]}, $(basename "$m"), -d $d" | tee -a "$OUT/ab.md"
          # shellcheck disable=SC2086  # the settings, one word each
          env ${sides[i + 1]} python3 -m ggraph bench -m "$m" -p 0 -n 128 -r 5 --device cuda \
            -d "$d" --allow-longer-context --cuda-graphs patch ${AB_ARGS:-} 2>&1 |
            grep -E "tg128|gen128|Error|error" | tee -a "$OUT/ab.md"
        done
      done
    done
  done
}

# The Python package at DEST (default /tmp/ggraph-py) from the sources and DIR's extension (and
# its C library, where DIR has one). Arguments: DIR [DEST].
install_package() {
  local dest=${2:-/tmp/ggraph-py}
  rm -rf "$dest" && mkdir -p "$dest"/ggraph/lib
  cp python/ggraph/*.py "$dest"/ggraph/ && cp "$1"/_core*.so "$dest"/ggraph/
  if [ -f "$1"/libggraph.so ]; then cp "$1"/libggraph.so "$dest"/ggraph/lib/; fi
}

# Waits (at most 450 s) for the llama.cpp build that stage llamacpp started, if it did.
wait_llama_cpp() {
  [ -f /tmp/llama.cpp-build.log ] || return 0
  for _ in $(seq 90); do [ -f $LLAMA_CPP/done ] && break; sleep 5; done
}

for stage in "$@"; do
  s=$(date +%s)
  case $stage in
    build)
      if [ -d .carry/googletest ] && [ ! -d /tmp/gtest ]; then
        cmake -S .carry/googletest -B /tmp/gtest-build -DBUILD_GMOCK=OFF -G Ninja \
          -DCMAKE_INSTALL_PREFIX=/tmp/gtest -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
          cmake --build /tmp/gtest-build -j "$JOBS" >>"$OUT/build.log" 2>&1 &&
          cmake --install /tmp/gtest-build >>"$OUT/build.log" 2>&1
      fi
      cmake -S . -B "$BUILD" -G Ninja -DGGRAPH_CUDA=ON -DGGRAPH_CUDA_ARCHS=90 \
        -DGGRAPH_BUILD_TESTS=ON -DCMAKE_PREFIX_PATH=/tmp/gtest \
        -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
        -DPython_EXECUTABLE="$(command -v python3)" >>"$OUT/build.log" 2>&1 &&
        cmake --build "$BUILD" -j "$JOBS" ${BUILD_TARGETS:+--target $BUILD_TARGETS} \
          >>"$OUT/build.log" 2>&1 ||
        { grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1; }
      install_package "$BUILD"
      ;;
    unpack)
      # The builds tools/pack_carry.sh packed into .carry-pack (carried instead of .carry): the
      # prebuilt package and op tests (then stage prebuilt), llama.cpp's source, and a reference
      # build's extension, installed as stage ab's reference (with this tree's Python files).
      mkdir -p .carry && tar xJf .carry-pack/pack.tar.xz -C .carry
      if [ -f .carry-pack/llama.cpp-src.tar.xz ]; then cp .carry-pack/llama.cpp-src.tar.xz .carry/; fi
      if [ -d .carry/ref ]; then install_package .carry/ref /tmp/ref-py; fi
      if [ -d .carry/alt ]; then install_package .carry/alt /tmp/alt-py; fi
      ;;
    prebuilt)
      # The package and the CUDA op tests (and the kernel benchmarks, where built) made on another
      # machine for this one's Python (tools/prebuild.sh, carried as .carry/prebuilt): no build
      # here.
      install_package .carry/prebuilt
      mkdir -p "$BUILD"
      for f in .carry/prebuilt/ggraph_*; do  # none where only the package travels
        if [ -f "$f" ]; then cp "$f" "$BUILD"/ && chmod +x "$BUILD/$(basename "$f")"; fi
      done
      ;;
    test)
      "$BUILD"/ggraph_cuda_tests 2>&1 | tail -4 | tee "$OUT/op-suite.log"
      # The products' kernels that only a switch selects here: the one-row-block warp kernel, the
      # wide half tiles' mma.sync kernel (the warpgroup kernel's, on sm_90).
      for setting in GGRAPH_CUDA_MMQ_WARP_PERSIST=0 GGRAPH_CUDA_MMQ_WGMMA=0; do
        env $setting "$BUILD"/ggraph_cuda_tests --gtest_filter='CudaOps.MulMat*' 2>&1 | tail -2 |
          sed "s/^/$setting: /" | tee -a "$OUT/op-suite.log"
      done
      python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_cuda_graphs.py \
        tests/python/test_cuda_backend.py tests/python/test_archs.py 2>&1 |
        tee "$OUT/pytest-cuda.log" | tail -30
      ;;
    quicktest)
      # The op suite but the products' long sweep (CudaOps.MulMat*), and the CUDA Python tests:
      # about 100 s, for a change that leaves the product kernels alone.
      "$BUILD"/ggraph_cuda_tests --gtest_filter='-CudaOps.MulMat*' >"$OUT/op-suite.log" 2>&1
      grep -E '^\[  (PASSED|FAILED) ' "$OUT/op-suite.log"
      grep -B3 -A12 'Failure' "$OUT/op-suite.log" | head -60
      python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_cuda_graphs.py \
        tests/python/test_cuda_backend.py tests/python/test_archs.py 2>&1 |
        tee "$OUT/pytest-cuda.log" | tail -5
      ;;
    golden)
      python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_golden.py \
        tests/python/test_gemma3_golden.py tests/python/test_generate.py 2>&1 |
        tee "$OUT/pytest-golden.log" | tail -15
      ;;
    sanitize)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 "$BUILD"/ggraph_cuda_tests \
          --gtest_filter="${SANITIZE_FILTER:--CudaOps.OutOfMemory*}" >"$OUT/sanitizer-$tool.log" 2>&1
        echo "compute-sanitizer $tool: exit $?; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
          "$OUT/sanitizer-$tool.log" | tail -1)"
      done
      ;;
    bench)
      make_shape_files /tmp/smollm2-shape.gguf /tmp/llama2-7b-shape.gguf
      for m in /tmp/smollm2-shape.gguf /tmp/llama2-7b-shape.gguf; do
        # Random weights: past the shape's training context only the speed means anything.
        python3 -m ggraph bench -m "$m" -p 512 -n 128 -r 5 --device cuda -d "${DEPTHS:-0}" \
          --allow-longer-context --cuda-graphs "${MODES:-off,recapture,update,patch}" 2>&1 | tee -a "$OUT/bench.md"
      done
      ;;
    kernels)
      # KERNELS names the sections (matvec, decode, matmul, gemm, attention, launch, barrier,
      # cluster); all by default.
      "$BUILD"/ggraph_bench_cuda ${KERNELS:-} 2>&1 | tee "$OUT/kernels.log" | tail -${KERNELS_TAIL:-30}
      ;;
    sweep)
      # ggraph_bench_cuda's KERNELS sections (default decode) under each of SWEEP's settings in
      # turn (space-separated VAR=value, "-" for none), SWEEP_ROUNDS times (default 2), rows
      # matching SWEEP_GREP (default the half products'), e.g. SWEEP="- GGRAPH_CUDA_MMQ_SPLITS=4"
      # BENCH_TYPES=Q4_0 BENCH_COLS=32,64.
      for round in $(seq "${SWEEP_ROUNDS:-2}"); do
        for setting in ${SWEEP:?sweep needs SWEEP}; do
          echo "round $round, $setting" | tee -a "$OUT/sweep.md"
          # shellcheck disable=SC2086  # the sections, one word each
          env ${setting/#-/X=} "$BUILD"/ggraph_bench_cuda ${KERNELS:-decode} 2>&1 |
            grep -E "${SWEEP_GREP:-\| half \|}" | tee -a "$OUT/sweep.md"
        done
      done
      ;;
    profile)
      # Nsight Compute's view of one launch of each kernel named in PROFILE (';'-separated
      # regular expressions over demangled names; default: the 4096x11008 mat-vecs' kernels).
      IFS=';' read -ra kernels <<<"${PROFILE:-mat_vec_q_kernel<\\(int\\)2, \\(int\\)1, \\(int\\)4, \\(int\\)2, \\(int\\)2>;mat_vec_q_kernel<\\(int\\)8, \\(int\\)1, \\(int\\)2, \\(int\\)2, \\(int\\)4>}"
      for i in "${!kernels[@]}"; do
        ncu --clock-control none --kernel-name-base demangled -k "regex:${kernels[$i]}" \
          --launch-skip 10 --launch-count 1 --kill yes --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
          --section SchedulerStats --section WarpStateStats --section SourceCounters \
          "$BUILD"/ggraph_bench_cuda ${KERNELS:-} >"$OUT/profile-$i.txt" 2>&1
        grep -E "^  [a-z]|Duration|DRAM Throughput|Memory Throughput|Registers|Achieved Occ|Issued Warp|No Eligible|Warp Cycles Per Issued|Theoretical Occ|Block Limit" \
          "$OUT/profile-$i.txt" | head -24
      done
      ;;
    steps)
      # Each kernel of one warm decode step of STEP_MODELS (default the SmolLM2 and 7B Q4_0
      # shapes) at STEP_PAST tokens of context, with its stall reasons (tools/kernel_times.py;
      # STEP_ARGS adds its options, e.g. "--kv-type q8_0").
      models=${STEP_MODELS:-/tmp/smollm2-shape.gguf /tmp/llama2-7b-shape.gguf}
      make_shape_files $models
      for m in $models; do
        echo "## $(basename "$m"), past ${STEP_PAST:-64}" | tee -a "$OUT/steps.md"
        # shellcheck disable=SC2086  # the options, one word each
        python3 tools/kernel_times.py "$m" --warm --stalls --past "${STEP_PAST:-64}" ${STEP_ARGS:-} 2>&1 |
          tee -a "$OUT/steps.md" | head -${STEPS_HEAD:-40}
      done
      ;;
    attntrace)
      # The decode attention's phases per launch (tools/attn_trace.py) of TRACE_MODELS (default
      # the SmolLM2 shape) at each of TRACE_DEPTHS (default 0 1900 4096), one bench each (its own
      # cache size), with TRACE_ENV set (e.g. GGRAPH_CUDA_ATTN_CLUSTER=0). Needs a measurement
      # build: GGRAPH_CUDA_ATTN_TRACE=ON tools/prebuild.sh, then stage prebuilt. TRACE_ARGS are
      # added to the bench (e.g. "--kv-type q8_0").
      tmodels=${TRACE_MODELS:-/tmp/smollm2-shape.gguf}
      make_shape_files $tmodels
      for m in $tmodels; do
        for d in ${TRACE_DEPTHS:-0 1900 4096}; do
          log="$OUT/attntrace-$(basename "$m" .gguf)-d$d.txt"
          # shellcheck disable=SC2086  # the settings, one word each
          env ${TRACE_ENV:-} python3 -m ggraph bench -m "$m" -p 0 -n 128 -r 2 --device cuda -d "$d" \
            --allow-longer-context --cuda-graphs patch ${TRACE_ARGS:-} >"$log" 2>&1
          echo "## $(basename "$m"), depth $d ${TRACE_ENV:-} ${TRACE_ARGS:-}" | tee -a "$OUT/attntrace.md"
          python3 tools/attn_trace.py "$log" 2>&1 | tee -a "$OUT/attntrace.md"
        done
      done
      ;;
    steptrace)
      # A decode step's critical path kernel by kernel (tools/step_trace.py) of STRACE_MODELS
      # (default the 7B Q4_0 shape) at each of STRACE_DEPTHS (default 0 4096), with STRACE_ARGS
      # added to the bench (e.g. "--kv-type q8_0") and STRACE_ENV set (e.g. PYTHONPATH=/tmp/alt-py
      # where stage unpack installed the measurement build as the third one). Needs a measurement
      # build: GGRAPH_CUDA_STEP_TRACE=ON tools/prebuild.sh, then stage prebuilt.
      smodels=${STRACE_MODELS:-/tmp/llama2-7b-shape.gguf}
      make_shape_files $smodels
      for m in $smodels; do
        for d in ${STRACE_DEPTHS:-0 4096}; do
          log="$OUT/steptrace-$(basename "$m" .gguf)-d$d.txt"
          # shellcheck disable=SC2086  # the options, one word each
          env ${STRACE_ENV:-} python3 -m ggraph bench -m "$m" -p 0 -n 32 -r 1 --device cuda \
            -d "$d" --allow-longer-context --cuda-graphs patch ${STRACE_ARGS:-} >"$log" 2>&1
          echo "## $(basename "$m"), depth $d ${STRACE_ARGS:-}" | tee -a "$OUT/steptrace.md"
          grep "tg32" "$log" | tee -a "$OUT/steptrace.md"
          python3 tools/step_trace.py "$log" --order "${STRACE_ORDER:-12}" 2>&1 |
            tee -a "$OUT/steptrace.md"
        done
      done
      ;;
    llamacpp)
      # Builds llama.cpp's llama-bench and llama-batched-bench (CUDA, this GPU) in the
      # background, in a session of its own so that it outlives this call on a warm machine, at
      # the lowest priority (JOBS=N leaves cores to stages measured beside it).
      if [ ! -x $LLAMA_CPP/bin/llama-bench ] && [ -f .carry/llama.cpp-src.tar.xz ]; then
        rm -rf /tmp/llama.cpp-src && mkdir -p /tmp/llama.cpp-src
        tar xJf .carry/llama.cpp-src.tar.xz -C /tmp/llama.cpp-src
        printf 'add_subdirectory(llama-bench)\nadd_subdirectory(batched-bench)\n' \
          >/tmp/llama.cpp-src/llama.cpp/tools/CMakeLists.txt
        setsid nohup nice -n 19 bash -c "cmake -S /tmp/llama.cpp-src/llama.cpp -B $LLAMA_CPP -G Ninja \
          -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
          -DLLAMA_BUILD_APP=OFF && cmake --build $LLAMA_CPP -j $JOBS --target llama-bench \
          llama-batched-bench && touch $LLAMA_CPP/done" >/tmp/llama.cpp-build.log 2>&1 &
        echo "llama.cpp build started"
      fi
      ;;
    refbench)
      # ggraph bench and llama-bench on the same files: $REFBENCH_MODELS (space-separated
      # paths; default: the Gemma 3 file when present and a 7B-shape Q4_K_M random file). The
      # shape files are made here when named. Both engines run after llama.cpp's build, so that
      # neither competes with the compiler for the host. REFBENCH_ARGS are added to ggraph's bench
      # and REFBENCH_LLAMA_ARGS to llama-bench's (e.g. "--kv-type q8_0" and "-ctk q8_0 -ctv q8_0").
      models=${REFBENCH_MODELS:-"${GGRAPH_GEMMA3:-} /tmp/llama2-7b-q4km.gguf"}
      make_shape_files $models
      wait_llama_cpp
      for m in $models; do
        python3 -m ggraph bench -m "$m" -p 512 -n 128 -r 5 --device cuda -d "${DEPTHS:-0}" \
          --allow-longer-context --cuda-graphs "${MODES:-off,patch}" ${REFBENCH_ARGS:-} 2>&1 |
          tee -a "$OUT/refbench.md"
      done
      if [ -f $LLAMA_CPP/done ]; then
        for m in $models; do
          $LLAMA_CPP/bin/llama-bench -m "$m" -p 512 -n 128 -r 5 -ngl 99 -fa 1 \
            -d "${DEPTHS:-0}" ${REFBENCH_LLAMA_ARGS:-} 2>&1 |
            tee -a "$OUT/refbench.md"
        done
      else
        tail -20 /tmp/llama.cpp-build.log
      fi
      ;;
    batchbench)
      # Aggregate decode of B sequences stepped together (tools/batch_bench.py), then
      # llama-batched-bench on the same files (after llama.cpp's build; stage llamacpp starts
      # it): BATCH_MODELS (default the 7B Q4_0 and SmolLM2 shapes), BATCH_SIZES (1,8,32,64).
      bmodels=${BATCH_MODELS:-/tmp/llama2-7b-shape.gguf /tmp/smollm2-shape.gguf}
      make_shape_files $bmodels
      for m in $bmodels; do
        python3 tools/batch_bench.py -m "$m" -b "${BATCH_SIZES:-1,8,32,64}" --device cuda 2>&1 |
          tee -a "$OUT/batchbench.md"
      done
      wait_llama_cpp
      if [ -f $LLAMA_CPP/done ]; then
        for m in $bmodels; do
          $LLAMA_CPP/bin/llama-batched-bench -m "$m" -c 17000 -b 2048 -ub 512 -ngl 99 -fa 1 \
            -npp 128 -ntg 128 -npl "${BATCH_SIZES:-1,8,32,64}" 2>&1 | grep -E "^\|" |
            tee -a "$OUT/batchbench.md"
        done
      fi
      ;;
    ab)
      if [ ! -f /tmp/ref-py/ggraph/__init__.py ]; then
        rm -rf /tmp/ref-src && mkdir -p /tmp/ref-src && tar xf .carry/ref.tar -C /tmp/ref-src
        cmake -S /tmp/ref-src -B /tmp/ref-build -G Ninja -DGGRAPH_CUDA=ON -DGGRAPH_CUDA_ARCHS=90 \
          -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
          -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/ref-build.log" 2>&1 &&
          cmake --build /tmp/ref-build -j "$JOBS" >>"$OUT/ref-build.log" 2>&1 ||
          { grep -E "error|FAILED" "$OUT/ref-build.log" | head -30; exit 1; }
        mkdir -p /tmp/ref-py/ggraph/lib && cp /tmp/ref-src/python/ggraph/*.py /tmp/ref-py/ggraph/
        cp /tmp/ref-build/_core*.so /tmp/ref-py/ggraph/ && cp /tmp/ref-build/libggraph.so /tmp/ref-py/ggraph/lib/
      fi
      # A third build packed as .carry/alt (tools/pack_carry.sh REF_DIR ALT_DIR) takes its turns
      # too.
      alt=()
      if [ -f /tmp/alt-py/ggraph/__init__.py ]; then alt=(alt "PYTHONPATH=/tmp/alt-py:/tmp/site"); fi
      ab_turns this "PYTHONPATH=/tmp/ggraph-py:/tmp/site" ref "PYTHONPATH=/tmp/ref-py:/tmp/site" \
        ${alt[@]+"${alt[@]}"}
      ;;
    abenv)
      # AB_ENV may name several sides, separated by ';'.
      IFS=';' read -ra envs <<<"${AB_ENV:?abenv needs AB_ENV}"
      sides=(built "")
      for e in "${envs[@]}"; do sides+=("$e" "$e"); done
      ab_turns "${sides[@]}"
      ;;
  esac
  echo "== $stage: $(($(date +%s) - s)) s"
done
