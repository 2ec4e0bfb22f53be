#!/usr/bin/env python3
"""ember's decoding beside transformers' `generate`, and both against the memory bound.

The model is the shared SmolLM2-135M-Instruct GGUF: transformers dequantises it to f32 on load
(`gguf_file=`), `ember import` does the same. Both decode greedily with a KV cache, f32, on the same
pinned CPUs with the same thread count, alternating run by run so that a slow spell of a shared
machine hits both:

- single stream: a 16-token prompt, `--new-tokens` tokens (default 200);
- batch: `--batch` (default 8) different 16-token prompts side by side, `--batch-tokens` each
  (default 100), the aggregate tokens/s.

The decode rate excludes the prompt: transformers is timed generating N and 1 tokens, the difference
divided by N - 1; `ember bench decode` reports its cached steps alone.

The memory bound: the f32 weight bytes a token must read (every parameter once; the tied head once)
over the read bandwidth measured here (numpy summing a 1 GiB array, best of 5).

    ember import ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf --out smol
    python experiments/decode_vs_transformers.py --checkpoint smol \\
        --gguf ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf

Run it with a Python that has torch, transformers, gguf and numpy.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 16


def read_bandwidth():
    import numpy as np

    a = np.ones(1 << 28, dtype=np.float32)  # 1 GiB
    best = min(_timed(a.sum) for _ in range(5))
    return a.nbytes / best


def _timed(f):
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def ember_rate(args, batch, new_tokens, env, pin):
    cmd = pin + [args.ember, "bench", "decode", "--checkpoint", args.checkpoint, "--contexts", str(PROMPT),
                 "--new-tokens", str(new_tokens), "--uncached-tokens", "1", "--batch", str(batch), "--json"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["decode_tokens_per_sec"][0]


def transformers_rate(model, torch, batch, new_tokens, vocab):
    ids = torch.tensor([[(i * 31 + 7 + row * 101) % vocab for i in range(PROMPT)] for row in range(batch)])
    mask = torch.ones_like(ids)

    def generate(n):
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
        assert out.shape[1] == PROMPT + n, out.shape

    generate(2)  # warm-up
    one = min(_timed(lambda: generate(1)) for _ in range(2))
    full = _timed(lambda: generate(new_tokens))
    return batch * (new_tokens - 1) / (full - one)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="the GGUF imported by `ember import`")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=100)
    ap.add_argument("--ember", default=str(ROOT / "target" / "release" / "ember"))
    args = ap.parse_args()

    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    os.sched_setaffinity(0, cpus)
    pin = ["taskset", "-c", ",".join(map(str, cpus))]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = read_bandwidth()
    bound_ms = weight_bytes / bandwidth * 1e3
    print(f"weights {weight_bytes / 1e6:.1f} MB f32, read bandwidth {bandwidth / 1e9:.1f} GB/s: "
          f"bound {bound_ms:.1f} ms/token ({1e3 / bound_ms:.1f} tokens/s); torch {torch.__version__}", flush=True)

    rows = []
    for r in range(args.rounds):
        row = {
            "ember_1": ember_rate(args, 1, args.new_tokens, env, pin),
            "hf_1": transformers_rate(model, torch, 1, args.new_tokens, vocab),
            "ember_b": ember_rate(args, args.batch, args.batch_tokens, env, pin),
            "hf_b": transformers_rate(model, torch, args.batch, args.batch_tokens, vocab),
        }
        rows.append(row)
        print(f"round {r + 1}: single ember {row['ember_1']:.1f} / transformers {row['hf_1']:.1f} tokens/s; "
              f"batch {args.batch} ember {row['ember_b']:.1f} / transformers {row['hf_b']:.1f} tokens/s", flush=True)
    med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
    print(json.dumps({
        "weight_bytes": weight_bytes,
        "read_bandwidth_gbs": bandwidth / 1e9,
        "bound_ms_per_token": bound_ms,
        "median_tokens_per_sec": med,
        "single_ratio": med["ember_1"] / med["hf_1"],
        "single_vs_bound": (1e3 / med["ember_1"]) / bound_ms,
        "batch_ratio": med["ember_b"] / med["hf_b"],
        "rounds": rows,
    }, indent=1))


if __name__ == "__main__":
    sys.exit(main())
