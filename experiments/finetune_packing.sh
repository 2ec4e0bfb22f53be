#!/usr/bin/env bash
# Documents against stream packing on a fine-tune of a small imported model (the Qwen2 test fixture,
# full fine-tune), and the cost of the block-diagonal mask on tokens/s. Writes into $OUT (default
# /tmp/ember-packing). Run from the repository root after `cargo build --release`.
#
#   bash experiments/finetune_packing.sh
set -euo pipefail
EMBER=${EMBER:-target/release/ember}
OUT=${OUT:-/tmp/ember-packing}
rm -rf "$OUT" && mkdir -p "$OUT"
lscpu | grep -E "Model name" | sed 's/  */ /g'

# Examples whose completion is a function of the prompt (the words reversed), of uneven lengths, so
# that rows hold several of them and an example's neighbours say nothing about it.
python3 - "$OUT/data.jsonl" <<'PY'
import json, random, sys
random.seed(0)
words = ["the", "king", "is", "dead", "long", "live", "queen", "of", "fair", "night", "love", "speak", "sir", "good"]
with open(sys.argv[1], "w") as f:
    for _ in range(600):
        w = random.sample(words, random.randint(1, 4))
        f.write(json.dumps({"prompt": " ".join(w) + " =", "completion": " " + " ".join(reversed(w))}) + "\n")
PY
tail -n 60 "$OUT/data.jsonl" > "$OUT/val.jsonl"  # the held-out split: the last 10% of the examples

$EMBER import tests/fixtures/hf/qwen2 --out "$OUT/base" >/dev/null
for packing in documents stream; do
  cat > "$OUT/$packing.toml" <<TOML
init_from = "run:$OUT/base"
[data]
path = "$OUT/data.jsonl"
val_fraction = 0.1
packing = "$packing"
[train]
batch_size = 8
seq_len = 64
max_steps = 300
eval_interval = 100
eval_iters = 1
log_interval = 50
seed = 7
[optim]
weight_decay = 0.0
grad_clip = 1.0
[schedule]
lr = 3e-3
warmup_steps = 20
[metrics]
sample_tokens = 0
TOML
  start=$(date +%s.%N)
  $EMBER train --config "$OUT/$packing.toml" --run-dir "$OUT/$packing" 2>"$OUT/$packing.log"
  end=$(date +%s.%N)
  echo "== $packing: $(python3 -c "print(f'{$end - $start:.1f}')") s"
  grep -o '"step":[0-9]*\|"val_loss":[0-9.]*\|"tokens_per_sec":[0-9.]*\|"epoch":[0-9.]*' "$OUT/$packing/metrics.jsonl" | paste -sd' ' | fold -w 200
  # The held-out completion loss measured the same way for both: each example alone, from position 0
  # (as it is at inference).
  $EMBER eval --perplexity --checkpoint "$OUT/$packing" --data "$OUT/val.jsonl"
done

# The cost of the block-diagonal mask: a nano-sized model (6 layers, d 384, 256 positions) on the
# same examples, documents against stream packing, alternating runs of `ember bench train`.
for packing in documents stream; do
  cat > "$OUT/speed-$packing.toml" <<TOML
[model]
d_model = 384
n_layers = 6
n_heads = 6
d_ff = 1536
max_seq_len = 256
[data]
path = "$OUT/data.jsonl"
tokenizer = "tests/fixtures/hf/qwen2/tokenizer.json"
packing = "$packing"
[train]
batch_size = 8
max_steps = 100
eval_interval = 100
eval_iters = 1
[optim]
[schedule]
lr = 1e-3
TOML
done
for round in 1 2 3; do
  for packing in documents stream; do
    tps=$($EMBER bench train --config "$OUT/speed-$packing.toml" --steps 10 --warmup 2 --json 2>/dev/null \
      | python3 -c "import json,sys; print(round(json.load(sys.stdin)['tokens_per_sec']))")
    echo "round $round $packing: $tps tokens/s"
  done
done
