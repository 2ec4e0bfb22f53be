"""HellaSwag items/s: lm-evaluation-harness (transformers, float32) beside `ember eval --tasks`, on
the same CPU and threads, alternating. The harness reads the local file through its own
hellaswag.yaml (tests/fixtures/eval/make_reference.py sets it up).

    python experiments/eval_speed.py --ember target/release/ember --evals ../shared/evals \
        --gguf ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf --items 200 --rounds 2
"""

import json
import os
import subprocess
import sys
import tempfile
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../tests/fixtures/eval"))
import make_reference as mr  # noqa: E402


def main():
    ap = mr.setup_args()
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,16")
    a = ap.parse_args()
    import lm_eval
    from lm_eval.tasks import TaskManager
    hf, yamls = mr.harness_setup(a.ember, a.evals, a.gguf, tempfile.mkdtemp(prefix="ember-speed-"))
    manager = TaskManager(include_path=yamls)
    rows = []
    for r in range(a.rounds):
        t = time.time()
        out = subprocess.run([a.ember, "eval", "--checkpoint", f"gguf:{a.gguf}", "--tasks", f"hellaswag:{a.items}",
                              "--eval-dir", a.evals, "--json"], check=True, capture_output=True, text=True)
        secs = time.time() - t
        acc = json.loads(out.stdout)["results"]["hellaswag"]["acc_norm"]
        rows.append(("ember", r, secs, a.items / secs, acc))
        print(rows[-1], file=sys.stderr)
        for bs in a.batch_sizes.split(","):
            t = time.time()
            res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32", device="cpu",
                                          tasks=["ember_hellaswag"], limit=a.items, batch_size=int(bs), task_manager=manager)
            secs = time.time() - t
            rows.append((f"harness batch {bs}", r, secs, a.items / secs, res["results"]["ember_hellaswag"]["acc_norm,none"]))
            print(rows[-1], file=sys.stderr)
    print("| what | round | seconds | items/s | acc_norm |")
    print("|---|---|---|---|---|")
    for name, r, secs, rate, acc in rows:
        print(f"| {name} | {r} | {secs:.1f} | {rate:.2f} | {acc:.4f} |")


if __name__ == "__main__":
    main()
