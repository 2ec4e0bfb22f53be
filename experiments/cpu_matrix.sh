#!/usr/bin/env bash
# The CPU speed table of issue 56 in one command: each training workload beside PyTorch
# (bench_vs_torch.py, finetune_vs_transformers.py), ember's `--precision bf16` beside its f32
# (`ember bench train`, the two alternating), and the speedrun's time to val 1.70 beside nano's
# (speedrun.sh); then the table (cpu_matrix_summary.py) under the machine's lscpu model and flags.
#
#   experiments/cpu_matrix.sh OUT_DIR [ROWS]      ROWS: comma list of nano,large,lora,full,gemma,speedrun (default all)
#
# Env: PYTHON (a Python with torch, transformers and peft; default python3), EMBER (default
# target/release/ember), ROUNDS (3; also the speedrun's seeds, 1337 on, unless SEEDS is set),
# THREADS (2), DRY=1 (print every command, run none). Run from the repository root with the dataset
# in place (datasets/tinyshakespeare/input.txt, or EMBER_DATA_DIR). The fine-tune configs have random
# weights of the models' shapes (no init_from): no model file is needed.
#
# Each round runs every workload once (as ab_speed.sh does), so that a slow spell of the shared
# machine falls on both sides of a comparison; odd rounds run the side by side first and f32 before
# bf16, even rounds the other way round. The side-by-side scripts pin themselves to the first
# THREADS CPUs of this process; `ember bench train` and speedrun.sh are pinned here to the same CPUs.
#
# OUT_DIR gets lscpu.txt, machine.txt, every run's stdout (<row>-torch-r<N>.json,
# <row>-transformers-r<N>.txt, <row>-ember-{f32,bf16}-r<N>.json, speedrun.txt and speedrun/) with
# its stderr beside it (.log), and summary.md. A run that fails is reported and the others go on;
# the summary leaves it out of its row and says how many rounds counted.
set -euo pipefail
out=${1:?usage: experiments/cpu_matrix.sh OUT_DIR [ROWS]}
rows=${2:-nano,large,lora,full,gemma,speedrun}
python=${PYTHON:-python3} ember=${EMBER:-target/release/ember} rounds=${ROUNDS:-3} threads=${THREADS:-2}
for row in ${rows//,/ }; do
  case $row in nano|large|lora|full|gemma|speedrun) ;; *) echo "unknown row $row (nano,large,lora,full,gemma,speedrun)" >&2; exit 1 ;; esac
done
selected() { [[ ",$rows," == *",$1,"* ]]; }
# The CPUs the side-by-side scripts take: the first $threads of this process's.
cpus=$(python3 -c "import os; print(','.join(map(str, sorted(os.sched_getaffinity(0))[:$threads])))")

declare -A config=([nano]=configs/nano.toml [large]=configs/bench-cpu-large.toml
  [lora]=configs/smollm2-135m-lora.toml [full]=configs/smollm2-135m-full.toml [gemma]=configs/gemma3-270m-lora.toml)
# Timed and untimed steps of each run, the same for ember alone and side by side (cpu-speed.md's).
declare -A steps=([nano]="--steps 30 --warmup 5" [large]="--steps 10 --warmup 5"
  [lora]="--steps 3 --warmup 2" [full]="--steps 3 --warmup 2" [gemma]="--steps 3 --warmup 2")

# run FILE CMD...: CMD with its stdout in OUT_DIR/FILE and its stderr in OUT_DIR/FILE's name with
# .log; a failure is printed and the matrix goes on.
run() {
  local file=$1 log=${1%.*}.log
  shift
  if [ -n "${DRY:-}" ]; then printf '%q ' "$@"; echo "> $out/$file 2> $out/$log"; return; fi
  echo "$(date +%T) $file"
  "$@" > "$out/$file" 2> "$out/$log" || { local rc=$?; echo "$(date +%T) $file failed (exit $rc): see $out/$log"; }
}

if [ -n "${DRY:-}" ]; then
  echo "lscpu > $out/lscpu.txt"
  echo "# $out/machine.txt: lscpu's model name, family, model and flags; threads and CPUs ($cpus); date;"
  echo "# git rev-parse HEAD; $ember --version; torch, transformers and peft versions of $python"
else
  [ -x "$ember" ] || { echo "no $ember: cargo build --release -p ember-cli, or EMBER=PATH" >&2; exit 1; }
  mkdir -p "$out"
  lscpu > "$out/lscpu.txt"
  field() { awk -F': *' -v key="$1" '$1 == key { print $2; exit }' "$out/lscpu.txt"; }
  flags=" $(field Flags) " has=""
  for f in avx2 fma avx512f avx512_bf16 avx512_vnni avx_vnni amx_bf16 amx_tile amx_int8; do
    [[ $flags == *" $f "* ]] && has+="$f "
  done
  {
    echo "model name: $(field 'Model name')"
    echo "cpu family: $(field 'CPU family')"
    echo "model: $(field Model)"
    echo "flags: ${has% }"
    echo "threads: $threads (CPUs $cpus of $(nproc))"
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' with uncommitted changes')"
    echo "ember: $("$ember" --version 2>&1)"
    echo "python: $("$python" -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers",
      transformers.__version__, "peft", peft.__version__)' 2>&1 | tail -n 1)"
  } > "$out/machine.txt"
  cat "$out/machine.txt"
fi

# ember f32 against PyTorch f32 for workload $w in round $r: torch_reference.py's model for the
# pretraining configs, transformers (+ peft for [lora]) for the fine-tunes. One round a call: the
# rounds are this script's.
side() {
  local c=${config[$w]} s=${steps[$w]}
  # shellcheck disable=SC2086
  case $w in
    nano|large) run "$w-torch-r$r.json" "$python" experiments/bench_vs_torch.py --config "$c" --ember "$ember" \
      --threads "$threads" --rounds 1 $s --json ;;
    *) run "$w-transformers-r$r.txt" "$python" experiments/finetune_vs_transformers.py --config "$c" \
      --ember "$ember" --threads "$threads" --precisions f32 --rounds 1 $s ;;
  esac
}
# ember alone at precision $1, on the threads and CPUs the side-by-side scripts use.
alone() {
  local c=${config[$w]} s=${steps[$w]}
  # shellcheck disable=SC2086
  run "$w-ember-$1-r$r.json" env RAYON_NUM_THREADS="$threads" OMP_NUM_THREADS="$threads" taskset -c "$cpus" \
    "$ember" bench train --config "$c" --precision "$1" $s --json
}
for r in $(seq 1 "$rounds"); do
  for w in nano large lora full gemma; do
    selected "$w" || continue
    if (( r % 2 )); then side; alone f32; alone bf16; else alone bf16; alone f32; side; fi
  done
done

# Time to val 1.70, nano and nano-speedrun alternating seed by seed (speedrun.sh's own loop).
if selected speedrun; then
  run speedrun.txt env SEEDS="${SEEDS:-$(seq -s ' ' 1337 $((1336 + rounds)))}" EMBER="$ember" \
    RAYON_NUM_THREADS="$threads" taskset -c "$cpus" experiments/speedrun.sh "$out/speedrun" \
    configs/nano.toml configs/nano-speedrun.toml
fi

if [ -n "${DRY:-}" ]; then
  echo "python3 experiments/cpu_matrix_summary.py $out $rows $rounds"
else
  python3 experiments/cpu_matrix_summary.py "$out" "$rows" "$rounds"
fi
