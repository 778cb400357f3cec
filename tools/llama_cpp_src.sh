#!/usr/bin/env bash
# Makes .carry/llama.cpp-src.tar.xz, the llama.cpp source that `tools/gpu_run.sh llamacpp` builds
# llama-bench and llama-batched-bench from on the GPU machine, out of the llama-cpp-python source
# distribution on PyPI (which vendors llama.cpp): only what those two tools and the CUDA and CPU
# backends need, about 2.5 MB.
#   tools/llama_cpp_src.sh [VERSION]
# VERSION: a llama-cpp-python release (default: the newest). The work folder is /tmp/llama-cpp-src.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=/tmp/llama-cpp-src
rm -rf "$work" && mkdir -p "$work"
# The sdist's address from the package index's simple page (pip download would build the
# package's metadata first).
url=$(python3 - "${1:-}" <<'PY'
import re
import sys
import urllib.request

page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
links = {}
for href in re.findall(r'href="([^"]+)"', page):
    m = re.search(r"llama_cpp_python-([0-9]+(?:\.[0-9]+)*)\.tar\.gz", href)
    if m:
        links[m.group(1)] = href.split("#")[0]
want = sys.argv[1] or max(links, key=lambda v: tuple(int(x) for x in v.split(".")))
print(links[want])
PY
)
echo "from $url"
python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" \
  "$url" "$work/sdist.tar.gz"
tar xzf "$work/sdist.tar.gz" -C "$work" --wildcards '*/vendor/llama.cpp/*'
mv "$work"/*/vendor/llama.cpp "$work/llama.cpp"
cd "$work/llama.cpp"
rm -rf .git app benches ci conversion docs examples gguf-py grammars media models pocs requirements \
  scripts skills tests ./*.py
find tools -mindepth 1 -maxdepth 1 ! -name llama-bench ! -name batched-bench \
  ! -name CMakeLists.txt -exec rm -rf {} +
# Backends other than CUDA and the CPU's (each is built only when its option is on).
find ggml/src -mindepth 1 -maxdepth 1 -type d -name 'ggml-*' ! -name ggml-cuda ! -name ggml-cpu \
  -exec rm -rf {} +
cd "$work"
mkdir -p "$root/.carry"
tar cf - llama.cpp | xz -6 -T1 >"$root/.carry/llama.cpp-src.tar.xz"
ls -l "$root/.carry/llama.cpp-src.tar.xz"
