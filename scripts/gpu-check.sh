#!/usr/bin/env bash
# The GPU checks of ember (issue 18), for a machine with an NVIDIA GPU and no network, in under 8
# minutes. It needs only a prebuilt `ember` binary with the `cuda` feature (no Rust toolchain), the
# repository's configs, and tinyshakespeare's input.txt. Build the binary where Rust is:
#
#   cargo build --release -p ember-cli --features cuda && strip -o ember-cuda target/release/ember
#
# and run, on the GPU machine, from the repository root:
#
#   scripts/gpu-check.sh [./ember-cuda] [DATA_DIR]      # DATA_DIR holds tinyshakespeare/input.txt
#
# Steps, each with its own time limit (seconds, in brackets), in this order: the GPU and driver;
# the backend checks of the test suite on CUDA [90]; the bf16 GEMM peak [45]; the GPT-2-small-sized
# training step in bf16 [60] and f32 [60]; nanoGPT's shakespeare_char setting [200, stopped there
# if not done: the best validation loss so far is reported]; decode time per token [30]. A failed
# step stops the script (the backend checks failing means nothing after them can be trusted), and the
# summary says which. Everything goes to gpu-check.log; the last line of the log (and of stdout) is
# a JSON summary with each figure beside its target.
#
# DEVICE=cpu QUICK=1 scripts/gpu-check.sh target/release/ember  runs the same flow on tiny settings
# on the CPU, to check the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
EMBER=${1:-./ember-cuda}
export EMBER_DATA_DIR=${2:-${EMBER_DATA_DIR:-datasets}}
export EMBER_CACHE_DIR=${EMBER_CACHE_DIR:-$PWD/.gpu-cache}
export RUST_LOG=${RUST_LOG:-info}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
LOG=gpu-check.log
OUT=$(mktemp -d)
: > "$LOG"
STARTED=$(date +%s)

log() { echo "$*" | tee -a "$LOG"; }
# run NAME LIMIT CMD...: runs CMD with a time limit, its stdout kept in $OUT/NAME.out, both streams
# in the log; returns CMD's exit status (124 on timeout).
run() {
  local name=$1 limit=$2; shift 2
  log ""; log "== $name (limit ${limit}s) =="; log "\$ $*"
  local t0; t0=$(date +%s.%N)
  timeout "$limit" "$@" > "$OUT/$name.out" 2> >(tee -a "$LOG" >&2)
  local rc=$?
  cat "$OUT/$name.out" >> "$LOG"
  log "exit $rc after $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
  return $rc
}
# num FILE KEY: the first number after "KEY": in FILE (ember's JSON; of an array, its first), or null.
num() { grep -o "\"$2\":\[\?[-0-9.eE+]*" "$1" 2>/dev/null | head -1 | cut -d: -f2 | tr -d '[' | grep . || echo null; }
FAILED=null
fail() { FAILED="\"$1\""; summary; exit 1; }

GPT2=configs/gpt2-small.toml
SIZES=2048,4096,8192
# A checkpoint every 250 steps, so that a run stopped by its time limit still has one to decode from.
SHAKESPEARE=$OUT/shakespeare.toml
sed -e 's/^checkpoint_interval = .*/checkpoint_interval = 250/' configs/shakespeare-gpu.toml > "$SHAKESPEARE"
if [ "$QUICK" = 1 ]; then
  GPT2=configs/nano.toml
  SIZES=256,512
  sed -i -e 's/^max_steps = .*/max_steps = 20/' -e 's/^eval_interval = .*/eval_interval = 10/' \
      -e 's/^eval_iters = .*/eval_iters = 2/' -e 's/^batch_size = .*/batch_size = 4/' \
      -e 's/^checkpoint_interval = .*/checkpoint_interval = 10/' "$SHAKESPEARE"
fi

summary() {
  local peak bf16_tps bf16_mfu f32_tps f32_mfu best wall decode gpu
  gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 | sed 's/"//g')
  peak=$(num "$OUT/peak.out" peak_flops)
  bf16_tps=$(num "$OUT/gpt2-bf16.out" tokens_per_sec); bf16_mfu=$(num "$OUT/gpt2-bf16.out" mfu)
  f32_tps=$(num "$OUT/gpt2-f32.out" tokens_per_sec); f32_mfu=$(num "$OUT/gpt2-f32.out" mfu)
  best=null
  if [ -f runs/gpu-check-shakespeare/metrics.jsonl ]; then
    best=$(grep -o '"val_loss":[0-9.eE+-]*' runs/gpu-check-shakespeare/metrics.jsonl | cut -d: -f2 | sort -g | head -1)
    best=${best:-null}
  fi
  wall=$(cat "$OUT/shakespeare.secs" 2>/dev/null || echo null)
  decode=$(num "$OUT/decode.out" cached_ms_per_token)
  local checks=null
  [ -f "$OUT/check.out" ] && checks="{\"passed\":$(grep -c '"passed":true' "$OUT/check.out"),\"failed\":$(grep -c '"passed":false,"skipped":false' "$OUT/check.out"),\"skipped\":$(grep -c '"skipped":true' "$OUT/check.out")}"
  local faster=null
  if [ "$bf16_tps" != null ] && [ "$f32_tps" != null ]; then
    faster=$(awk -v a="$bf16_tps" -v b="$f32_tps" 'BEGIN { print (a > b) ? "true" : "false" }')
  fi
  local line
  line=$(printf '{"gpu":"%s","device":"%s","quick":%s,"failed_step":%s,"elapsed_s":%s,"backend_checks":%s,"gemm_peak_bf16_flops":%s,"gpt2_bf16":{"tokens_per_sec":%s,"mfu":%s,"target_mfu":0.40},"gpt2_f32":{"tokens_per_sec":%s,"mfu":%s},"bf16_faster_than_f32":{"value":%s,"target":true},"shakespeare":{"best_val_loss":%s,"target":1.50,"nanogpt":1.4697,"wall_s":%s},"decode_ms_per_token":%s}' \
    "${gpu:-unknown}" "$DEVICE" "$([ "$QUICK" = 1 ] && echo true || echo false)" "$FAILED" "$(( $(date +%s) - STARTED ))" \
    "$checks" "$peak" "$bf16_tps" "$bf16_mfu" "$f32_tps" "$f32_mfu" "$faster" "$best" "$wall" "$decode")
  log ""; log "$line"
}

log "== machine =="
date -u | tee -a "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
"$EMBER" backends 2>&1 | tee -a "$LOG" || fail "binary"

run check 90 "$EMBER" check --device "$DEVICE" --json || fail "backend checks"
run peak 45 "$EMBER" bench peak --device "$DEVICE" --dtype bf16 --sizes "$SIZES" --reps 5 --json || fail "GEMM peak"
run gpt2-bf16 60 "$EMBER" bench train --config "$GPT2" --device "$DEVICE" --precision bf16 --steps 10 --warmup 3 --json || fail "GPT-2 bf16 step"
run gpt2-f32 60 "$EMBER" bench train --config "$GPT2" --device "$DEVICE" --precision f32 --steps 5 --warmup 2 --json || fail "GPT-2 f32 step"
rm -rf runs/gpu-check-shakespeare
t0=$(date +%s)
run shakespeare 200 "$EMBER" train --config "$SHAKESPEARE" --device "$DEVICE" --run-dir runs/gpu-check-shakespeare
rc=$?
echo $(( $(date +%s) - t0 )) > "$OUT/shakespeare.secs"
# A timeout still leaves the evaluations so far; anything else is a failure.
[ $rc -eq 0 ] || [ $rc -eq 124 ] || fail "shakespeare training"
if [ -f runs/gpu-check-shakespeare/checkpoints/latest ]; then
  run decode 30 "$EMBER" bench decode --checkpoint runs/gpu-check-shakespeare --contexts 16,64,128,200 --new-tokens 32 --device "$DEVICE" --json || fail "decode"
fi
summary
