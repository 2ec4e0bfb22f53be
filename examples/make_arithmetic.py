#!/usr/bin/env python3
"""Writes examples/arithmetic.jsonl: 500 chat prompts asking for the sum of two numbers from 1 to 30,
each with its `answer`, for the GRPO template (configs/grpo.toml). Deterministic (seed 0):

    python3 examples/make_arithmetic.py
"""

import json
import os
import random

rng = random.Random(0)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic.jsonl")
with open(path, "w") as f:
    for _ in range(500):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        content = f"What is {a} + {b}? End your reply with the answer as #### <number>."
        f.write(json.dumps({"prompt": [{"role": "user", "content": content}], "answer": str(a + b)}) + "\n")
