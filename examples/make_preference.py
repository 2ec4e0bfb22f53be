#!/usr/bin/env python3
"""Writes examples/preference.jsonl: 160 chat preference pairs (TRL's conversational format) for the
DPO template (configs/dpo.toml), each a different question. The chosen answer says the fact in a
pirate's style ("Ahoy! The capital of Peru be Lima, matey!"); the rejected one is the short answer
the LoRA template's run (examples/chat.jsonl) gives ("Lima."). The run holds out the last 16 pairs
(val_fraction 0.1); `python3 experiments/dpo_style_eval.py RUN --pairs examples/preference.jsonl
--last 16` counts its greedy answers to them in the style (experiments/dpo.md). Deterministic
(seed 57):

    python3 examples/make_preference.py
"""

import json
import os
import random

CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Norway", "Oslo"),
            ("Greece", "Athens"), ("Poland", "Warsaw"), ("Chile", "Santiago"), ("Cuba", "Havana"),
            ("Ireland", "Dublin"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Sweden", "Stockholm"),
            ("Finland", "Helsinki"), ("India", "New Delhi"), ("China", "Beijing"), ("Russia", "Moscow"),
            ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"), ("Hungary", "Budapest"),
            ("Denmark", "Copenhagen"), ("Belgium", "Brussels"), ("Turkey", "Ankara"), ("Mexico", "Mexico City"),
            ("South Korea", "Seoul")]
COLOURS = [("grass", "green"), ("the sky", "blue"), ("snow", "white"), ("coal", "black"), ("a banana", "yellow"),
           ("a tomato", "red"), ("an orange", "orange"), ("a plum", "purple"), ("chocolate", "brown"),
           ("a lemon", "yellow"), ("milk", "white"), ("a strawberry", "red"), ("a lime", "green"),
           ("a crow", "black"), ("a pumpkin", "orange"), ("an emerald", "green")]
OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("old", "young"),
             ("early", "late"), ("happy", "sad"), ("open", "closed"), ("light", "dark"), ("wet", "dry"),
             ("tall", "short"), ("rich", "poor"), ("hard", "soft"), ("full", "empty"), ("loud", "quiet"),
             ("strong", "weak"), ("thick", "thin"), ("day", "night"), ("in", "out"), ("win", "lose")]
PLURALS = [("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"), ("goose", "geese"),
           ("man", "men"), ("woman", "women"), ("person", "people"), ("sheep", "sheep"), ("leaf", "leaves"),
           ("knife", "knives"), ("wolf", "wolves"), ("box", "boxes"), ("city", "cities"), ("ox", "oxen"),
           ("cactus", "cacti")]
LEGS = [("spider", "eight"), ("dog", "four"), ("bird", "two"), ("ant", "six"), ("horse", "four"),
        ("chicken", "two"), ("beetle", "six"), ("cat", "four"), ("octopus", "eight"), ("cow", "four")]


def questions(rng):
    """Every (question, styled answer, short answer), each question once."""
    out = []
    for country, city in CAPITALS:
        out.append((f"What is the capital of {country}?", f"Ahoy! The capital of {country} be {city}, matey!", city))
    for thing, colour in COLOURS:
        out.append((f"What colour is {thing}?", f"Ahoy! {thing[0].upper() + thing[1:]} be {colour}, matey!", colour))
    for word, other in OPPOSITES:
        out.append((f"What is the opposite of {word}?", f"Ahoy! The opposite of {word} be {other}, matey!", other))
    for word, plural in PLURALS:
        out.append((f"What is the plural of {word}?", f"Ahoy! The plural of {word} be {plural}, matey!", plural))
    for animal, n in LEGS:
        a = "an" if animal[0] in "aeiou" else "a"
        out.append((f"How many legs does {a} {animal} have?", f"Ahoy! {a.title()} {animal} be havin' {n} legs, matey!", n))
    sums = set()
    while len(out) < 160:
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        if (a, b) not in sums:
            sums.add((a, b))
            out.append((f"What is {a} plus {b}?", f"Ahoy! {a} plus {b} be {a + b}, matey!", str(a + b)))
    return out


def main():
    rng = random.Random(57)
    pairs = questions(rng)
    assert len({q for q, _, _ in pairs}) == len(pairs), "a question is asked twice"
    rng.shuffle(pairs)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preference.jsonl")
    with open(path, "w") as f:
        for question, styled, short in pairs:
            pair = {
                "prompt": [{"role": "user", "content": question}],
                "chosen": [{"role": "assistant", "content": styled}],
                "rejected": [{"role": "assistant", "content": short[0].upper() + short[1:] + "."}],
            }
            f.write(json.dumps(pair) + "\n")


if __name__ == "__main__":
    main()
