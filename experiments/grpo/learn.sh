#!/usr/bin/env bash
# Does GRPO learn? The template (configs/grpo.toml) on SmolLM2-135M-Instruct for STEPS steps, one
# run per seed, each evaluated every 25 steps on the 50 held-out prompts (greedy). Prints each
# evaluation: accuracy (rewards/gsm8k), the #### form (rewards/format), and the answers' length.
#
#   EMBER_TEST_ASSETS=../shared experiments/grpo/learn.sh [STEPS] [SEEDS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-100}
shift || true
SEEDS=${*:-1 2 3}
ASSETS=${EMBER_TEST_ASSETS:-../shared}
GGUF="$ASSETS/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK/examples"
cp examples/arithmetic.jsonl "$WORK/examples/"
EMBER=$PWD/target/release/ember
[ -d "$WORK/runs/smollm2" ] || (cd "$WORK" && "$EMBER" import "$GGUF" --out runs/smollm2 >/dev/null 2>&1)
echo "# $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) threads; $STEPS steps; work in $WORK"
for seed in $SEEDS; do
  sed -e "s/^max_steps = .*/max_steps = $STEPS/" -e "s/^log_interval = 1/log_interval = 1\nseed = $seed/" \
    configs/grpo.toml > "$WORK/grpo-$seed.toml"
  (cd "$WORK" && "$EMBER" train --config "grpo-$seed.toml" --run-dir "runs/grpo-$seed" > "runs-$seed.log" 2>&1)
  python3 - "$WORK/runs/grpo-$seed/metrics.jsonl" "$seed" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    if r["step"] == 0:
        print(json.dumps({"seed": int(sys.argv[2]), "step": 0, "val_reward": -r["val_loss"]}))
    elif "val_reward" in r:
        print(json.dumps({"seed": int(sys.argv[2]), "step": r["step"], "val_reward": r["val_reward"],
                          "accuracy": r["val_rewards/gsm8k/mean"], "format": r["val_rewards/format/mean"],
                          "length": r["val_completions/mean_length"], "elapsed_s": round(r["elapsed_s"])}))
steps = [r for r in rows if "train_loss" in r]
print(json.dumps({"seed": int(sys.argv[2]), "mean_step_s": sum(r["step_ms"] for r in steps) / 1000 / len(steps),
                  "sampled_reward_first10": sum(r["reward"] for r in steps[:10]) / 10,
                  "sampled_reward_last10": sum(r["reward"] for r in steps[-10:]) / 10}))
PY
done
