#!/usr/bin/env python3
"""Prints a DPO run's evaluation curves (val loss, held-out reward accuracy and margin, the chosen and
rejected answers' log-probabilities) and its samples as Markdown: python experiments/dpo_curves.py RUN_DIR"""

import json
import sys

run = sys.argv[1]
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
print("| step | train loss | val loss | val reward accuracy | val margin | val logps chosen | val logps rejected |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    if "val_loss" not in r:
        continue
    get = lambda k: f"{r[k]:.3f}" if k in r else ""
    print(f"| {r['step']} | {get('train_loss')} | {r['val_loss']:.4f} | {get('val_rewards/accuracies')} | {get('val_rewards/margins')} "
          f"| {get('val_logps/chosen')} | {get('val_logps/rejected')} |")
print()
for line in open(f"{run}/samples.jsonl"):
    s = json.loads(line)
    question = s["prompt"].split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
    print(f"- step {s['step']}, \"{question}\": {json.dumps(s['text'])}")
