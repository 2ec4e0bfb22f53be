#!/usr/bin/env python3
"""Greedy answers to the held-out questions of a file of style pairs (the last N lines, the pairs a
run holds out) from a checkpoint, and how many take the preferred style (start "Ahoy") and still
state the fact (the rejected answer's last word: the sum, the capital, the colour, the opposite...).

    python3 experiments/dpo_style_eval.py RUN_DIR [EMBER_BINARY] [--pairs FILE] [--last N]

Defaults: experiments/dpo_style.jsonl and its last 32 (experiments/dpo-smollm2.toml); the DPO
template's are `--pairs examples/preference.jsonl --last 16`.
"""

import argparse
import json
import re
import subprocess

parser = argparse.ArgumentParser()
parser.add_argument("run")
parser.add_argument("ember", nargs="?", default="target/release/ember")
parser.add_argument("--pairs", default="experiments/dpo_style.jsonl")
parser.add_argument("--last", type=int, default=32)
a = parser.parse_args()
pairs = [json.loads(line) for line in open(a.pairs)][-a.last:]
questions = [p["prompt"][-1]["content"] for p in pairs]
facts = [p["rejected"][0]["content"].rstrip(".").split()[-1] for p in pairs]
args = [a.ember, "sample", "--checkpoint", a.run, "--chat", "--temperature", "0", "--max-new-tokens", "24"]
for q in questions:
    args += ["--prompt", q]
out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
answers = [x.split("\n", 1)[1].strip() if "\n" in x else "" for x in re.split(r"^=== \d+ ===\n", out, flags=re.M)[1:]]
assert len(answers) == len(questions), (len(answers), out[:500])
styled = sum(x.startswith("Ahoy") for x in answers)
factual = sum(f.lower() in x.lower() for x, f in zip(answers, facts))
n = len(questions)
print(f"{a.run}: {styled}/{n} answers in the style, {factual}/{n} state the fact")
for q, x in zip(questions, answers):
    print(f"  {q} -> {json.dumps(x)}")
