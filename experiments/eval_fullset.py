"""Full-set accuracies: lm-evaluation-harness (transformers, float32, batch 16) beside
`ember eval --tasks` on whole sets, SmolLM2-135M-Instruct; writes experiments/eval/fullset_<model>.json
and prints a table. Tasks as in tests/fixtures/eval/make_reference.py (the harness's own YAMLs over
the local files).

    python experiments/eval_fullset.py --ember target/release/ember --evals ../shared/evals \
        --gguf ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
        --tasks arc_challenge,openbookqa,winogrande,piqa,commonsense_qa
"""

import json
import os
import subprocess
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../tests/fixtures/eval"))
import make_reference as mr  # noqa: E402


def main():
    ap = mr.setup_args()
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--name", default="smollm2")
    a = ap.parse_args()
    import lm_eval
    from lm_eval.tasks import TaskManager
    import tempfile
    work = tempfile.mkdtemp(prefix="ember-full-")
    hf, yamls = mr.harness_setup(a.ember, a.evals, a.gguf, work)
    manager = TaskManager(include_path=yamls)
    out = {}
    for task in a.tasks.split(","):
        t = time.time()
        res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32", device="cpu",
                                      tasks=[f"ember_{task}"], batch_size=16, task_manager=manager)
        harness_s = time.time() - t
        harness = {k.split(",")[0]: v for k, v in res["results"][f"ember_{task}"].items() if "," in k}
        t = time.time()
        got = subprocess.run([a.ember, "eval", "--checkpoint", f"gguf:{a.gguf}", "--tasks", task, "--eval-dir", a.evals,
                              "--json"], check=True, capture_output=True, text=True)
        ember_s = time.time() - t
        ember = json.loads(got.stdout)["results"][task]
        out[task] = {"harness": harness, "ember": ember, "harness_s": harness_s, "ember_s": ember_s,
                     "items": json.loads(got.stdout)["n-samples"][task]["effective"]}
        print(task, out[task], file=sys.stderr)
        with open(os.path.join(HERE, f"eval/fullset_{a.name}.json"), "w") as f:
            json.dump(out, f, indent=1)
    print("| task | items | metric | harness | ember | difference (points) | harness s | ember s |")
    print("|---|---|---|---|---|---|---|---|")
    for task, r in out.items():
        for m in ("acc", "acc_norm"):
            if m in r["harness"]:
                h, e = r["harness"][m], r["ember"][m]
                print(f"| {task} | {r['items']} | {m} | {100*h:.2f} | {100*e:.2f} | {100*(e-h):+.2f} | {r['harness_s']:.0f} | {r['ember_s']:.0f} |")


if __name__ == "__main__":
    main()
