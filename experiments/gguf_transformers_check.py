"""Loads GGUF files in Hugging Face transformers and checks them against ember (experiments/gguf.md).

For each `--gguf LABEL=PATH`:
  1. greedy chat answers to each `--prompt` (the file's own chat template, generation prompt added,
     stop at the end-of-turn token), printed next to ember's answers when `--ember LABEL=FILE` gives
     the output of `ember sample --chat --temperature 0` for the same prompts;
  2. with `--jsonl`, the completion loss of those chat examples: each example tokenized the way ember
     does (the chat rendered turn by turn; the text an assistant turn adds, and the token ember appends
     after every example, are scored), run alone from position 0, mean negative log-likelihood over the
     scored tokens. This is the number `ember eval --perplexity --data FILE.jsonl` prints, so the two
     compare the logits of ember and transformers on the same weights. Also printed: the loss without
     the appended token, and that token's own loss.

Run with the reference venv (transformers, torch, gguf), e.g.:
  /root/venv-ref/bin/python experiments/gguf_transformers_check.py \
      --gguf tuned-f32=/tmp/x/tuned-f32.gguf --ember tuned-f32=/tmp/x/ember-tuned.txt \
      --prompt "Who are you?" --jsonl /tmp/x/val.jsonl --out /tmp/x/transformers.json
"""

import argparse
import json
import os
import re
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MARK = "Emberling"


def parse_ember(path, prompts):
    """Answers from the stdout of `ember sample --chat`: `=== i ===` headers, each followed by the
    prompt and the generated text."""
    text = open(path, encoding="utf-8").read()
    parts = re.split(r"^=== (\d+) ===\n", text, flags=re.M)
    out = {}
    for i in range(1, len(parts) - 1, 2):
        k, body = int(parts[i]), parts[i + 1]
        p = prompts[k]
        body = body[len(p):] if body.startswith(p) else body
        out[k] = body.rstrip("\n")
    return [out.get(i) for i in range(len(prompts))]


# The token ember appends (scored) after every example: the first of these its vocabulary has
# (crates/data/src/tokenizer.rs `eos_id`). For SmolLM2 that is `<|endoftext|>` (0), not the model's own
# end-of-turn/eos token `<|im_end|>` (2) that the chat template already puts at the end of the turn.
EMBER_EOS = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>"]


def ember_eos_id(tok):
    vocab = tok.get_vocab()
    return next((vocab[t] for t in EMBER_EOS if t in vocab), None)


def chat_ids(tok, messages, eos):
    """ember's encoding of a chat example (crates/data/src/finetune.rs `encode`): ids and scored flags."""
    ids, scored, done = [], [], ""
    render = lambda m, gen: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)
    for i, m in enumerate(messages):
        before = render(messages[:i], True) if m["role"] == "assistant" else done
        after = render(messages[: i + 1], False)
        head = before[len(done):] if before.startswith(done) else before
        part = tok.encode(head, add_special_tokens=False)
        ids += part
        scored += [False] * len(part)
        if after.startswith(before):
            part = tok.encode(after[len(before):], add_special_tokens=False)
            ids += part
            scored += [m["role"] == "assistant"] * len(part)
        else:
            part = tok.encode(after[len(done):] if after.startswith(done) else after, add_special_tokens=False)
            ids += part
            scored += [False] * len(part)
        done = after
    if eos is not None and ids[-1] != eos:
        ids.append(eos)
        scored.append(True)
    return ids, scored


@torch.no_grad()
def completion_loss(model, tok, path):
    """Mean NLL of the scored tokens as ember scores them, and the same without the appended token."""
    eos = ember_eos_id(tok)
    total, count, last, kept = 0.0, 0, 0.0, []
    for line in open(path, encoding="utf-8"):
        if not line.strip():
            continue
        ids, scored = chat_ids(tok, json.loads(line)["messages"], eos)
        logits = model(torch.tensor([ids])).logits[0].double()
        kept.append(logits.float())
        logp = torch.log_softmax(logits, dim=-1)
        for t in range(1, len(ids)):
            if scored[t]:
                total -= logp[t - 1, ids[t]].item()
                count += 1
        last -= logp[len(ids) - 2, ids[-1]].item()  # the appended token (ember's eos)
    n = sum(1 for line in open(path, encoding="utf-8") if line.strip())
    return {"nll": total / count, "scored_tokens": count, "appended_token_id": eos,
            "appended_token_nll": last / n, "nll_without_appended": (total - last) / (count - n)}, kept


def compare_logits(a, b):
    """Logits of the same examples from two models: largest and mean absolute difference, and how often
    the most likely next token agrees."""
    diffs = [(x - y).abs() for x, y in zip(a, b)]
    agree = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b))
    positions = sum(x.shape[0] for x in a)
    return {"max_abs": max(float(d.max()) for d in diffs),
            "mean_abs": sum(float(d.sum()) for d in diffs) / sum(d.numel() for d in diffs),
            "top1_agree": agree, "positions": positions,
            "logit_scale_mean_abs": sum(float(x.abs().sum()) for x in a) / sum(x.numel() for x in a)}


@torch.no_grad()
def answer(model, tok, prompt, max_new_tokens):
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", action="append", required=True, help="LABEL=PATH")
    ap.add_argument("--ember", action="append", default=[], help="LABEL=FILE: ember sample --chat output")
    ap.add_argument("--prompt", action="append", required=True)
    ap.add_argument("--jsonl", help="chat examples whose completion loss to measure")
    ap.add_argument("--compare", action="append", default=[],
                    help="A,B: compare the logits of two --gguf labels on the --jsonl examples")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ember = {k: parse_ember(v, args.prompt) for k, v in (e.split("=", 1) for e in args.ember)}
    results, logits = {}, {}
    for spec in args.gguf:
        label, path = spec.split("=", 1)
        d, name = os.path.split(os.path.abspath(path))
        t0 = time.time()
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
        load_s = time.time() - t0
        print(f"\n##### {label}: {path} ({os.path.getsize(path):,} bytes), loaded in {load_s:.1f} s; "
              f"eos {tok.eos_token!r} = {tok.eos_token_id}", flush=True)
        r = {"path": path, "bytes": os.path.getsize(path), "load_s": load_s, "answers": []}
        for i, p in enumerate(args.prompt):
            a = answer(model, tok, p, args.max_new_tokens)
            e = ember.get(label, [None] * len(args.prompt))[i]
            row = {"prompt": p, "transformers": a, "has_mark": MARK in a}
            print(f"- {p!r}\n    transformers: {a!r}")
            if e is not None:
                row["ember"] = e
                row["same_text"] = e.strip() == a.strip()
                print(f"    ember:        {e!r}  [{'same' if row['same_text'] else 'DIFFERENT'}]")
            sys.stdout.flush()
            r["answers"].append(row)
        if args.jsonl:
            c, logits[label] = completion_loss(model, tok, args.jsonl)
            r["completion"] = c
            print(f"  completion loss of {args.jsonl} (ember's scoring): {c['nll']:.6f} over {c['scored_tokens']} "
                  f"scored tokens; without the appended token {c['appended_token_id']}: "
                  f"{c['nll_without_appended']:.6f} (that token alone: {c['appended_token_nll']:.4f})")
        results[label] = r
        del model
    for pair in args.compare:
        a, b = pair.split(",")
        c = compare_logits(logits[a], logits[b])
        results[f"{a} vs {b}"] = c
        print(f"\nlogits of {a} against {b} on {c['positions']} positions of {args.jsonl}: max |diff| "
              f"{c['max_abs']:.4f}, mean |diff| {c['mean_abs']:.5f} (mean |logit| {c['logit_scale_mean_abs']:.2f}); "
              f"same most likely token at {c['top1_agree']}/{c['positions']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
