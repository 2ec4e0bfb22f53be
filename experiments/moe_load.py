#!/usr/bin/env python3
"""The expert load curves of a mixture-of-experts run: from RUN/metrics.jsonl, every `--every` steps, the
balancing loss and each layer's max/mean expert load (1 is even; E is every pair on one expert), as a
Markdown table.

    python experiments/moe_load.py runs/moe-nano --every 250
"""

import argparse
import json
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--every", type=int, default=250)
    args = ap.parse_args()
    rows = []
    for line in (Path(args.run) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "expert_load" in r:
            rows.append(r)
    if not rows:
        raise SystemExit(f"{args.run}/metrics.jsonl has no expert_load: not a mixture-of-experts run")
    layers = len(rows[0]["expert_load"])
    ratio = lambda r, l: max(r["expert_load"][l]) * len(r["expert_load"][l])
    head = ["step", "train loss", "val loss", "aux loss"] + [f"layer {l} max/mean" for l in range(layers)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        if r["step"] % args.every and r is not rows[0] and r is not rows[-1]:
            continue
        val = f"{r['val_loss']:.4f}" if "val_loss" in r else ""
        cells = [str(r["step"]), f"{r['train_loss']:.4f}", val, f"{r['aux_loss']:.4f}"]
        cells += [f"{ratio(r, l):.2f}" for l in range(layers)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
