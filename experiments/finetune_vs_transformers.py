#!/usr/bin/env python3
"""ember's fine-tuning step beside transformers (+ peft for LoRA), same shapes, same cores.

Reads an ember config (configs/smollm2-135m-lora.toml, configs/smollm2-135m-full.toml): the model
shapes, `seq_len`, `batch_size`, `grad_accum_steps`, the optimizer and, with a `[lora]` table, the
adapters (rank, alpha, targets). PyTorch runs `LlamaForCausalLM` of those shapes (random init, SDPA
attention, tied embeddings), or `Gemma3ForCausalLM` for a Gemma-shaped config (`norm =
"rms_norm_plus_one"`, `mlp = "geglu"`: configs/gemma3-270m-lora.toml), wrapped by `peft` when the config has `[lora]`, AdamW with clipping, the
same micro-batches, in f32 or under `torch.autocast("cpu", torch.bfloat16)`. ember runs
`ember bench train --json` at the same precision. Runs alternate (a slow spell of a shared machine
hits both), pinned to the same CPUs, the same thread count; each run is timed by its own median
step and its peak RSS is read by `/usr/bin/time`.

    python experiments/finetune_vs_transformers.py --config configs/smollm2-135m-lora.toml \\
        --precisions f32,bf16 --rounds 3 --steps 3 --warmup 2

Run it with a Python that has torch, transformers and peft.
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

ROOT = Path(__file__).resolve().parent.parent


def measured(cmd, env):
    """Runs cmd under /usr/bin/time: its last stdout line as JSON, and its peak RSS in bytes."""
    proc = subprocess.run(["/usr/bin/time", "-f", "MAXRSS %M"] + cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rss = next(int(l.split()[1]) * 1024 for l in proc.stderr.splitlines() if l.startswith("MAXRSS "))
    return json.loads(proc.stdout.strip().splitlines()[-1]), rss


def torch_child(args):
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    cfg = tomllib.loads(Path(args.config).read_text())
    m, t, o = cfg["model"], cfg["train"], cfg.get("optim", {})
    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    shapes = dict(
        vocab_size=m["vocab_size"], hidden_size=m["d_model"], intermediate_size=m["d_ff"],
        num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
        num_key_value_heads=m.get("n_kv_heads", m["n_heads"]), max_position_embeddings=m["max_seq_len"],
        rms_norm_eps=m.get("norm_eps", 1e-5), tie_word_embeddings=m.get("tie_embeddings", False),
        attn_implementation="sdpa")
    if m.get("norm") == "rms_norm_plus_one" and m.get("mlp") == "geglu":
        pattern = m.get("sliding_window_pattern") or 1
        config = Gemma3TextConfig(
            **shapes, head_dim=m["head_dim"], query_pre_attn_scalar=int(m.get("query_pre_attn_scalar", m["head_dim"])),
            sliding_window=m.get("sliding_window"), hidden_activation="gelu_pytorch_tanh",
            layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                         for i in range(m["n_layers"])],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": m.get("rope_theta", 10000.0)},
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": m.get("rope_local_theta", m.get("rope_theta", 10000.0))}})
        model = Gemma3ForCausalLM(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shapes, rope_theta=m.get("rope_theta", 10000.0)))
    if "lora" in cfg:
        from peft import LoraConfig, get_peft_model

        lora = cfg["lora"]
        model = get_peft_model(model, LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                                 target_modules=lora["targets"]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(o.get("beta1", 0.9), o.get("beta2", 0.95)),
                            eps=o.get("eps", 1e-8), weight_decay=o.get("weight_decay", 0.1))
    batch, seq, accum = t["batch_size"], t["seq_len"], t.get("grad_accum_steps", 1)
    gen = torch.Generator().manual_seed(0)
    bf16 = args.precision == "bf16"

    def step():
        for _ in range(accum):
            ids = torch.randint(0, 65, (batch, seq), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=ids, labels=ids).loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.get("grad_clip", 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    print(json.dumps({"step_ms": ms, "tokens_per_sec": batch * seq * accum / ms * 1e3,
                      "trainable": sum(p.numel() for p in params), "torch": torch.__version__}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--precisions", default="f32", help="comma-separated: f32, bf16")
    ap.add_argument("--precision", default="f32", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run: two, so that the timed ones find their memory faulted in")
    ap.add_argument("--ember", default=str(ROOT / "target" / "release" / "ember"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return torch_child(args)

    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[: args.threads])
    pin = ["taskset", "-c", cpus]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    steps = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in lscpu.splitlines() if l.startswith("Flags")), [])
    print(f"CPU: {model_name}; {' '.join(f for f in flags if f.startswith(('avx512', 'amx')))}", flush=True)

    results = {}
    for precision in args.precisions.split(","):
        ember = pin + [args.ember, "bench", "train", "--config", args.config, "--precision", precision, "--json"] + steps
        torch = pin + [sys.executable, __file__, "--child", "--config", args.config, "--precision", precision,
                       "--threads", str(args.threads)] + steps
        rounds = []
        for r in range(args.rounds):
            (e, e_rss), (t, t_rss) = measured(ember, env), measured(torch, env)
            rounds.append({"ember_tokens_per_sec": e["tokens_per_sec"], "torch_tokens_per_sec": t["tokens_per_sec"],
                           "ember_step_ms": e["step_ms"], "torch_step_ms": t["step_ms"],
                           "ember_peak_rss": e_rss, "torch_peak_rss": t_rss})
            print(f"{precision} round {r + 1}: ember {e['step_ms']:.0f} ms/step ({e['tokens_per_sec']:.1f} tok/s, "
                  f"{e_rss / 2**30:.2f} GiB), torch {t['step_ms']:.0f} ms/step ({t['tokens_per_sec']:.1f} tok/s, "
                  f"{t_rss / 2**30:.2f} GiB), ratio {e['tokens_per_sec'] / t['tokens_per_sec']:.2f}", flush=True)
        med = lambda key: statistics.median(x[key] for x in rounds)
        results[precision] = {key: med(key) for key in rounds[0]} | {"rounds": rounds}
    print(json.dumps({"config": args.config, "cpu": model_name, "results": results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
