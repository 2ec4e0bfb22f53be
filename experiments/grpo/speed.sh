#!/usr/bin/env bash
# GRPO speed and memory, ember against TRL 1.16's GRPOTrainer, alternating rounds on the same cores:
# the template's task (configs/grpo.toml: SmolLM2-135M-Instruct, LoRA rank 16, 2 prompts x 8 answers,
# 40 new tokens at temperature 0.7), STEPS steps each, the first left out as warm-up.
#
#   EMBER_TEST_ASSETS=../shared experiments/grpo/speed.sh [ROUNDS] [STEPS]
#
# Needs target/release/ember (cargo build --release) and target/py with trl 1.16 (see
# tests/fixtures/rl/make_fixture.py). Writes experiments/grpo/speed-<date>.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-2}
STEPS=${2:-6}
ASSETS=${EMBER_TEST_ASSETS:-../shared}
GGUF="$ASSETS/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT="experiments/grpo/speed-$(date +%Y%m%d-%H%M).jsonl"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/examples"
cp examples/arithmetic.jsonl "$WORK/examples/"
EMBER=$PWD/target/release/ember
(cd "$WORK" && "$EMBER" import "$GGUF" --out runs/smollm2 >/dev/null 2>&1)
sed -e "s/^max_steps = .*/max_steps = $STEPS/" -e "s/^eval_interval = .*/eval_interval = 1000/" -e "s/^warmup_steps = .*/warmup_steps = 1/" configs/grpo.toml > "$WORK/grpo.toml"
echo "{\"cpu\": \"$(lscpu | sed -n 's/^Model name: *//p')\", \"flags\": \"$(grep -o -w 'avx512f\|avx512_bf16\|avx512_vnni\|amx_bf16\|amx_tile\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')\", \"threads\": 2}" | tee "$OUT"
for round in $(seq "$ROUNDS"); do
  target/py/bin/python experiments/grpo/trl_speed.py --steps "$STEPS" --threads 2 --gguf "$GGUF" 2>/dev/null | tail -1 | tee -a "$OUT"
  rm -rf "$WORK/runs/grpo"
  (cd "$WORK" && /usr/bin/time -v "$EMBER" train --config grpo.toml > "$WORK/ember.log" 2> "$WORK/ember.err") || { tail "$WORK/ember.err"; exit 1; }
  python3 - "$WORK" "$STEPS" <<'PY' | tee -a "$OUT"
import json, re, sys
work, steps = sys.argv[1], int(sys.argv[2])
rows = [json.loads(l) for l in open(f"{work}/runs/grpo/metrics.jsonl") if '"train_loss"' in l][1:]
secs = [r["step_ms"] / 1000 for r in rows]
tokens = sum(16 * r["completions/mean_length"] for r in rows)
rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(f"{work}/ember.err").read()).group(1))
print(json.dumps({"tool": "ember", "steps": len(secs), "step_s": secs, "mean_step_s": sum(secs) / len(secs),
                  "answers_per_s": 16 * len(secs) / sum(secs), "answer_tokens_per_s": tokens / sum(secs),
                  "peak_rss_mb": rss / 1024}))
PY
done
echo "wrote $OUT"
