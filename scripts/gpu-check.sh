#!/usr/bin/env bash
# The GPU checks of ember, for a machine with an NVIDIA GPU and no network (issue 7). It needs only a
# prebuilt `ember` binary with the `cuda` feature (no Rust toolchain), the repository's configs, and
# tinyshakespeare's input.txt. Build the binary where Rust is:
#
#   cargo build --release -p ember-cli --features cuda && strip -o ember-cuda target/release/ember
#
# and run, on the GPU machine, from the repository root:
#
#   scripts/gpu-check.sh [./ember-cuda] [DATA_DIR]      # DATA_DIR holds tinyshakespeare/input.txt
#
# It prints the GPU, runs the backend checks of the test suite on CUDA (`ember check`), the GEMM peak,
# the training benchmark of a GPT-2-small-sized model in bf16 and f32, and the nanoGPT shakespeare_char
# setting (5000 steps), and writes everything to gpu-check.log. Budget: about ten minutes of GPU time.
set -uo pipefail
cd "$(dirname "$0")/.."
EMBER=${1:-./ember-cuda}
export EMBER_DATA_DIR=${2:-${EMBER_DATA_DIR:-datasets}}
export EMBER_CACHE_DIR=${EMBER_CACHE_DIR:-$PWD/.gpu-cache}
export RUST_LOG=${RUST_LOG:-info}
LOG=gpu-check.log
: > "$LOG"
step() { echo; echo "== $* =="; } 2>&1
run() { echo "\$ $*"; timeout "${TIMEOUT:-300}" "$@"; echo "exit $?"; }
{
  step "machine"
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$EMBER" backends
  step "backend checks on CUDA (causality, cached decoding, tiled loss, training in f32/f16/bf16)"
  run "$EMBER" check --device cuda
  step "GEMM peak"
  run "$EMBER" bench peak --device cuda --dtype bf16 --sizes 2048,4096,8192 --reps 5
  step "GPT-2-small-sized model, bf16 (MFU against the table's dense bf16 peak)"
  run "$EMBER" bench train --config configs/gpt2-small.toml --device cuda --steps 10 --warmup 3 --json
  step "GPT-2-small-sized model, f32 (the bf16 step must be faster)"
  run "$EMBER" bench train --config configs/gpt2-small.toml --device cuda --precision f32 --steps 5 --warmup 2 --json
  step "nanoGPT shakespeare_char setting: 5000 steps, best val loss (target 1.50)"
  TIMEOUT=420 run "$EMBER" train --config configs/shakespeare-gpu.toml --device cuda --run-dir runs/shakespeare-gpu --no-progress
  step "decode speed"
  run "$EMBER" bench decode --checkpoint runs/shakespeare-gpu --contexts 16,64,128,200 --new-tokens 32 --device cuda
} 2>&1 | tee -a "$LOG"
