#!/usr/bin/env bash
# Decode and prefill speed of ember and llama.cpp (node-llama-cpp 3.21.1's prebuilt CPU build) on the
# same GGUF files and threads, in alternating rounds: `ember bench decode --checkpoint gguf:FILE`
# (the file's block-quantized weights used as stored) against experiments/llama_cpp_speed.mjs.
#
#     experiments/decode_vs_llama_cpp.sh [ROUNDS] FILE.gguf...
#
# Needs target/release/ember (cargo build --release -p ember-cli) and node-llama-cpp under
# $EMBER_NODE_MODULES (default target/node/node_modules, where .ci/run installs it). Each round
# measures, per file: a 8-token prompt then 128 greedy tokens (decode), and a 512-token prompt
# (prefill) then 32 tokens; 2 threads each (RAYON_NUM_THREADS for ember). Prints one line per
# measurement; peak RSS of ember's runs from /usr/bin/time.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
shift || true
[ $# -gt 0 ] || { echo "usage: $0 [ROUNDS] FILE.gguf..." >&2; exit 2; }
export EMBER_NODE_MODULES=${EMBER_NODE_MODULES:-target/node/node_modules}
THREADS=2
lscpu | grep -E 'Model name|^CPU\(s\)'
lscpu | grep -o -E 'avx2|avx512f|avx512_vnni|avx_vnni|avx512_bf16|amx_bf16' | sort -u | tr '\n' ' ' || true; echo
for round in $(seq 1 "$ROUNDS"); do
  for f in "$@"; do
    name=$(basename "$f")
    for shape in "8 128" "512 32"; do
      read -r ctx new <<< "$shape"
      out=$( { RAYON_NUM_THREADS=$THREADS /usr/bin/time -f 'rss_kb %M' target/release/ember bench decode \
        --checkpoint "gguf:$f" --contexts "$ctx" --new-tokens "$new" --uncached-tokens 0 --log warn; } 2>&1 )
      line=$(echo "$out" | grep 'context' | sed 's/  */ /g')
      rss=$(echo "$out" | grep rss_kb | awk '{print $2}')
      echo "round $round $name ctx $ctx: ember $line rss ${rss} KB"
      echo "round $round $name ctx $ctx: llama.cpp $(node experiments/llama_cpp_speed.mjs "$f" $THREADS "$ctx" "$new")"
    done
  done
done
