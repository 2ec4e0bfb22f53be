#!/usr/bin/env bash
# Both models on every task, through `ember eval --tasks`, as JSON under experiments/eval/ (the
# table in experiments/eval.md is made from these files). Slices: the first N items of each task
# (BLiMP: the first N/5 pairs of each of its 67 paradigms; GSM8K: the first 50).
#
#   EMBER=target/release/ember EVALS=../shared/evals GEMMA=target/models/gemma-3-270m-q4_k_m.gguf \
#     bash experiments/eval_table.sh 500 200
set -euo pipefail
EMBER="${EMBER:-target/release/ember}"
EVALS="${EVALS:-../shared/evals}"
SMOL="${SMOL:-$EVALS/../models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}"
GEMMA="${GEMMA:-target/models/gemma-3-270m-q4_k_m.gguf}"
n_smol="${1:-500}"
n_gemma="${2:-200}"
mkdir -p experiments/eval
lscpu | grep -E "Model name|Flags" > experiments/eval/lscpu.txt
for pair in "smollm2:$SMOL:$n_smol" "gemma3:$GEMMA:$n_gemma"; do
  IFS=: read -r name file n <<<"$pair"
  blimp=$(( n / 5 ))
  tasks="hellaswag,arc_easy,arc_challenge,piqa,boolq,openbookqa,commonsense_qa,winogrande,mmlu,lambada_openai"
  "$EMBER" eval --checkpoint "gguf:$file" --eval-dir "$EVALS" --tasks "$tasks" --limit "$n" --json \
    > "experiments/eval/$name.json"
  "$EMBER" eval --checkpoint "gguf:$file" --eval-dir "$EVALS" --tasks blimp --limit "$blimp" --json \
    > "experiments/eval/$name-blimp.json"
  "$EMBER" eval --checkpoint "gguf:$file" --eval-dir "$EVALS" --tasks gsm8k:50 --json \
    > "experiments/eval/$name-gsm8k.json"
done
