#!/usr/bin/env bash
# The speedrun's ablation table (experiments/speedrun.md): configs/nano-speedrun.toml with one technique
# turned off (or on), and configs/nano.toml, each trained by `ember train` with an evaluation every 50
# steps, seeds alternating config by config on the same cores. For each run: the time and step of the
# first evaluation at or below 1.70 (time to target) and the val loss at step 800 (fixed tokens:
# 800 × 12 × 64); then the median of each over the seeds.
#   experiments/speedrun_ablate.sh OUT_DIR          (env SEEDS, default "1337 1338 1339"; EMBER)
set -euo pipefail
out=$1
ember=${EMBER:-target/release/ember}
mkdir -p "$out"
base=configs/nano-speedrun.toml
variant() { # name, sed program over the speedrun config
  sed -e "$2" "$base" | sed -e 's/^eval_interval = .*/eval_interval = 50/' > "$out/$1.toml"
}
variant speedrun ''
variant no-muon '/^\[muon\]/,$d'
variant no-qk-norm 's/^qk_norm = true/qk_norm = false/'
variant no-softcap '/^final_logit_softcap/d'
variant plus-relu2-zero-init 's/^d_ff = 344/d_ff = 512\nmlp = "relu2"\nzero_init_out = true/'
variant plus-wsd 's/^decay_steps = 800/decay_steps = 800\nshape = "wsd"/; s/^min_lr = 1e-4/min_lr = 0.0/'
sed -e 's/^eval_interval = .*/eval_interval = 50/' configs/nano.toml > "$out/nano.toml"
names="nano speedrun no-muon no-qk-norm no-softcap plus-relu2-zero-init plus-wsd"
. "$(dirname "$0")/seeds.sh"
train_seeds "$out" $names
python3 - "$out" $names <<'PY'
import json, statistics, sys, os
out, names = sys.argv[1], sys.argv[2:]
print("| config | time to val ≤ 1.70 (s), median [seeds] | steps | val loss at step 800 | step ms |")
print("|---|---|---|---|---|")
for name in names:
    times, steps, at800, ms = [], [], [], []
    for run in sorted(d for d in os.listdir(out) if d.startswith(f"run-{name}-")):
        rows = [json.loads(l) for l in open(os.path.join(out, run, "metrics.jsonl"))]
        evals = [r for r in rows if r.get("val_loss") is not None and r["step"] > 0]
        hit = next((r for r in evals if r["val_loss"] <= 1.70), None)
        times.append(hit["elapsed_s"] if hit else None)
        steps.append(hit["step"] if hit else None)
        at800.append(next((r["val_loss"] for r in evals if r["step"] == 800), None))
        ms.append(statistics.median(r["step_ms"] for r in rows if r.get("step_ms")))
    fmt = lambda xs, f: ", ".join("—" if x is None else f.format(x) for x in xs)
    med = lambda xs: statistics.median(xs) if all(x is not None for x in xs) else None
    t = med(times)
    print(f"| {name} | {'not reached' if t is None else f'{t:.1f}'} [{fmt(times, '{:.1f}')}] | {fmt(steps, '{}')} | "
          f"{med(at800):.4f} [{fmt(at800, '{:.4f}')}] | {statistics.median(ms):.1f} |")
PY
