#!/usr/bin/env python3
"""Greedy answers to the 32 held-out questions of experiments/dpo_style.jsonl (the last 32 lines, the
pairs a run holds out) from a checkpoint, and how many take the preferred style (start "Ahoy") and
still state the fact (the plain answer's last word: the sum, the capital, the color, the opposite).

    python experiments/dpo_style_eval.py RUN_DIR [EMBER_BINARY]
"""

import json
import re
import subprocess
import sys

run = sys.argv[1]
ember = sys.argv[2] if len(sys.argv) > 2 else "target/release/ember"
pairs = [json.loads(line) for line in open("experiments/dpo_style.jsonl")][-32:]
questions = [p["prompt"][-1]["content"] for p in pairs]
facts = [p["rejected"][0]["content"].rstrip(".").split()[-1] for p in pairs]
args = [ember, "sample", "--checkpoint", run, "--chat", "--temperature", "0", "--max-new-tokens", "24"]
for q in questions:
    args += ["--prompt", q]
out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
answers = [a.split("\n", 1)[1].strip() if "\n" in a else "" for a in re.split(r"^=== \d+ ===\n", out, flags=re.M)[1:]]
assert len(answers) == len(questions), (len(answers), out[:500])
styled = sum(a.startswith("Ahoy") for a in answers)
factual = sum(f.lower() in a.lower() for a, f in zip(answers, facts))
print(f"{run}: {styled}/32 answers in the style, {factual}/32 state the fact")
for q, a in list(zip(questions, answers))[:4]:
    print(f"  {q} -> {json.dumps(a)}")
