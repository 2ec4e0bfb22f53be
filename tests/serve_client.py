"""The official `openai` Python client against `ember serve` (tests/serve.rs runs this).

    python tests/serve_client.py BASE_URL API_KEY MODEL

Prints one JSON object with what each call returned; the Rust test checks it.
"""

import json
import sys

import openai

base_url, api_key, model = sys.argv[1:4]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
out = {"models": [m.id for m in client.models.list().data]}

prompt = "The capital of France is"
c = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
out["completion"] = {"text": c.choices[0].text, "finish": c.choices[0].finish_reason, "usage": c.usage.model_dump()}
pieces = []
finish = None
for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True):
    pieces.append(chunk.choices[0].text)
    finish = chunk.choices[0].finish_reason or finish
out["completion_stream"] = {"text": "".join(pieces), "finish": finish, "chunks": len(pieces)}

messages = [{"role": "user", "content": "What is the capital of France?"}]
r = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
out["chat"] = {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason, "usage": r.usage.model_dump()}
pieces = []
finish = None
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
    if chunk.choices and chunk.choices[0].finish_reason:
        finish = chunk.choices[0].finish_reason
out["chat_stream"] = {"text": "".join(pieces), "finish": finish}

stopped = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stop=["."])
out["stop"] = {"text": stopped.choices[0].text, "finish": stopped.choices[0].finish_reason}

try:
    client.completions.create(model="no-such-model", prompt=prompt, max_tokens=2)
    out["unknown_model"] = None
except openai.NotFoundError as e:
    out["unknown_model"] = e.status_code

wrong = openai.OpenAI(base_url=base_url, api_key="wrong-key", max_retries=0)
try:
    wrong.models.list()
    out["wrong_key"] = None
except openai.AuthenticationError as e:
    out["wrong_key"] = e.status_code

print(json.dumps(out))
