#!/usr/bin/env python3
"""The table of experiments/cpu_matrix.sh, from the files its runs left in OUT_DIR: one markdown row a
comparison, under the machine's model and flags (OUT_DIR/machine.txt); printed and written to
OUT_DIR/summary.md.

    python3 experiments/cpu_matrix_summary.py OUT_DIR [ROWS] [ROUNDS]

Each value is the median over the rounds of one side's tokens/s (the speedrun: seconds to val 1.70);
the ratio is the median of the per-round ratios, with the least and the largest, as
experiments/rounds.py gives them. A round whose output does not parse (its run failed) is left out,
and the rounds column says how many counted. A goal is met when the median ratio reaches it.
"""

import json
import math
import re
import statistics
import sys
from pathlib import Path

# Row name: (number in the table, workload, what ember's f32 is compared with, goal).
SIDE = {
    "nano": ("1", "nano (configs/nano.toml)", "PyTorch f32", 1.5),
    "large": ("2", "bench-cpu-large", "PyTorch f32", 1.5),
    "lora": ("3", "SmolLM2-135M LoRA", "transformers + peft f32", 2.0),
    "full": ("5", "SmolLM2-135M full fine-tune", "transformers f32", 1.5),
    "gemma": ("6", "Gemma-3-270M LoRA", "transformers + peft f32", 2.0),
}
# The bf16 rows' numbers: the LoRA one is row 4 of the issue; the others are "bf16 never slower".
BF16 = {"nano": "1b", "large": "2b", "lora": "4", "full": "5b", "gemma": "6b"}


def parsed(path, parse):
    """parse(text of path), or None when the file is missing or does not parse (a failed run)."""
    try:
        return parse(path.read_text())
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def last_line(text):
    """bench_vs_torch.py --json and `ember bench train --json`: one JSON object, the last line."""
    return json.loads(text.strip().splitlines()[-1])


def indented(text):
    """finetune_vs_transformers.py: its round lines, then the JSON, indented, from a line "{"."""
    lines = text.splitlines()
    return json.loads("\n".join(lines[lines.index("{"):]))


def per_round(out, pattern, parse, rounds):
    """{round: parse(file)} of the files named pattern.format(r) that parse."""
    found = {r: parsed(out / pattern.format(r), parse) for r in range(1, rounds + 1)}
    return {r: v for r, v in found.items() if v is not None}


def fmt_ratio(ratios):
    f = lambda x: "∞" if math.isinf(x) else f"{x:.2f}"
    return f"{f(statistics.median(ratios))}× ({f(min(ratios))}–{f(max(ratios))})"


def row(number, what, ember, reference, ratios, rounds, goal, unit):
    """One table row; ember and reference are lists of per-round values."""
    if not ratios:
        return f"| {number} | {what} | — | — | — | 0/{rounds} | ≥ {goal}× | failed |"
    value = lambda xs: "not reached" if math.isinf(statistics.median(xs)) else f"{statistics.median(xs):,.{unit[1]}f} {unit[0]}"
    met = "yes" if statistics.median(ratios) >= goal else "no"
    return (f"| {number} | {what} | {value(ember)} | {value(reference)} | {fmt_ratio(ratios)} | "
            f"{len(ratios)}/{rounds} | ≥ {goal}× | {met} |")


def side_rows(out, name, rounds):
    number, workload, reference, goal = SIDE[name]
    if name in ("nano", "large"):
        found = per_round(out, f"{name}-torch-r{{}}.json", lambda t: last_line(t)["rounds"], rounds)
    else:
        found = per_round(out, f"{name}-transformers-r{{}}.txt", lambda t: indented(t)["results"]["f32"]["rounds"],
                          rounds)
    pairs = [(x["ember_tokens_per_sec"], x["torch_tokens_per_sec"]) for r in sorted(found) for x in found[r]]
    return row(number, f"{workload}: ember f32 / {reference}", [e for e, _ in pairs], [t for _, t in pairs],
               [e / t for e, t in pairs], rounds, goal, ("tok/s", 0))


def bf16_row(out, name, rounds, cpu_bf16):
    ember = {p: per_round(out, f"{name}-ember-{p}-r{{}}.json", lambda t: last_line(t)["tokens_per_sec"], rounds)
             for p in ("f32", "bf16")}
    both = sorted(set(ember["f32"]) & set(ember["bf16"]))
    bf16, f32 = [ember["bf16"][r] for r in both], [ember["f32"][r] for r in both]
    # Row 4's goal, 1.3×, holds where the CPU has bf16 products; everywhere bf16 must not be slower.
    goal = 1.3 if name == "lora" and cpu_bf16 else 1.0
    what = f"{SIDE[name][1]}: ember bf16 / ember f32" + ("" if cpu_bf16 else " (no bf16 on this CPU)")
    return row(BF16[name], what, bf16, f32, [b / f for b, f in zip(bf16, f32)], rounds, goal, ("tok/s", 0))


def speedrun_row(out, rounds):
    """speedrun.sh's files: OUT_DIR/speedrun/<config>-<seed>.json; a seed not reached counts as ∞ s."""
    times = {}
    for path in sorted((out / "speedrun").glob("*.json")):
        m = re.fullmatch(r"(nano|nano-speedrun)-(\d+)\.json", path.name)
        run = parsed(path, lambda t: json.loads(t)["runs"][0]) if m else None
        if run is not None:
            t = run["time_to_target_s"]
            times.setdefault(m[1], {})[m[2]] = math.inf if t is None else t
    seeds = sorted(set(times.get("nano", {})) & set(times.get("nano-speedrun", {})))
    fast, base = [times["nano-speedrun"][s] for s in seeds], [times["nano"][s] for s in seeds]
    ratios = [b / f if not math.isinf(f) else 0.0 for b, f in zip(base, fast)]
    return row("7", "time to val 1.70: nano-speedrun against nano (ratio nano / speedrun)", fast, base, ratios,
               rounds, 2.0, ("s", 1))


def main():
    out = Path(sys.argv[1])
    names = (sys.argv[2] if len(sys.argv) > 2 else "nano,large,lora,full,gemma,speedrun").split(",")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    machine = dict(l.split(": ", 1) for l in (out / "machine.txt").read_text().splitlines() if ": " in l)
    flags = machine.get("flags", "").split()
    cpu_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    lines = [f"CPU: {machine.get('model name', '?')} (family {machine.get('cpu family', '?')}, model "
             f"{machine.get('model', '?')}); flags: {' '.join(flags) or 'none of the listed'}; "
             f"threads {machine.get('threads', '?')}; commit {machine.get('commit', '?')}; {machine.get('date', '?')}",
             f"{machine.get('python', '')}; {machine.get('ember', '')}", "",
             "| row | compared | ember | reference | ratio, median (min–max) | rounds | goal | met |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("nano", "large", "lora", "full", "gemma"):  # rows 1, 1b, 2, 2b, 3, 4, 5, 5b, 6, 6b
        if name in names:
            lines.append(side_rows(out, name, rounds))
            lines.append(bf16_row(out, name, rounds, cpu_bf16))
    if "speedrun" in names:
        lines.append(speedrun_row(out, rounds))
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
