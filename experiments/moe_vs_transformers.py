#!/usr/bin/env python3
"""ember and transformers eager f32, side by side: a training step, and single-stream decoding, of an
OLMoE-shaped mixture of experts.

The model is configs/bench-cpu-moe.toml's: 8 layers, width 512, 8 heads, 16 SwiGLU experts of 1,024, top 4,
a 32k vocabulary, 4 x 512 tokens a step. transformers runs it as a `MixtralForCausalLM` of that shape (random
weights; eager attention; the load-balancing loss in the loss through `output_router_logits`), trained with
torch.optim.AdamW and gradient clipping as ember's step does. Rounds alternate `ember bench train --json` and
this script's own timing (`--torch-only`), both pinned to the same CPUs with the same thread count; each
reports its median step. Prints one line per round and a summary (`--json`: one object).

`--decode`: the same model (transformers' random weights, saved and read by `ember import`, with the Llama 2
tokenizer of ../shared/tokenizers for its 32k vocabulary) decodes greedily with a KV cache from a 16-token
prompt: `ember bench decode` (its cached steps alone) against transformers' `generate` (timed generating N
and 1 tokens, the difference over N - 1), alternating.

    EMBER_DATA_DIR=../shared/datasets ../venv-ref/bin/python experiments/moe_vs_transformers.py --rounds 3
    ../venv-ref/bin/python experiments/moe_vs_transformers.py --decode --rounds 3

Needs a release build of ember (`cargo build --release -p ember-cli`) and torch + transformers.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import summarize  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "bench-cpu-moe.toml"


def hf_model(cfg):
    """transformers' Mixtral of the config's shape, random weights (seed 0)."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    m, e = cfg["model"], cfg["model"]["moe"]
    config = MixtralConfig(vocab_size=m["vocab_size"], hidden_size=m["d_model"], intermediate_size=e["d_expert"],
                           num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
                           num_key_value_heads=m["n_kv_heads"], max_position_embeddings=m["max_seq_len"],
                           num_local_experts=e["n_experts"], num_experts_per_tok=e["top_k"],
                           router_aux_loss_coef=e["aux_loss_coef"], tie_word_embeddings=False,
                           rms_norm_eps=m["norm_eps"], rope_theta=m["rope_theta"])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def torch_steps(cfg, steps, warmup, threads):
    import torch

    torch.set_num_threads(threads)
    t, o = cfg["train"], cfg["optim"]
    model = hf_model(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["schedule"]["lr"], betas=(o["beta1"], o["beta2"]),
                            eps=o["eps"], weight_decay=o["weight_decay"])
    b, s = t["batch_size"], t["seq_len"]
    gen = torch.Generator().manual_seed(1)
    times = []
    for i in range(warmup + steps):
        ids = torch.randint(0, 65, (b, s + 1), generator=gen)  # tinyshakespeare's characters, as ember's data
        start = time.perf_counter()
        out = model(ids[:, :-1], labels=ids[:, 1:], output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    step_ms = statistics.median(times)
    return {"step_ms": step_ms, "tokens_per_sec": b * s / (step_ms / 1e3),
            "params": sum(p.numel() for p in model.parameters())}


PROMPT = 16


def _timed(f):
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def decode(args, cfg, cpus, env):
    """Single-stream greedy decoding, ember against transformers, alternating."""
    import shutil
    import tempfile

    import torch

    os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    torch.set_num_threads(args.threads)
    model = hf_model(cfg).eval()
    vocab = model.config.vocab_size
    tmp = Path(tempfile.mkdtemp())
    model.save_pretrained(tmp / "hf")
    shared = Path(os.environ.get("EMBER_SHARED", ROOT.parent / "shared"))
    shutil.copy(shared / "tokenizers" / "llama2_tokenizer.json", tmp / "hf" / "tokenizer.json")
    subprocess.run([args.ember, "import", str(tmp / "hf"), "--out", str(tmp / "run")], env=env, check=True,
                   capture_output=True)
    ids = torch.tensor([[(i * 31 + 7) % vocab for i in range(PROMPT)]])

    def generate(n):
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] == PROMPT + n, out.shape

    rounds = []
    for r in range(args.rounds):
        cmd = ["taskset", "-c", cpus, args.ember, "bench", "decode", "--checkpoint", str(tmp / "run"), "--contexts",
               str(PROMPT), "--new-tokens", str(args.new_tokens), "--uncached-tokens", "1", "--json"]
        ember = run_json(cmd, env)["decode_tokens_per_sec"][0]
        generate(2)
        one = min(_timed(lambda: generate(1)) for _ in range(2))
        hf = (args.new_tokens - 1) / (_timed(lambda: generate(args.new_tokens)) - one)
        rounds.append({"ember_tokens_per_sec": ember, "transformers_tokens_per_sec": hf})
        print(f"round {r + 1}: ember {ember:.1f} tokens/s, transformers {hf:.1f} tokens/s, ratio {ember / hf:.3f}",
              flush=True)
    shutil.rmtree(tmp)
    ratios = [x["ember_tokens_per_sec"] / x["transformers_tokens_per_sec"] for x in rounds]
    print(json.dumps({"decode": rounds, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                      "ratio_max": max(ratios)}))


def run_json(cmd, env):
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ember", default=str(ROOT / "target" / "release" / "ember"))
    ap.add_argument("--torch-only", action="store_true", help="time transformers alone and print its JSON")
    ap.add_argument("--decode", action="store_true", help="single-stream decoding instead of training")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per timing (--decode)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = tomllib.loads(Path(args.config).read_text())
    if args.torch_only:
        print(json.dumps(torch_steps(cfg, args.steps, args.warmup, args.threads)))
        return

    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[: args.threads])
    pin = ["taskset", "-c", cpus]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    if args.decode:
        decode(args, cfg, cpus, env)
        return
    steps = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    ember = pin + [args.ember, "bench", "train", "--config", args.config, "--json"] + steps
    torch = pin + [sys.executable, __file__, "--config", args.config, "--threads", str(args.threads),
                   "--torch-only"] + steps
    rounds = []
    for r in range(args.rounds):
        e, t = run_json(ember, env), run_json(torch, env)
        rounds.append({"ember_step_ms": e["step_ms"], "torch_step_ms": t["step_ms"],
                       "ember_tokens_per_sec": e["tokens_per_sec"], "torch_tokens_per_sec": t["tokens_per_sec"],
                       "ember_peak_memory_bytes": e.get("peak_memory_bytes"), "torch_params": t["params"]})
        if not args.json:
            print(f"round {r + 1}: ember {e['step_ms']:.0f} ms/step ({e['tokens_per_sec']:.0f} tok/s), "
                  f"transformers {t['step_ms']:.0f} ms/step ({t['tokens_per_sec']:.0f} tok/s), "
                  f"ratio {e['tokens_per_sec'] / t['tokens_per_sec']:.3f}", flush=True)
    summary = summarize(rounds, config=args.config, threads=args.threads, cpus=cpus)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"ember {summary['ember_tokens_per_sec']:.0f} tok/s, transformers {summary['torch_tokens_per_sec']:.0f} "
              f"tok/s, ember/transformers {summary['ratio_median']:.3f} "
              f"(range {summary['ratio_min']:.3f}-{summary['ratio_max']:.3f})")


if __name__ == "__main__":
    main()
