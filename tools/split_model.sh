#!/usr/bin/env bash
# Cuts a model file into pieces small enough to travel to a GPU machine one call at a time:
# .pieces/NAME.partNN of at most MIB MiB each (default 45) and .pieces/NAME.sha256, which
# tools/gpu_run.sh puts back together there. Usage: tools/split_model.sh FILE NAME [MIB]
# NAME is smol (GGRAPH_SMOLLM2) or gemma3 (GGRAPH_GEMMA3); .pieces/ is kept out of git.
set -euo pipefail
file=$1 name=$2 mib=${3:-45}
cd "$(dirname "$0")/.."
mkdir -p .pieces
rm -f .pieces/"$name".part*
split -b "${mib}M" -d -a 2 "$file" ".pieces/$name.part"
sha256sum <"$file" | cut -d' ' -f1 >".pieces/$name.sha256"
ls -l .pieces/"$name".*
