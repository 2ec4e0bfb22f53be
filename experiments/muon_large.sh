#!/usr/bin/env bash
# Muon against AdamW at equal tokens on bench-cpu-large's shape (nanoGPT's shakespeare-char model: 6 layers,
# width 384, 6 heads, context 256, batch 8 = 2,048 tokens a step, 10.6M parameters), recorded in
# experiments/speedrun.md. Both runs take STEPS steps (default 300: 614k tokens, 0.6 epoch), warmup 30 and a
# cosine decay over the run; AdamW at the config's lr 1e-3 (nanoGPT's for this model), Muon at lr 0.02 on
# the block matrices with AdamW 1e-3 on the rest. Evaluation every 50 steps, seeds alternating.
#   experiments/muon_large.sh OUT_DIR          (env SEEDS, default "1337 1338 1339"; STEPS; EMBER)
set -euo pipefail
out=$1
steps=${STEPS:-300}
ember=${EMBER:-target/release/ember}
mkdir -p "$out"
sed -e "s/^max_steps = .*/max_steps = $steps/; s/^decay_steps = .*/decay_steps = $steps/" \
    -e 's/^warmup_steps = .*/warmup_steps = 30/; s/^eval_interval = .*/eval_interval = 50/' \
    -e "s/^checkpoint_interval = .*/checkpoint_interval = $steps/" \
    configs/bench-cpu-large.toml > "$out/adamw.toml"
{ cat "$out/adamw.toml"; printf '\n[muon]\nlr = 0.02\n'; } > "$out/muon.toml"
names="adamw muon"
. "$(dirname "$0")/seeds.sh"
train_seeds "$out" $names
python3 - "$out" "$steps" $names <<'PY'
import json, statistics, sys, os
out, steps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("| optimizer | val loss by step (median of seeds) | val loss at the last step [seeds] | step ms (median) |")
print("|---|---|---|---|")
for name in names:
    curves, last, ms = {}, [], []
    for run in sorted(d for d in os.listdir(out) if d.startswith(f"run-{name}-")):
        rows = [json.loads(l) for l in open(os.path.join(out, run, "metrics.jsonl"))]
        for r in rows:
            if r.get("val_loss") is not None and r["step"] > 0:
                curves.setdefault(r["step"], []).append(r["val_loss"])
        last.append(next(r["val_loss"] for r in rows if r.get("val_loss") is not None and r["step"] == steps))
        ms.append(statistics.median(r["step_ms"] for r in rows if r.get("step_ms")))
    curve = " ".join(f"{s}: {statistics.median(v):.3f}" for s, v in sorted(curves.items()))
    print(f"| {name} | {curve} | {statistics.median(last):.4f} [{', '.join(f'{x:.4f}' for x in last)}] | "
          f"{statistics.median(ms):.0f} |")
PY
