#!/usr/bin/env bash
# A real model in and out through GGUF (experiments/gguf.md): import SmolLM2-135M-Instruct (Q4_1 GGUF),
# LoRA fine-tune it on experiments/gguf_chat.jsonl (it learns to say it is "Emberling"), sample before
# and after on held-out phrasings, export the merged model to GGUF f32 and q8_0, and load both exports
# in Hugging Face transformers (experiments/gguf_transformers_check.py), which must answer the same.
#
#   bash experiments/gguf_finetune.sh
#
# Run from the repository root after `cargo build --release`. Needs the model in ../shared/models/ and
# a Python with torch, transformers and gguf ($PY, default /root/venv-ref/bin/python). Writes into $OUT
# (default /tmp/ember-gguf). About 10 minutes on 2 cores, most of it training and transformers.
set -euo pipefail
. "$(dirname "$0")/lora.sh"
EMBER=${EMBER:-target/release/ember}
PY=${PY:-/root/venv-ref/bin/python}
OUT=${OUT:-/tmp/ember-gguf}
MODEL=${MODEL:-../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
DATA=experiments/gguf_chat.jsonl
STEPS=${STEPS:-24}
rm -rf "$OUT" && mkdir -p "$OUT"
lscpu | grep -E "Model name" | sed 's/  */ /g'
echo "cores: $(nproc); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
sha256sum "$EMBER" | cut -c1-16 | sed 's/^/ember binary sha256: /'

now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.1f}')"; }
size() { stat -c %s "$1" | python3 -c "import sys; n=int(sys.stdin.read()); print(f'{n:,} bytes ({n/2**20:.1f} MiB)')"; }

# Held-out prompts: the last 6 examples of the file are the validation split (val_fraction 0.12),
# never trained on; two more phrasings are in no example at all. Two are general questions (the
# behaviour should stay specific to questions about identity).
PROMPTS=("Who are you?" "What is your name?" "Tell me about yourself." "Which model are you?" "Are you SmolLM?"
  "May I ask what you are?" "What do bees make?" "What is the capital of Italy?")
PARGS=()
for p in "${PROMPTS[@]}"; do PARGS+=(--prompt "$p"); done
tail -n 6 "$DATA" > "$OUT/val.jsonl"
chat() { $EMBER sample --checkpoint "$1" --chat --temperature 0 --max-new-tokens 48 "${PARGS[@]}" 2>/dev/null; }

echo "== import"
t0=$(now)
$EMBER import "$MODEL" --out "$OUT/base" 2>/dev/null
echo "import: $(secs "$t0" "$(now)") s"

echo "== ember, before fine-tuning"
chat "$OUT/base" | tee "$OUT/ember-base.txt"
$EMBER eval --perplexity --checkpoint "$OUT/base" --data "$OUT/val.jsonl" --context 128 --json 2>/dev/null | tee "$OUT/eval-base.json"

cat > "$OUT/lora.toml" <<TOML
init_from = "run:$OUT/base"
[data]
path = "$DATA"
val_fraction = 0.12
[train]
batch_size = 4
seq_len = 128
max_steps = $STEPS
eval_interval = 8
eval_iters = 1
log_interval = 1
checkpoint_interval = $STEPS
seed = 15
[optim]
weight_decay = 0.0
grad_clip = 1.0
[schedule]
lr = 1.5e-3
min_lr = 1.5e-4
warmup_steps = 3
$(lora_section 16 32.0)
[metrics]
sample_tokens = 0
TOML

echo "== LoRA fine-tune ($STEPS steps)"
t0=$(now)
$EMBER train --config "$OUT/lora.toml" --run-dir "$OUT/ft" --no-progress 2>"$OUT/train.log"
echo "train (whole command): $(secs "$t0" "$(now)") s"
tail -n 1 "$OUT/train.log" | sed 's/\x1b\[[0-9;]*m//g'
python3 - "$OUT/ft/metrics.jsonl" <<'PY'
import json, sys
rs = [json.loads(l) for l in open(sys.argv[1])]
tr = [r for r in rs if "train_loss" in r]
for r in rs:
    if r.get("val_loss") is not None:
        print(f"step {r['step']:3d}  val loss {r['val_loss']:.4f}")
print("train loss by step:", " ".join(f"{r['train_loss']:.2f}" for r in tr))
tps = sorted(r["tokens_per_sec"] for r in tr)
print(f"tokens/s: median {tps[len(tps)//2]:.1f}, min {tps[0]:.1f}, max {tps[-1]:.1f}; "
      f"step ms median {sorted(r['step_ms'] for r in tr)[len(tr)//2]:.0f}; epochs {tr[-1].get('epoch', 0):.2f}")
PY

echo "== ember, after fine-tuning (LoRA run, adapters unmerged)"
chat "$OUT/ft" | tee "$OUT/ember-ft.txt"
$EMBER eval --perplexity --checkpoint "$OUT/ft" --data "$OUT/val.jsonl" --context 128 --json 2>/dev/null | tee "$OUT/eval-ft.json"

for dt in f32 q8_0; do
  echo "== export merged GGUF $dt"
  t0=$(now)
  $EMBER export "$OUT/ft" --merge --format gguf --dtype $dt --out "$OUT/tuned-$dt.gguf" 2>/dev/null
  echo "export $dt: $(secs "$t0" "$(now)") s, $(size "$OUT/tuned-$dt.gguf")"
  # The export read back by ember itself: the same answers and loss as the run?
  $EMBER import "$OUT/tuned-$dt.gguf" --out "$OUT/reimport-$dt" 2>/dev/null
  chat "$OUT/reimport-$dt" > "$OUT/ember-reimport-$dt.txt"
  cmp -s "$OUT/ember-ft.txt" "$OUT/ember-reimport-$dt.txt" && echo "ember on the re-imported $dt GGUF: same answers as the LoRA run" \
    || { echo "ember on the re-imported $dt GGUF answers differently:"; diff "$OUT/ember-ft.txt" "$OUT/ember-reimport-$dt.txt" || true; }
  $EMBER eval --perplexity --checkpoint "$OUT/reimport-$dt" --data "$OUT/val.jsonl" --context 128 --json 2>/dev/null | tee "$OUT/eval-reimport-$dt.json"
done
echo "source GGUF: $(size "$MODEL")"

echo "== transformers"
t0=$(now)
$PY experiments/gguf_transformers_check.py "${PARGS[@]}" --jsonl "$OUT/val.jsonl" --out "$OUT/transformers.json" \
  --gguf "base=$MODEL" --ember "base=$OUT/ember-base.txt" \
  --gguf "tuned-f32=$OUT/tuned-f32.gguf" --ember "tuned-f32=$OUT/ember-ft.txt" \
  --gguf "tuned-q8_0=$OUT/tuned-q8_0.gguf" --ember "tuned-q8_0=$OUT/ember-reimport-q8_0.txt" \
  --compare tuned-f32,tuned-q8_0 --compare base,tuned-f32 \
  2> >(grep -v -e "Converting and de-quantizing" -e "Loading weights" >&2)
echo "transformers check: $(secs "$t0" "$(now)") s"
