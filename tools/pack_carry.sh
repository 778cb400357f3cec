#!/usr/bin/env bash
# Packs the builds one GPU call needs into .carry-pack/ with xz, where .carry's would not fit:
# .carry/prebuilt (tools/prebuild.sh: the package's extension and the CUDA op tests) and,
# optionally, the extension of another build to measure against (REF_DIR holds its _core*.so,
# e.g. a copy of .carry/prebuilt kept from before a change) and of a third one (ALT_DIR; stage
# ab runs all three in turns), and llama.cpp's source where .carry has it. Three 25 MB binaries
# travel as about 16 MB of the call's 64 MiB, four as about 24. Carry .carry-pack and .whl (not
# .carry); `tools/gpu_run.sh unpack` restores them there, and stage ab then measures against
# REF_DIR's (and ALT_DIR's) build without building it.
#   tools/pack_carry.sh [REF_DIR [ALT_DIR]]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .carry/prebuilt ] || { echo "no .carry/prebuilt: run tools/prebuild.sh first" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp -r .carry/prebuilt "$stage"/
if [ -n "${1:-}" ]; then
  mkdir -p "$stage"/ref && cp "$1"/_core*.so "$stage"/ref/
fi
if [ -n "${2:-}" ]; then
  mkdir -p "$stage"/alt && cp "$2"/_core*.so "$stage"/alt/
fi
mkdir -p .carry-pack
tar cf - -C "$stage" . | xz -T0 --lzma2=preset=6,dict=192MiB >.carry-pack/pack.tar.xz
if [ -f .carry/llama.cpp-src.tar.xz ]; then cp .carry/llama.cpp-src.tar.xz .carry-pack/; fi
du -sh .carry-pack
