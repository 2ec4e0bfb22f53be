#!/usr/bin/env python3
"""The bad-input catalogue, before and after, as a Markdown table.

Reads two recordings of `tests/bad_input/` (one JSON line per case, written by `refuse` when
`$EMBER_CATALOGUE` is set; see experiments/reliability.md for the commands) and prints one row per
case: the command line and the message the catalogue expects, what the binary before did, what the
binary after did; then the totals.

    python3 experiments/catalogue_report.py /tmp/cat-old.jsonl /tmp/cat-new.jsonl

Cases are joined by test, arguments, expected message and occurrence (many cases run the same
`train --config cfg.toml` on different configs). A case recorded in one file only is "not run" in
the other: its test stopped at a setup step that binary could not do.
"""

import json
import re
import sys
from collections import Counter

# What the recording wrapper (`timeout 60`) returns when it had to stop the command.
TIMEOUT_EXIT = 124
SIGNALS = {6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}
CLEAN = "clean error"
NOT_RUN = "not run"


def load(path):
    cases, seen = {}, Counter()
    for line in open(path, encoding="utf-8"):
        if not line.strip():
            continue
        r = json.loads(line)
        key = (r["test"], tuple(r["args"]), tuple(r["needles"]))
        seen[key] += 1
        cases[key + (seen[key],)] = r
    return cases


def outcome(r):
    """One case's outcome in words: `clean error` or what went wrong (the worst first)."""
    if r is None:
        return NOT_RUN
    err = (r.get("stderr_head", "") + r.get("stderr_tail", "")).lower()
    changed = not r["files_unchanged"]
    if r["exit"] == TIMEOUT_EXIT:
        what = "hung (stopped at 60 s)"
    elif r["signal"]:
        n = r.get("signal_number")
        if n == 6:
            what = "abort 134"
            if "memory allocation" in err or "alloc_error" in err or "rust_oom" in err:
                what += " (allocation failed)"
        else:
            what = f"signal {SIGNALS.get(n, n)}"
    elif r["exit"] == 101 or r["panicked"]:
        what = "panic 101"
    elif r["exit"] == 134:
        what = "abort 134"
    elif r["exit"] == 0:
        what = "exit 0"
    elif not r["named"]:
        what = "wrong or missing message"
    elif changed:
        return "changed files"
    else:
        return CLEAN
    return what + (", changed files" if changed else "")


def shorten(text, n):
    return text if len(text) <= n else text[: n - 1] + "…"


def case_label(key):
    test, args, needles, _ = key
    args = " ".join(a if re.fullmatch(r"[\w./:=-]+", a) else repr(a) for a in args)
    msg = " · ".join(needles)
    return f"`ember {shorten(args, 70)}` → “{shorten(msg, 70)}”"


def md(text):
    return text.replace("|", "\\|")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    before, after = load(sys.argv[1]), load(sys.argv[2])
    # The order of the newer recording (it has every case), then any case only the older one has.
    keys = list(after) + [k for k in before if k not in after]
    print("| # | test | case (command → expected message) | before | after |")
    print("|---:|---|---|---|---|")
    counts_before, counts_after = Counter(), Counter()
    for i, key in enumerate(keys, 1):
        b, a = outcome(before.get(key)), outcome(after.get(key))
        counts_before[b] += 1
        counts_after[a] += 1
        test = key[0].replace("_", " ")
        bold = lambda s: s if s in (CLEAN, NOT_RUN) else f"**{s}**"
        print(f"| {i} | {md(test)} | {md(case_label(key))} | {bold(b)} | {bold(a)} |")
    n = len(keys)
    print()
    print(f"**Cases: {n}. Clean before: {counts_before[CLEAN]} of {n - counts_before[NOT_RUN]} run "
          f"({counts_before[NOT_RUN]} not run). Clean after: {counts_after[CLEAN]} of {n - counts_after[NOT_RUN]} run"
          f"{f' ({counts_after[NOT_RUN]} not run)' if counts_after[NOT_RUN] else ''}.**")
    print()
    print("| outcome | before | after |")
    print("|---|---:|---:|")
    for o in sorted(set(counts_before) | set(counts_after), key=lambda o: (o == NOT_RUN, o != CLEAN, o)):
        print(f"| {o} | {counts_before[o]} | {counts_after[o]} |")


if __name__ == "__main__":
    main()
