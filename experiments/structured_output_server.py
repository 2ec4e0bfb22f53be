"""Structured output through `ember serve` with the official `openai` client: PROMPTS prompts for
each schema of experiments/structured-output/ (`response_format: json_schema`, strict), 8 requests
at a time; every answer is parsed and validated with `jsonschema`. Prints one line per schema and
a JSON summary.

    ember serve --checkpoint gguf:SmolLM2-135M-Instruct.Q4_1.gguf --port 8000 --model-name smol &
    python experiments/structured_output_server.py http://127.0.0.1:8000/v1 smol [PROMPTS]
"""

import json
import pathlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

base_url, model = sys.argv[1:3]
count = int(sys.argv[3]) if len(sys.argv) > 3 else 50
client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
here = pathlib.Path(__file__).parent / "structured-output"
NAMES = ["Ada", "Bruno", "Chen", "Dalia", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia"]
PLACES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo"]
ASK = {
    "person": "Give the profile of {name}, who lives in {place}, as JSON.",
    "order": "{name} in {place} orders some things online. Write the order as JSON.",
    "event": "Describe an event that {name} organises in {place}, as JSON.",
}


def one(name, schema, i):
    prompt = ASK[name].format(name=NAMES[i % len(NAMES)], place=PLACES[(i // len(NAMES)) % len(PLACES)])
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=400,
        temperature=0.7,
        seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    )
    text = r.choices[0].message.content
    try:
        jsonschema.validate(json.loads(text), schema)
        return True, r.usage.completion_tokens, text
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return False, r.usage.completion_tokens, f"{text!r}: {e}"


summary = {}
for path in sorted(here.glob("*.json")):
    schema = json.loads(path.read_text())
    start = time.time()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: one(path.stem, schema, i), range(count)))
    valid = sum(ok for ok, _, _ in results)
    tokens = sum(n for _, n, _ in results)
    seconds = time.time() - start
    summary[path.stem] = {"valid": valid, "of": count, "tokens": tokens, "seconds": round(seconds, 1)}
    print(f"{path.stem}: {valid}/{count} valid, {tokens} tokens in {seconds:.1f} s; e.g. {results[0][2][:160]}")
    for ok, _, text in results:
        if not ok:
            print("  INVALID", text[:300])
print(json.dumps(summary))
