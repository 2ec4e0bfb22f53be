#!/usr/bin/env python3
"""TRL 1.16's GRPOTrainer on the GRPO template's task (configs/grpo.toml): SmolLM2-135M-Instruct
from the same GGUF file (dequantized to f32 by transformers), LoRA rank 16 on the seven
projections, 2 prompts x 8 answers a step, at most 40 new tokens at temperature 0.7, the same two
rewards. Prints one JSON line: the steps' times (the first left out as warm-up), answers and
answer tokens per second, and the process's peak RSS.

    target/py/bin/python experiments/grpo/trl_speed.py --steps 6 --threads 2
"""

import argparse
import json
import os
import re
import resource
import sys
import tempfile
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def final_number(text):
    scope = text.rsplit("####", 1)[1] if "####" in text else text
    found = re.findall(r"-?[$0-9.,]*[0-9]", scope)
    if not found:
        return None
    n = (found[0] if "####" in text else found[-1]).replace(",", "").replace("$", "").rstrip(".")
    return n


def gsm8k(completions, answer, **kw):
    out = []
    for c, a in zip(completions, answer):
        text = c[0]["content"]
        n = final_number(text)
        try:
            out.append(float(n is not None and abs(float(n) - float(a)) < 1e-9))
        except ValueError:
            out.append(0.0)
    return out


def format_reward(completions, **kw):
    return [float(re.search(r"#### ?-?[0-9]+", c[0]["content"]) is not None) for c in completions]


class Clock(TrainerCallback):
    def __init__(self):
        self.times, self.last = [], None

    def on_step_begin(self, args, state, control, **kw):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.last)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gguf", default=os.environ.get("EMBER_TEST_ASSETS", os.path.join(ROOT, "..", "shared"))
                   + "/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    # The GGUF dequantized once into a plain f32 folder (a model loaded with `gguf_file` is marked
    # quantized, which the Trainer refuses to train).
    hf = os.path.join(ROOT, "target", "smollm2-135m-instruct-hf")
    if not os.path.isdir(hf):
        folder, name = os.path.split(os.path.abspath(a.gguf))
        m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        m.config.quantization_config = None
        m.hf_quantizer = None
        m.is_quantized = False
        m.save_pretrained(hf)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(hf)
    rows = [json.loads(l) for l in open(os.path.join(ROOT, "examples", "arithmetic.jsonl"))]
    lengths = []

    def lengths_reward(completion_ids, **kw):
        lengths.extend(len(c) for c in completion_ids)
        return [0.0] * len(completion_ids)

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=16, num_generations=8, max_completion_length=40,
                          temperature=0.7, learning_rate=1e-4, max_steps=a.steps, logging_steps=1, report_to=[],
                          use_cpu=True, bf16=False, save_strategy="no", seed=1, dataloader_num_workers=0,
                          reward_weights=[1.0, 0.5, 0.0])
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        clock = Clock()
        t = GRPOTrainer(model=model, reward_funcs=[gsm8k, format_reward, lengths_reward], args=args,
                        train_dataset=Dataset.from_list(rows), processing_class=tok, peft_config=lora, callbacks=[clock])
        t.train()
    steps = clock.times[1:]
    answers = 16 * len(steps)
    tokens = sum(lengths[16:16 * (1 + len(steps))])
    print(json.dumps({"tool": "trl", "trl": __import__("trl").__version__, "torch": torch.__version__, "threads": a.threads,
                      "steps": len(steps), "step_s": steps, "mean_step_s": sum(steps) / len(steps),
                      "answers_per_s": answers / sum(steps), "answer_tokens_per_s": tokens / sum(steps),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    sys.exit(main())
