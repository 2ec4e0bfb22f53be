#!/usr/bin/env bash
# Two ember binaries on the same workloads, alternating, on the same cores: the step-time side of a
# change that must not change speed (experiments/architecture.md).
#
#   experiments/ab_speed.sh BEFORE_BINARY AFTER_BINARY [ROUNDS]
#
# Prints one line a run: round, workload, which binary, tokens/s and the median step (ms). Run from
# the repository root with the dataset in place (datasets/tinyshakespeare/input.txt, or
# EMBER_DATA_DIR). With SMOL set to a run imported from SmolLM2-135M-Instruct (`ember import
# <the shared GGUF> --out DIR`), each round also decodes 64 tokens at a 64-token context with both
# (`ember bench decode`: tokens/s and ms a token).
set -euo pipefail
before=$1 after=$2 rounds=${3:-3}
workloads=(
  "nano|--config configs/nano.toml --steps 100 --warmup 10"
  "moe|--config configs/bench-cpu-moe.toml --steps 20 --warmup 3"
  "large|--config configs/bench-cpu-large.toml --steps 20 --warmup 3"
  "lora-f32|--config configs/smollm2-135m-lora.toml --steps 3 --warmup 2 --precision f32"
  "lora-bf16|--config configs/smollm2-135m-lora.toml --steps 3 --warmup 2 --precision bf16"
)
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"{d['tokens_per_sec']:.1f} {d['step_ms']:.2f}\")"; }
for round in $(seq 1 "$rounds"); do
  for w in "${workloads[@]}"; do
    name=${w%%|*} args=${w#*|}
    # Alternate which binary goes first, so that neither always runs on a warmer machine.
    if (( round % 2 )); then order=("before $before" "after $after"); else order=("after $after" "before $before"); fi
    for entry in "${order[@]}"; do
      which=${entry%% *} bin=${entry#* }
      # shellcheck disable=SC2086
      out=$(taskset -c 0,1 "$bin" bench train $args --json 2>/dev/null | field)
      echo "$round $name $which $out"
    done
  done
  if [ -n "${SMOL:-}" ]; then
    for entry in "${order[@]}"; do
      which=${entry%% *} bin=${entry#* }
      out=$(taskset -c 0,1 "$bin" bench decode --checkpoint "$SMOL" --contexts 64 --new-tokens 64 \
        --uncached-tokens 0 --json 2>/dev/null \
        | python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"{d['decode_tokens_per_sec'][0]:.1f} {d['cached_ms_per_token'][0]:.2f}\")")
      echo "$round decode $which $out"
    done
  fi
done
