#!/usr/bin/env python3
"""nanoGPT itself beside ember on nanoGPT's CPU setting of shakespeare_char (its README, "I only have
a macbook"): `train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
--log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
--max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`, its model.py run eagerly in f32, against
`ember train --config configs/gpt2-shakespeare-char.toml` (the same model: LayerNorm without bias,
exact GELU, learned positions, tied head).

Speed: alternating rounds, pinned to the same CPUs with the same thread count, nanoGPT's
`train.py` for `--iters` iterations (the median of its own per-iteration times, past the first
ten, eval iterations excluded by the median) against `ember bench train` (the median step). With
`--full`, also both complete 2,000-iteration runs: best validation loss and wall time.

    python experiments/nanogpt_side_by_side.py --nanogpt PATH/TO/nanoGPT --ember target/release/ember \\
        --rounds 5 --full

PATH/TO/nanoGPT is a checkout of https://github.com/karpathy/nanoGPT (its `train.py`, `model.py`,
`configurator.py`, `config/`). The script copies it to a scratch folder and writes the character
data there as nanoGPT's `data/shakespeare_char/prepare.py` would (the same 90/10 split of the
same sorted characters), from tinyshakespeare as ember finds it ($EMBER_DATA_DIR or datasets/), so
nothing is downloaded. Run it with a Python that has torch and numpy.
"""

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "gpt2-shakespeare-char.toml"
SETTING = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
           "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--lr_decay_iters=2000",
           "--dropout=0.0"]


def tinyshakespeare():
    roots = [os.environ.get("EMBER_DATA_DIR", ""), str(ROOT / "datasets"), str(ROOT.parent / "shared" / "datasets")]
    for r in roots:
        p = Path(r) / "tinyshakespeare" / "input.txt"
        if r and p.is_file():
            return p
    sys.exit(f"tinyshakespeare/input.txt not found under {roots}: set EMBER_DATA_DIR")


def prepare(nanogpt, scratch):
    """nanoGPT's tree in scratch with data/shakespeare_char written as its prepare.py writes it."""
    import numpy as np

    tree = scratch / "nanoGPT"
    shutil.copytree(nanogpt, tree, ignore=shutil.ignore_patterns(".git", "out-*"))
    data = tinyshakespeare().read_text(encoding="utf-8")
    chars = sorted(set(data))
    stoi = {c: i for i, c in enumerate(chars)}
    n = len(data)
    out = tree / "data" / "shakespeare_char"
    out.mkdir(parents=True, exist_ok=True)
    np.array([stoi[c] for c in data[: int(n * 0.9)]], dtype=np.uint16).tofile(out / "train.bin")
    np.array([stoi[c] for c in data[int(n * 0.9):]], dtype=np.uint16).tofile(out / "val.bin")
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return tree


def nanogpt_run(tree, iters, pin, env, out_dir):
    """nanoGPT's train.py for `iters` iterations: its per-iteration times (ms), best val, wall (s)."""
    cmd = pin + [sys.executable, "train.py", "config/train_shakespeare_char.py", *SETTING,
                 f"--max_iters={iters}", f"--out_dir={out_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"nanoGPT failed:\n{proc.stderr[-3000:]}")
    times = [float(m.group(1)) for m in re.finditer(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", proc.stdout, re.M)]
    vals = [float(m.group(1)) for m in re.finditer(r"^step \d+: train loss [\d.]+, val loss ([\d.]+)", proc.stdout, re.M)]
    return times, min(vals) if vals else None, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanogpt", required=True, help="a nanoGPT checkout")
    ap.add_argument("--ember", default=str(ROOT / "target" / "release" / "ember"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=120, help="nanoGPT iterations a speed round")
    ap.add_argument("--full", action="store_true", help="also both complete 2,000-iteration runs")
    args = ap.parse_args()

    import torch

    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[: args.threads])
    pin = ["taskset", "-c", cpus]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
               EMBER_DATA_DIR=str(tinyshakespeare().parent.parent))
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in lscpu.splitlines() if l.startswith("Flags")), [])
    print(f"CPU: {model}; {' '.join(f for f in flags if f.startswith(('avx512', 'amx')))}; "
          f"CPUs {cpus}; torch {torch.__version__}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        tree = prepare(Path(args.nanogpt), scratch)
        tokens = 12 * 64
        rounds = []
        for r in range(args.rounds):
            times, _, _ = nanogpt_run(tree, args.iters, pin, env, scratch / "out-speed")
            nano_ms = statistics.median(times[10:])
            e = json.loads(subprocess.run(
                pin + [args.ember, "bench", "train", "--config", str(CONFIG), "--precision", "f32", "--json",
                       "--steps", str(args.iters - 10), "--warmup", "10"],
                env=env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
            rounds.append({"nanogpt_ms": nano_ms, "ember_ms": e["step_ms"],
                           "nanogpt_tokens_per_sec": tokens / nano_ms * 1e3, "ember_tokens_per_sec": e["tokens_per_sec"]})
            print(f"round {r + 1}: nanoGPT {nano_ms:.2f} ms/iter ({tokens / nano_ms * 1e3:.0f} tok/s), ember "
                  f"{e['step_ms']:.2f} ms/step ({e['tokens_per_sec']:.0f} tok/s), "
                  f"ratio {nano_ms / e['step_ms']:.2f}", flush=True)
        ratios = [x["nanogpt_ms"] / x["ember_ms"] for x in rounds]
        summary = {"cpu": model, "rounds": rounds,
                   "nanogpt_tokens_per_sec": statistics.median(x["nanogpt_tokens_per_sec"] for x in rounds),
                   "ember_tokens_per_sec": statistics.median(x["ember_tokens_per_sec"] for x in rounds),
                   "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        if args.full:
            _, best, wall = nanogpt_run(tree, 2000, pin, env, scratch / "out-full")
            summary["nanogpt_full"] = {"best_val": best, "wall_s": wall}
            print(f"nanoGPT 2,000 iterations: best val {best:.4f}, {wall:.0f} s", flush=True)
            run_dir = scratch / "ember-full"
            start = time.perf_counter()
            subprocess.run(pin + [args.ember, "train", "--config", str(CONFIG), "--run-dir", str(run_dir)],
                           env=env, check=True, capture_output=True, text=True)
            wall = time.perf_counter() - start
            vals = [json.loads(l).get("val_loss") for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
            best = min(v for v in vals if v is not None)
            summary["ember_full"] = {"best_val": best, "wall_s": wall}
            print(f"ember 2,000 steps: best val {best:.4f}, {wall:.0f} s", flush=True)
        print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
