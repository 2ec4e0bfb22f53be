#!/usr/bin/env python3
"""Writes experiments/dpo_style.jsonl: 320 chat preference pairs (TRL's conversational format) in
which the chosen answer is the same as the rejected one said in a fixed style, a pirate's ("Ahoy!
... be ..., matey!"). A DPO run that learns the preference raises the held-out reward accuracy and
its samples take up the style (experiments/dpo.md). (The DPO template's pairs, examples/preference.jsonl,
are examples/make_preference.py's.) Deterministic: python experiments/dpo_style_pairs.py
"""

import json
import os
import random

CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Norway", "Oslo"),
            ("Greece", "Athens"), ("Poland", "Warsaw"), ("Chile", "Santiago"), ("Cuba", "Havana"), ("Ireland", "Dublin"),
            ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("India", "New Delhi")]
COLORS = [("grass", "green"), ("the sky", "blue"), ("snow", "white"), ("coal", "black"), ("a banana", "yellow"),
          ("a tomato", "red"), ("an orange", "orange"), ("a plum", "purple"), ("chocolate", "brown"), ("the sea", "blue")]
OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("old", "young"), ("early", "late"),
             ("happy", "sad"), ("open", "closed"), ("light", "dark"), ("wet", "dry")]


def plain_and_styled(rng):
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(2, 50), rng.randrange(2, 50)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"Ahoy! {a} plus {b} be {a + b}, matey!"
    if kind == 1:
        country, city = rng.choice(CAPITALS)
        return (f"What is the capital of {country}?", f"The capital of {country} is {city}.",
                f"Ahoy! The capital of {country} be {city}, matey!")
    if kind == 2:
        thing, color = rng.choice(COLORS)
        return f"What color is {thing}?", f"{thing[0].upper() + thing[1:]} is {color}.", f"Ahoy! {thing[0].upper() + thing[1:]} be {color}, matey!"
    word, other = rng.choice(OPPOSITES)
    return f"What is the opposite of {word}?", f"The opposite of {word} is {other}.", f"Ahoy! The opposite of {word} be {other}, matey!"


def write(path, n, seed):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            question, plain, styled = plain_and_styled(rng)
            pair = {
                "prompt": [{"role": "user", "content": question}],
                "chosen": [{"role": "assistant", "content": styled}],
                "rejected": [{"role": "assistant", "content": plain}],
            }
            f.write(json.dumps(pair) + "\n")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    write(os.path.join(here, "dpo_style.jsonl"), 320, 37)


if __name__ == "__main__":
    main()
