#!/usr/bin/env python3
"""PyTorch eager reference of ember's model and training step, for side-by-side measurements.

The same architecture as crates/model (RMSNorm with an f32 reduction, split-half RoPE, grouped-query
attention, SwiGLU, untied or tied head), the same init (normal(0, 0.02), o_proj/down_proj over
sqrt(2L)), AdamW with weight decay on matrices only, global-norm clipping, nanoGPT's warmup + cosine
schedule, and random windows of the char-level tinyshakespeare split. It reads ember's TOML configs.
A config with `norm = "layer_norm"` and a plain GELU MLP (`mlp = "gelu"` or `"gelu_exact"`) with
learned positions gets nanoGPT's GPT-2 block instead (one fused c_attn, LayerNorm with or without
bias, GELU, learned `wpe`, `F.scaled_dot_product_attention`), written the way nanoGPT's model.py is.

    # time the training step (median over steps), as `ember bench train` does
    python experiments/torch_reference.py bench --config configs/nano.toml --threads 2
    # train the whole config and report the best validation loss (fixed eval batches)
    python experiments/torch_reference.py train --config configs/nano.toml

Needs torch (CPU is enough); run by hand, never by CI. Data: $EMBER_DATA_DIR/tinyshakespeare/input.txt
or datasets/tinyshakespeare/input.txt.
"""
import argparse
import json
import math
import os
import statistics
import time
import tomllib

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(t_max, dh, theta):
    inv = theta ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    ang = torch.arange(t_max, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()  # [T, dh/2]


def rope(x, cos, sin):  # x [B, H, T, dh], split-half layout
    t = x.shape[2]
    h = x.shape[3] // 2
    c, s = cos[:t], sin[:t]
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        d, h, k = m["d_model"], m["n_heads"], m.get("n_kv_heads") or m["n_heads"]
        dh = m.get("head_dim") or d // h
        bias = m.get("qkv_bias", False)
        self.h, self.k, self.dh = h, k, dh
        eps = m.get("norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(d, eps)
        self.q_proj = nn.Linear(d, h * dh, bias=bias)
        self.k_proj = nn.Linear(d, k * dh, bias=bias)
        self.v_proj = nn.Linear(d, k * dh, bias=bias)
        self.o_proj = nn.Linear(h * dh, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.gate_proj = nn.Linear(d, m["d_ff"], bias=False)
        self.up_proj = nn.Linear(d, m["d_ff"], bias=False)
        self.down_proj = nn.Linear(m["d_ff"], d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(b, t, self.h, self.dh).transpose(1, 2)
        k = self.k_proj(y).view(b, t, self.k, self.dh).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.k, self.dh).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = self.h // self.k
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, self.h * self.dh))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class GptBlock(nn.Module):
    """nanoGPT's Block: x + attn(ln_1(x)), then + mlp(ln_2(x)), with one q/k/v projection."""

    def __init__(self, m):
        super().__init__()
        d, self.h = m["d_model"], m["n_heads"]
        bias, eps = m.get("qkv_bias", False), m.get("norm_eps", 1e-5)
        self.ln_1 = nn.LayerNorm(d, eps=eps, bias=m.get("norm_bias", False))
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=m.get("o_bias", False))
        self.ln_2 = nn.LayerNorm(d, eps=eps, bias=m.get("norm_bias", False))
        self.c_fc = nn.Linear(d, m["d_ff"], bias=m.get("mlp_bias", False))
        self.gelu = nn.GELU(approximate="none" if m.get("mlp") == "gelu_exact" else "tanh")
        self.mlp_proj = nn.Linear(m["d_ff"], d, bias=m.get("mlp_bias", False))

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(o.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x))))


def is_gpt(m):
    return m.get("norm") == "layer_norm" and m.get("mlp") in ("gelu", "gelu_exact") and m.get("positions") == "learned"


class Decoder(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.embed_tokens = nn.Embedding(m["vocab_size"], m["d_model"])
        self.gpt = is_gpt(m)
        self.wpe = nn.Embedding(m["max_seq_len"], m["d_model"]) if self.gpt else None
        self.layers = nn.ModuleList([(GptBlock if self.gpt else Block)(m) for _ in range(m["n_layers"])])
        if self.gpt:
            self.norm = nn.LayerNorm(m["d_model"], eps=m.get("norm_eps", 1e-5), bias=m.get("norm_bias", False))
        else:
            self.norm = RMSNorm(m["d_model"], m.get("norm_eps", 1e-5))
        self.tied = m.get("tie_embeddings", False)
        self.lm_head = None if self.tied else nn.Linear(m["d_model"], m["vocab_size"], bias=False)
        dh = m.get("head_dim") or m["d_model"] // m["n_heads"]
        cos, sin = rope_tables(m["max_seq_len"], dh, m.get("rope_theta", 10000.0))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        std = m.get("init_std", 0.02)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                out = ("o_proj.weight", "down_proj.weight", "c_proj.weight", "mlp_proj.weight")
                scale = 1 / math.sqrt(2 * m["n_layers"]) if name.endswith(out) else 1
                nn.init.normal_(p, 0.0, std * scale)

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        if self.gpt:
            x = x + self.wpe(torch.arange(idx.shape[1]))
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        x = self.norm(x)
        logits = x @ self.embed_tokens.weight.T if self.tied else self.lm_head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def load_data(val_fraction):
    roots = [os.environ.get("EMBER_DATA_DIR", ""), "datasets"]
    path = next(p for p in (os.path.join(r, "tinyshakespeare", "input.txt") for r in roots) if os.path.isfile(p))
    text = open(path, encoding="utf-8").read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(len(ids) * (1 - val_fraction))
    return ids[:n], ids[n:], len(chars)


def batch(data, b, t, gen):
    ix = torch.randint(len(data) - t, (b,), generator=gen)
    x = torch.stack([data[i : i + t] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + t] for i in ix])
    return x, y


def lr_at(step, s, max_steps):
    decay = s.get("decay_steps") or max_steps
    warm = s.get("warmup_steps", 0)
    if step < warm:
        return s["lr"] * (step + 1) / (warm + 1)
    if step >= decay:
        return s.get("min_lr", 0.0)
    r = (step - warm) / max(decay - warm, 1)
    return s.get("min_lr", 0.0) + 0.5 * (1 + math.cos(math.pi * r)) * (s["lr"] - s.get("min_lr", 0.0))


def setup(config_path):
    cfg = tomllib.load(open(config_path, "rb"))
    m, t, o = cfg["model"], cfg["train"], cfg["optim"]
    train, val, vocab = load_data(cfg["data"].get("val_fraction", 0.1))
    m.setdefault("vocab_size", vocab)
    if not m["vocab_size"]:
        m["vocab_size"] = vocab
    torch.manual_seed(t.get("seed", 1337))
    model = Decoder(m)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.get("weight_decay", 0.0)}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg["schedule"]["lr"],
        betas=(o.get("beta1", 0.9), o.get("beta2", 0.95)),
        eps=o.get("eps", 1e-8),
    )
    return cfg, model, opt, train, val


def step(cfg, model, opt, data, i, gen, autocast=None):
    t = cfg["train"]
    seq = t.get("seq_len") or cfg["model"]["max_seq_len"]
    accum = t.get("grad_accum_steps", 1)
    for g in opt.param_groups:
        g["lr"] = lr_at(i, cfg["schedule"], t["max_steps"])
    total = 0.0
    for _ in range(accum):
        x, y = batch(data, t["batch_size"], seq, gen)
        if autocast is None:
            loss = model(x, y) / accum
        else:
            with torch.autocast("cpu", dtype=autocast):
                loss = model(x, y) / accum
        loss.backward()
        total += loss.item()
    clip = cfg["optim"].get("grad_clip", 0.0)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def evaluate(cfg, model, data, iters, seed):
    gen = torch.Generator().manual_seed(seed)
    t = cfg["train"]
    seq = t.get("seq_len") or cfg["model"]["max_seq_len"]
    return sum(model(*batch(data, t["batch_size"], seq, gen)).item() for _ in range(iters)) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["bench", "train"])
    ap.add_argument("--config", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                    help="bf16: the forward under torch.autocast(\"cpu\", bfloat16) (oneDNN's bf16 products)")
    args = ap.parse_args()
    autocast = torch.bfloat16 if args.precision == "bf16" else None
    torch.set_num_threads(args.threads)
    cfg, model, opt, train, val = setup(args.config)
    gen = torch.Generator().manual_seed(cfg["train"].get("seed", 1337))
    t = cfg["train"]
    seq = t.get("seq_len") or cfg["model"]["max_seq_len"]
    tokens_per_step = t["batch_size"] * seq * t.get("grad_accum_steps", 1)
    if args.mode == "bench":
        times = []
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            step(cfg, model, opt, train, i, gen, autocast)
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times)
        out = {"framework": f"torch {torch.__version__} eager {args.precision}", "precision": args.precision, "threads": args.threads, "step_ms": ms,
               "step_ms_min": min(times), "step_ms_max": max(times), "tokens_per_sec": tokens_per_step / ms * 1e3}
        print(json.dumps(out) if args.json else
              f"{out['framework']}, {args.threads} threads: {ms:.1f} ms/step (median of {args.steps}), "
              f"{out['tokens_per_sec']:.0f} tokens/s")
        return
    best, start = float("inf"), time.perf_counter()
    for i in range(t["max_steps"]):
        loss = step(cfg, model, opt, train, i, gen, autocast)
        s = i + 1
        if s % t["eval_interval"] == 0 or s == t["max_steps"]:
            model.eval()
            vl = evaluate(cfg, model, val, t["eval_iters"], 1)
            model.train()
            best = min(best, vl)
            print(f"step {s}: loss {loss:.4f}, val {vl:.4f}, {time.perf_counter() - start:.0f} s", flush=True)
    print(f"best val loss {best:.4f}")


if __name__ == "__main__":
    main()
