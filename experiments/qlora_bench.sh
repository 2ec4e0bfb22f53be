#!/usr/bin/env bash
# LoRA on a quantized base: SmolLM2-135M-Instruct's Q4_1 GGUF trained from as it is stored
# (`init_from = "gguf:FILE"`, its 210 projections kept Q4_1) against the same LoRA run on the same
# file imported to f32 (`ember import`, then `init_from = "run:DIR"`): peak RSS (GNU time's maximum
# resident set) and the median step time, runs alternated on the same cores. Three shapes: the `ember
# init lora` template's (chat examples, 4 rows of 64 tokens), text (tinyshakespeare, 4 rows of 512
# tokens), and text with activation checkpointing (QLoRA's usual companion). From the repository root, after `cargo build --release`:
#
#   EMBER_DATA_DIR=../shared/datasets bash experiments/qlora_bench.sh
#
# Results (and the CPU) in experiments/qlora.md.
set -euo pipefail
. "$(dirname "$0")/lora.sh"
EMBER=${EMBER:-target/release/ember}
GGUF=${GGUF:-../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-target/qlora-bench}
REPS=${REPS:-2}
SHAPES=${SHAPES:-chat text text-ckpt}
rm -rf "$OUT"
mkdir -p "$OUT"
lscpu | grep -E "^Model name|^CPU\(s\)|^Flags" > "$OUT/cpu.txt"
"$EMBER" import "$GGUF" --out "$OUT/smollm2-f32" > /dev/null

config() { # shape base
  local init data steps
  case $2 in
    q4_1) init="gguf:$GGUF" ;;
    f32) init="run:$OUT/smollm2-f32" ;;
  esac
  case $1 in
    chat) data=$'path = "examples/chat.jsonl"\n\n[train]\nbatch_size = 4'; steps=20 ;;
    text) data=$'dataset = "tinyshakespeare"\n\n[train]\nbatch_size = 4\nseq_len = 512'; steps=10 ;;
    text-ckpt) data=$'dataset = "tinyshakespeare"\n\n[train]\nbatch_size = 4\nseq_len = 512\nactivation_checkpointing = true'; steps=10 ;;
  esac
  cat <<TOML
init_from = "$init"

[data]
$data
max_steps = $steps
eval_interval = $steps
eval_iters = 2

$(lora_section 8 16)

[metrics]
sample_tokens = 0
TOML
}

for shape in $SHAPES; do
  for base in q4_1 f32; do
    config "$shape" "$base" > "$OUT/$shape-$base.toml"
  done
  for rep in $(seq "$REPS"); do
    for base in q4_1 f32; do
      run="$shape-$base-$rep"
      /usr/bin/time -f "%M" -o "$OUT/$run.rss" \
        "$EMBER" train --config "$OUT/$shape-$base.toml" --run-dir "$OUT/runs/$run" --no-progress 2> "$OUT/$run.log"
      echo "$run: $(cat "$OUT/$run.rss") kB, $(tail -1 "$OUT/$run.log")"
    done
  done
done

python3 - "$OUT" $SHAPES <<'PY'
import json, pathlib, statistics, sys
out, shapes = pathlib.Path(sys.argv[1]), sys.argv[2:]
print("| shape | base | peak RSS (MiB) | step (ms, median) | val loss |")
print("|---|---|---|---|---|")
summary = {}
for shape in shapes:
    for base in ["q4_1", "f32"]:
        rss, steps, val = [], [], None
        for log in sorted(out.glob(f"{shape}-{base}-*.rss")):
            run = log.stem
            rss.append(int(log.read_text().split()[-1]) / 1024)
            records = [json.loads(l) for l in open(out / "runs" / run / "metrics.jsonl")]
            steps += [r["step_ms"] for r in records if r.get("step", 0) >= 2 and "step_ms" in r]
            val = [r["val_loss"] for r in records if "val_loss" in r][-1]
        summary[shape, base] = (max(rss), statistics.median(steps))
        print(f"| {shape} | {base} | {max(rss):.0f} | {statistics.median(steps):.0f} | {val:.4f} |")
for shape in shapes:
    (rq, sq), (rf, sf) = summary[shape, "q4_1"], summary[shape, "f32"]
    print(f"{shape}: peak RSS {rq / rf:.2f}× the f32 run's, speed {sf / sq:.2f}× (step time ratio f32/q4_1)")
PY
