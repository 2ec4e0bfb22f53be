#!/usr/bin/env bash
# NCCL on one GPU (issue 17's world-size-1 check): the same short CUDA training run with the
# gradients summed on the host (EMBER_NCCL=0) and by NCCL on the device (EMBER_NCCL=1); with one
# rank the sum is the identity, so the two runs must log the same losses. Needs a binary built with
#
#   cargo build --release -p ember-cli --features nccl && strip -o ember-nccl target/release/ember
#
# and libnccl at run time (cudarc looks for libnccl.so: where only libnccl.so.2 exists, e.g. from
# the nvidia-nccl-cu12 wheel, link it as libnccl.so in a folder on LD_LIBRARY_PATH). Run from the
# repository root:  scripts/nccl-check.sh [./ember-nccl] [DATA_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
EMBER=${1:-./ember-nccl}
export EMBER_DATA_DIR=${2:-${EMBER_DATA_DIR:-datasets}}
export RUST_LOG=${RUST_LOG:-info}
OUT=$(mktemp -d)
CONFIG=$OUT/nccl.toml
sed -e 's/^max_steps = .*/max_steps = 60/' -e 's/^log_interval = .*/log_interval = 1/' \
    -e 's/^eval_interval = .*/eval_interval = 60/' -e 's/^checkpoint_interval = .*/checkpoint_interval = 60/' \
    configs/shakespeare-gpu.toml > "$CONFIG"
for mode in 0 1; do
  EMBER_NCCL=$mode timeout 240 "$EMBER" train --config "$CONFIG" --device cuda --run-dir "$OUT/run$mode" \
    --no-progress 2>&1 | tee "$OUT/log$mode" | grep -E "NCCL|trained|error" || true
done
grep -q "summed on the device by NCCL" "$OUT/log1" || { echo "FAIL: the NCCL run did not use NCCL"; exit 1; }
python3 - "$OUT/run0/metrics.jsonl" "$OUT/run1/metrics.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["train_loss"] for l in open(p)] for p in sys.argv[1:3])
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")
print(f"{len(a)} steps, host vs NCCL losses: max relative difference {worst:.2e}")
sys.exit(0 if worst <= 1e-6 else 1)
PY
