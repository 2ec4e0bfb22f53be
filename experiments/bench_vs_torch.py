#!/usr/bin/env python3
"""ember and PyTorch eager, side by side: the same training step of the same config on the same cores.

Alternates `ember bench train --json` and `torch_reference.py bench --json` for several rounds (so
that a slow spell of a shared machine hits both), both pinned to the same CPUs with the same thread
count, f32 unless `--precision` / `--torch-precision` say bf16 (ember's bf16 products; torch.autocast
on the CPU, oneDNN). Each round reports each side's median step time; the summary is the median over rounds
of the tokens/s of each, and of the per-round ratio ember / torch.

    python experiments/bench_vs_torch.py --config configs/nano.toml
    python experiments/bench_vs_torch.py --config configs/bench-cpu-large.toml --steps 10 --rounds 5
    python experiments/bench_vs_torch.py --config configs/bench-cpu-large-gpt2.toml --precision bf16 --torch-precision f32

Needs a release build of ember (`cargo build --release -p ember-cli`, or --ember PATH) and a Python
with torch (run this script with it). Data: $EMBER_DATA_DIR as for `ember train`.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import summarize  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run_json(cmd, env):
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run (each side reports its median)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ember", default=str(ROOT / "target" / "release" / "ember"))
    ap.add_argument("--json", action="store_true", help="print one JSON object with every round")
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32", help="ember's precision")
    ap.add_argument("--torch-precision", choices=["f32", "bf16"], default=None,
                    help="PyTorch's (bf16: autocast); the same as --precision unless given")
    args = ap.parse_args()

    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[: args.threads])
    pin = ["taskset", "-c", cpus]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    steps = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    ember = pin + [args.ember, "bench", "train", "--config", args.config, "--precision", args.precision, "--json"] + steps
    torch = pin + [sys.executable, str(ROOT / "experiments" / "torch_reference.py"), "bench", "--config",
                   args.config, "--threads", str(args.threads), "--json",
                   "--precision", args.torch_precision or args.precision] + steps

    rounds = []
    for r in range(args.rounds):
        e, t = run_json(ember, env), run_json(torch, env)
        rounds.append({"ember_tokens_per_sec": e["tokens_per_sec"], "torch_tokens_per_sec": t["tokens_per_sec"],
                       "ember_step_ms": e["step_ms"], "torch_step_ms": t["step_ms"], "ember_mfu": e.get("mfu")})
        if not args.json:
            print(f"round {r + 1}: ember {e['step_ms']:.1f} ms/step ({e['tokens_per_sec']:.0f} tok/s), "
                  f"torch {t['step_ms']:.1f} ms/step ({t['tokens_per_sec']:.0f} tok/s), "
                  f"ratio {e['tokens_per_sec'] / t['tokens_per_sec']:.3f}", flush=True)
    summary = summarize(rounds, config=args.config, threads=args.threads, cpus=cpus, ember_precision=args.precision,
                        torch_precision=args.torch_precision or args.precision)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{args.config}, {args.threads} threads on CPUs {cpus}, {args.rounds} rounds, ember "
              f"{summary['ember_precision']} against torch {summary['torch_precision']}: "
              f"ember {summary['ember_tokens_per_sec']:.0f} tok/s, torch {summary['torch_tokens_per_sec']:.0f} tok/s, "
              f"ember/torch {summary['ratio_median']:.3f} (range {summary['ratio_min']:.3f}-{summary['ratio_max']:.3f})")


if __name__ == "__main__":
    main()
