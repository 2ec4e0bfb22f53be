"""Full sets in pieces: lm-evaluation-harness's per-item results gathered range by range of items
(its `samples` argument), kept in experiments/eval/items/<name>/<task>.jsonl.gz, and set beside
`ember eval`'s own per-item results (`--samples`) once gathered. A task whose harness run takes hours
on this machine (HellaSwag, MMLU, BLiMP; Gemma 3's 262k-row head makes every position costly) is
done over several sessions, or at once where a faster machine is at hand (`--device cuda`).

    # the harness on items 0..2500 of HellaSwag (appended; items already there are skipped)
    python experiments/eval_items.py harness --ember target/release/ember --evals ../shared/evals \
        --gguf ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
        --name smollm2 --task hellaswag --docs 0:2500
    # what is gathered
    python experiments/eval_items.py status --name smollm2 --task hellaswag
    # ember on the whole task, item by item beside the harness's (accuracy over the items both have;
    # over the full set once the harness has them all)
    python experiments/eval_items.py compare --ember target/release/ember --evals ../shared/evals \
        --gguf ... --name smollm2 --task hellaswag

Tasks: hellaswag, boolq, lambada_openai, arc_easy, arc_challenge, piqa, openbookqa, commonsense_qa,
winogrande (one harness task each, as tests/fixtures/eval/make_reference.py defines them), mmlu
(the harness's 57 subject tasks over the local file, each with its own description) and blimp (its
67 paradigms). Item numbers are ember's: MMLU's in the file's order, BLiMP's paradigm after paradigm
in ember's order (1,000 each).
"""

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../tests/fixtures/eval"))
import make_reference as mr  # noqa: E402

ITEMS = os.path.join(HERE, "eval", "items")

def blimp_paradigms(evals):
    """The 67 paradigms in ember's order: its list (crates/eval/src/tasks/blimp.rs) is alphabetical,
    as the files are."""
    return sorted(f[:-len(".jsonl.gz")] for f in os.listdir(os.path.join(evals, "blimp")) if f.endswith(".jsonl.gz"))


def mmlu_subjects(evals):
    """Each MMLU test item's subject, in the file's order."""
    with open(os.path.join(evals, "mmlu", "mmlu_test.jsonl")) as f:
        return [json.loads(line)["subject"] for line in f if line.strip()]


def parts(task, evals):
    """The harness tasks an ember task is made of: [(harness task, [ember item of each of its docs])]."""
    if task == "blimp":
        return [(f"ember_blimp_{p}", list(range(i * 1000, (i + 1) * 1000))) for i, p in enumerate(blimp_paradigms(evals))]
    if task == "mmlu":
        by = {}
        for i, s in enumerate(mmlu_subjects(evals)):
            by.setdefault(s, []).append(i)
        return [(f"ember_mmlu_{s}", ids) for s, ids in by.items()]
    return [(f"ember_{task}", None)]


def extra_yamls(task, evals, work, yamls):
    """Task YAMLs beyond make_reference's: one per BLiMP paradigm, one per MMLU subject (the
    harness's own subject YAML over the local file, its items filtered to the subject)."""
    harness = mr.HARNESS
    if task == "blimp":
        for p in blimp_paradigms(evals):
            plain = os.path.join(work, f"blimp_{p}.jsonl")
            subprocess.run(f"gzip -dc {os.path.join(evals, 'blimp', p + '.jsonl.gz')} > {plain}", shell=True, check=True)
            lines = [f"task: ember_blimp_{p}", f"include: {os.path.join(harness, 'blimp', p + '.yaml')}",
                     "dataset_path: json", "dataset_name: null", "dataset_kwargs:", "  data_files:",
                     f"    train: {plain}"]
            with open(os.path.join(yamls, f"ember_blimp_{p}.yaml"), "w") as f:
                f.write("\n".join(lines) + "\n")
    if task == "mmlu":
        subjects = sorted(set(mmlu_subjects(evals)))
        with open(os.path.join(yamls, "ember_mmlu_utils.py"), "w") as f:
            f.write("def _only(subject):\n    return lambda docs: docs.filter(lambda d: d['subject'] == subject)\n\n")
            for s in subjects:
                f.write(f"{s} = _only({s!r})\n")
        for s in subjects:
            lines = [f"task: ember_mmlu_{s}", f"include: {os.path.join(harness, 'mmlu', 'default', f'mmlu_{s}.yaml')}",
                     "dataset_path: json", "dataset_name: null", "dataset_kwargs:", "  data_files:",
                     f"    test: {os.path.join(evals, 'mmlu', 'mmlu_test.jsonl')}",
                     f"    dev: {os.path.join(evals, 'mmlu', 'mmlu_dev.jsonl')}",
                     f"process_docs: !function ember_mmlu_utils.{s}", "tag: []"]
            with open(os.path.join(yamls, f"ember_mmlu_{s}.yaml"), "w") as f:
                f.write("\n".join(lines) + "\n")


def items_path(name, task):
    return os.path.join(ITEMS, name, f"{task}.jsonl.gz")


def gathered(name, task):
    """The harness's items gathered so far, by ember item number."""
    path = items_path(name, task)
    out = {}
    if os.path.exists(path):
        with gzip.open(path, "rt") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    out[r["item"]] = r
    return out


def parse_docs(spec):
    a, b = spec.split(":")
    return int(a), int(b)


def harness(a):
    import lm_eval
    from lm_eval.tasks import TaskManager
    lo, hi = parse_docs(a.docs)
    have = gathered(a.name, a.task)
    work = tempfile.mkdtemp(prefix="ember-items-")
    hf, yamls = mr.harness_setup(a.ember, a.evals, a.gguf, work)
    extra_yamls(a.task, a.evals, work, yamls)
    samples, back = {}, {}
    for name, ids in parts(a.task, a.evals):
        ids = ids if ids is not None else list(range(min(hi, total_items(a.task, a.evals))))
        for local, item in enumerate(ids):
            if lo <= item < hi and item not in have:
                samples.setdefault(name, []).append(local)
                back[(name, local)] = item
    if not samples:
        print(f"{a.task}: items {lo}..{hi} already gathered", file=sys.stderr)
        return
    manager = TaskManager(include_path=yamls)
    t = time.time()
    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32", device=a.device,
                                  tasks=sorted(samples), batch_size=a.batch, task_manager=manager, samples=samples,
                                  log_samples=True)
    seconds = time.time() - t
    os.makedirs(os.path.dirname(items_path(a.name, a.task)), exist_ok=True)
    n = 0
    with gzip.open(items_path(a.name, a.task), "at") as f:
        for name in samples:
            for s in res["samples"][name]:
                item = back.get((name, s["doc_id"]))
                if item is None:
                    continue
                lls = [round(float(r[0]), 6) for r in s["filtered_resps"]]
                greedy = [bool(r[1]) for r in s["filtered_resps"]]
                rec = {"item": item, "lls": lls, "greedy": greedy}
                for m in ("acc", "acc_norm"):
                    if m in s:
                        rec[m] = int(s[m])
                f.write(json.dumps(rec) + "\n")
                n += 1
    print(f"{a.task}: {n} items of {lo}..{hi} gathered in {seconds:.0f} s ({a.device}, batch {a.batch})", file=sys.stderr)


def total_items(task, evals):
    """Items of the task's evaluated split (the local file's lines)."""
    if task in ("blimp", "mmlu"):
        return sum(len(ids) for _, ids in parts(task, evals))
    files = mr.TASKS[task][1]
    split = next(s for s in ("test", "validation", "train") if s in files)
    with open(os.path.join(evals, files[split])) as f:
        return sum(1 for line in f if line.strip())


def status(a):
    have = gathered(a.name, a.task)
    total = total_items(a.task, a.evals) if a.evals else None
    runs, prev = [], None
    for i in sorted(have):
        if prev is None or i != prev + 1:
            runs.append([i, i])
        runs[-1][1] = i
        prev = i
    spans = ", ".join(f"{x}..{y + 1}" for x, y in runs)
    print(f"{a.name} {a.task}: {len(have)} items{f' of {total}' if total else ''} ({spans or 'none'})")


def ember_items(a, task):
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as tmp:
        path = tmp.name
    t = time.time()
    out = subprocess.run([a.ember, "eval", "--checkpoint", f"gguf:{a.gguf}", "--tasks", task, "--eval-dir", a.evals,
                          "--json", "--samples", path], check=True, capture_output=True, text=True)
    seconds = time.time() - t
    rows = [json.loads(line) for line in open(path) if line.strip()]
    os.unlink(path)
    return rows, json.loads(out.stdout), seconds


def compare(a):
    """ember over the items up to the last the harness has (the whole task once it has them all),
    beside the harness's items."""
    have = gathered(a.name, a.task)
    if not have:
        sys.exit(f"{a.name} {a.task}: no harness items gathered yet")
    total = total_items(a.task, a.evals)
    if a.task == "blimp":
        # One call for every paradigm the harness has items of, each up to its last such item.
        limits, first = [], {}
        for i, p in enumerate(blimp_paradigms(a.evals)):
            mine = [x - i * 1000 for x in have if i * 1000 <= x < (i + 1) * 1000]
            if mine:
                limits.append(f"blimp_{p}:{max(mine) + 1}")
                first[f"blimp_{p}"] = i * 1000
        rows, res, seconds = ember_items(a, ",".join(limits))
        for row in rows:
            row["doc_id"] += first[row["task"]]
    else:
        rows, res, seconds = ember_items(a, f"{a.task}:{max(have) + 1}")
    results = res["results"]
    ember = {r["doc_id"]: r for r in rows}
    common = sorted(set(have) & set(ember))
    metrics = [m for m in ("acc", "acc_norm") if any(m in have[i] for i in common)]
    out = {"task": a.task, "items": total, "harness_items": len(have), "compared": len(common),
           "ember_s": round(seconds, 1), "full_set": len(common) == total}
    worst = 0.0
    for i in common:
        h, e = have[i]["lls"], ember[i]["loglikelihoods"]
        if len(h) == len(e):
            for x, y in zip(h, e):
                worst = max(worst, abs(x - y) / max(abs(x), 1e-9))
    out["max_relative_ll_difference"] = worst
    for m in metrics:
        key = "prediction_norm" if m == "acc_norm" else "prediction"
        if a.task == "lambada_openai":
            greedy = [ember[i]["greedy"] for i in common]
            mine = [int(all(g) if isinstance(g, list) else bool(g)) for g in greedy]
        else:
            mine = [int(ember[i][key] == ember[i]["gold"]) for i in common]
        theirs = [have[i][m] for i in common]
        out[m] = {"harness": sum(theirs) / len(common), "ember": sum(mine) / len(common),
                  "items_disagreeing": sum(x != y for x, y in zip(mine, theirs))}
    if out["full_set"]:
        out["ember_results"] = results if a.task != "blimp" else {"blimp": {"acc": sum(int(r["prediction"] == r["gold"]) for r in rows) / len(rows)}}
    print(json.dumps(out, indent=1))
    with open(os.path.join(ITEMS, a.name, f"{a.task}.compare.json"), "w") as f:
        json.dump(out, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("harness", "status", "compare"):
        p = sub.add_parser(cmd)
        p.add_argument("--name", required=True, help="the model's name in experiments/eval/items/")
        p.add_argument("--task", required=True)
        p.add_argument("--evals", required=cmd != "status")
        if cmd != "status":
            p.add_argument("--ember", required=True)
            p.add_argument("--gguf", required=True)
    h = sub.choices["harness"]
    h.add_argument("--docs", required=True, help="ember item numbers START:END")
    h.add_argument("--device", default="cpu")
    h.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    {"harness": harness, "status": status, "compare": compare}[a.cmd](a)


if __name__ == "__main__":
    main()
