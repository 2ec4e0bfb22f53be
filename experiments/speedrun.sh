#!/usr/bin/env bash
# Time to val loss 1.70 of several configs, alternating runs on the same cores (seed by seed, config
# by config), through `ember bench target`; prints one line per run and each config's median.
#   experiments/speedrun.sh OUT_DIR CONFIG...        (e.g. configs/nano.toml configs/nano-speedrun.toml)
# Env: SEEDS (default "1337 1338 1339"), TARGET (1.70), EVAL_INTERVAL (50), MAX_STEPS (2000), EMBER (binary).
set -euo pipefail
out=$1; shift
ember=${EMBER:-target/release/ember}
mkdir -p "$out"
for seed in ${SEEDS:-1337 1338 1339}; do
  for config in "$@"; do
    name=$(basename "$config" .toml)
    "$ember" bench target --config "$config" --target-val "${TARGET:-1.70}" --eval-interval "${EVAL_INTERVAL:-50}" \
      --eval-iters 20 --max-steps "${MAX_STEPS:-2000}" --seed "$seed" --json > "$out/$name-$seed.json" 2> "$out/$name-$seed.log" || true
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); r=d['runs'][0]; print(sys.argv[2], r['seed'], 'reached' if r['reached'] else 'NOT reached', r['time_to_target_s'], r['steps'], r['tokens'], round(r['step_ms'],1), round(r['best_val_loss'],4))" "$out/$name-$seed.json" "$name"
  done
done
python3 - "$out" "$@" <<'PY'
import json, os, statistics, sys
out = sys.argv[1]
for config in sys.argv[2:]:
    name = os.path.basename(config)[:-5]
    runs = [json.load(open(os.path.join(out, f)))["runs"][0] for f in sorted(os.listdir(out)) if f.startswith(name + "-") and f.endswith(".json") and f[len(name) + 1:-5].isdigit()]
    times = [r["time_to_target_s"] for r in runs]
    if all(t is not None for t in times):
        print(f"{name}: median {statistics.median(times):.1f} s over {len(times)} seeds ({', '.join(f'{t:.1f}' for t in times)}); "
              f"steps {[r['steps'] for r in runs]}, step_ms {[round(r['step_ms'], 1) for r in runs]}")
    else:
        print(f"{name}: not every seed reached the target: {times}; best {[round(r['best_val_loss'], 4) for r in runs]}")
PY
