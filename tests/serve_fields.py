"""The official `openai` Python client against `ember serve`: every field the server honours
(tests/serve.rs runs this on SmolLM2-135M-Instruct and checks what it prints).

    python tests/serve_fields.py BASE_URL MODEL

Checks what can be checked here (stream framing, logprobs against each other, schemas with
jsonschema) with asserts, and prints one JSON object with the rest for the Rust test.
"""

import json
import pathlib
import sys
import threading
import urllib.request

import jsonschema
import openai

base_url, model = sys.argv[1:3]
root = base_url.rsplit("/v1", 1)[0]
client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300)
out = {}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def post(path, body):
    req = urllib.request.Request(root + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def chat_stream(**kw):
    """The chunks of a streamed chat answer, as dicts."""
    return [c.model_dump() for c in client.chat.completions.create(model=model, messages=CHAT, stream=True, **kw)]


# --- Stream framing: role alone first, content without role, an empty finish delta, usage last.
chunks = chat_stream(max_tokens=6, temperature=0, stream_options={"include_usage": True})
first, rest = chunks[0], chunks[1:]
assert first["choices"][0]["delta"]["role"] == "assistant", first
assert not first["choices"][0]["delta"].get("content"), first
middle = [c for c in rest if c["choices"] and c["choices"][0]["finish_reason"] is None]
assert middle and all(c["choices"][0]["delta"].get("role") is None for c in middle), middle
finish = [c for c in rest if c["choices"] and c["choices"][0]["finish_reason"]]
assert len(finish) == 1 and finish[0]["choices"][0]["delta"].get("content") in (None, ""), finish
assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6, chunks[-1]
assert all(c["usage"] is None for c in chunks[:-1]), chunks
whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0)
streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in middle)
assert streamed == whole.choices[0].message.content, (streamed, whole)
out["framing"] = {"chunks": len(chunks), "text": streamed}
chunks = [c.model_dump() for c in client.completions.create(
    model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True})]
assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4, chunks[-1]
no_usage = chat_stream(max_tokens=3, temperature=0)
assert all("usage" not in c or c["usage"] is None for c in no_usage), no_usage

# --- logprobs: chat (whole and streamed) and completions.
r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
content = r.choices[0].logprobs.content
# One entry a token of the answer; an end-of-text token is not part of it.
ended = r.choices[0].finish_reason == "stop"
assert len(content) == r.usage.completion_tokens - ended, (len(content), r.usage, r.choices[0].finish_reason)
for t in content:
    tops = [x.logprob for x in t.top_logprobs]
    assert len(tops) == 3 and tops == sorted(tops, reverse=True), t
    assert t.logprob <= 0 and abs(t.logprob - tops[0]) < 1e-6, t  # greedy: the chosen one is the most likely
    assert t.token == t.top_logprobs[0].token, t
out["chat_logprobs"] = [[t.token, t.logprob] for t in content]
streamed = []
for c in client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                        top_logprobs=3, stream=True):
    if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content:
        streamed += [[t.token, t.logprob] for t in c.choices[0].logprobs.content]
assert streamed == out["chat_logprobs"], (streamed, out["chat_logprobs"])
c = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
lp = c.choices[0].logprobs
assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and all(len(t) <= 2 for t in lp.top_logprobs), lp
assert "".join(lp.tokens) == c.choices[0].text, (lp.tokens, c.choices[0].text)
assert lp.text_offset == sorted(lp.text_offset), lp
out["completion_logprobs"] = lp.token_logprobs

# --- n, seeds: choices side by side (the prompt's cache blocks shared: its tokens reused), each
# reproducible whatever runs beside it.
def health():
    with urllib.request.urlopen(root + "/health") as r:
        return json.load(r)["kv_cache"]


before = health()
four = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour. " * 20}],
                                      n=4, max_tokens=12, temperature=1.0, seed=11)
after = health()
assert len(four.choices) == 4, four
texts4 = [c.message.content for c in four.choices]
assert len(set(texts4)) == 4, texts4  # four draws, four different completions
reused = after["reused_prompt_tokens"] - before["reused_prompt_tokens"]
assert reused >= 3 * (four.usage.prompt_tokens - 1), (reused, four.usage.prompt_tokens, before, after)
kw = dict(model=model, messages=CHAT, max_tokens=12, temperature=1.0, seed=7)
a = client.chat.completions.create(n=3, **kw)
assert [c.index for c in a.choices] == [0, 1, 2], a
texts = [c.message.content for c in a.choices]
results = {}


def again(i):
    results[i] = [c.message.content for c in client.chat.completions.create(n=3, **kw).choices]


threads = [threading.Thread(target=again, args=(i,)) for i in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
assert all(results[i] == texts for i in range(3)), (texts, results)
out["n_texts"] = texts
by_index = {}
for c in client.chat.completions.create(n=2, stream=True, **kw):
    for ch in c.choices:
        by_index[ch.index] = by_index.get(ch.index, "") + (ch.delta.content or "")
assert by_index == {0: texts[0], 1: texts[1]}, (by_index, texts)
out["usage_n"] = a.usage.completion_tokens
assert a.usage.prompt_tokens == client.chat.completions.create(
    model=model, messages=CHAT, max_tokens=1).usage.prompt_tokens, a.usage  # the prompt counted once
streamed_usage = [c for c in client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True},
                                                             **kw)][-1].usage
assert streamed_usage.completion_tokens == a.usage.completion_tokens, (streamed_usage, a.usage)
assert streamed_usage.prompt_tokens == a.usage.prompt_tokens, (streamed_usage, a.usage)

# --- logit_bias: a ban moves the greedy answer; a +100 bias forces a token.
ids = post("/tokenize", {"prompt": PROMPT})["tokens"]
plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
first = plain.choices[0].logprobs.tokens[0]
first_id = post("/tokenize", {"prompt": PROMPT + first})["tokens"][len(ids)]
banned = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                                   logit_bias={str(first_id): -100})
assert banned.choices[0].logprobs.tokens[0] != first, (first, banned)
x = post("/tokenize", {"prompt": "x"})["tokens"][-1]
forced = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=1, seed=1,
                                   logit_bias={str(x): 100})
assert forced.choices[0].text == post("/detokenize", {"tokens": [x, x, x]})["prompt"], forced
out["logit_bias"] = {"plain": plain.choices[0].text, "banned": banned.choices[0].text}

# --- penalties: fewer repeats of the most repeated token.
rep = "one two one two one two one two"
base = client.completions.create(model=model, prompt=rep, max_tokens=16, temperature=0)
freq = client.completions.create(model=model, prompt=rep, max_tokens=16, temperature=0, frequency_penalty=2.0)
pres = client.completions.create(model=model, prompt=rep, max_tokens=16, temperature=0, presence_penalty=2.0)


def most(text):
    words = text.split()
    return max((words.count(w) for w in set(words)), default=0)


assert most(freq.choices[0].text) < most(base.choices[0].text), (base.choices[0].text, freq.choices[0].text)
assert pres.choices[0].text != base.choices[0].text, (base.choices[0].text, pres.choices[0].text)
out["penalties"] = [base.choices[0].text, freq.choices[0].text, pres.choices[0].text]

# --- prompts as token ids, and several prompts with n: choice i*n+j is prompt i's.
by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0).choices[0].text
assert by_ids == by_text, (by_ids, by_text)
other = "The largest planet is"
two = client.completions.create(model=model, prompt=[PROMPT, other], n=2, max_tokens=4, temperature=0)
other_alone = client.completions.create(model=model, prompt=other, max_tokens=4, temperature=0).choices[0].text
assert [c.index for c in two.choices] == [0, 1, 2, 3], two
assert [c.text for c in two.choices] == [by_text, by_text, other_alone, other_alone], two
ids2 = post("/tokenize", {"prompt": other})["tokens"]
lists = client.completions.create(model=model, prompt=[ids, ids2], max_tokens=4, temperature=0)
assert [c.text for c in lists.choices] == [by_text, other_alone], lists
twice = client.completions.create(model=model, prompt=[PROMPT, PROMPT], max_tokens=4, temperature=0)
assert twice.usage.prompt_tokens == 2 * len(ids), twice.usage  # each prompt of the list counts
echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
assert echo.choices[0].text == PROMPT + by_text, echo
out["prompts"] = [by_text, other_alone]

# --- extension fields: top_k 1 is greedy whatever the temperature; min_p 1 too.
g = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
k1 = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.5, seed=3,
                               extra_body={"top_k": 1}).choices[0].text
m1 = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.5, seed=3,
                               extra_body={"min_p": 1.0}).choices[0].text
assert k1 == g and m1 == g, (g, k1, m1)


# --- response_format: every answer parses and validates against its schema (a slice of
# experiments/structured_output_server.py's 50 prompts x 3 schemas).
schemas = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "structured-output"
valid = {}
for path in sorted(schemas.glob("*.json")):
    schema = json.loads(path.read_text())
    fmt = {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"A {path.stem} as JSON."}],
                                       max_tokens=400, temperature=0.8, seed=5, n=2, response_format=fmt)
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"A {path.stem} as JSON."}], max_tokens=400,
        temperature=0.8, seed=5, response_format=fmt, stream=True) if ch.choices)
    assert streamed == r.choices[0].message.content, (streamed, r.choices[0].message.content)
    valid[path.stem] = len(r.choices)
assert len(valid) == 3, valid
obj = client.chat.completions.create(model=model, messages=CHAT, max_tokens=200, temperature=0,
                                     response_format={"type": "json_object"})
assert isinstance(json.loads(obj.choices[0].message.content), dict), obj
c = client.completions.create(model=model, prompt="Colours:", max_tokens=100, temperature=0,
                              extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                  "name": "c", "schema": {"type": "array", "items": {"enum": ["red", "green"]},
                                                          "minItems": 2, "maxItems": 2}}}})
assert json.loads(c.choices[0].text) in ([a, b] for a in ["red", "green"] for b in ["red", "green"]), c
out["json"] = valid

# --- tools: `required` and a named function are enforced by the grammar, so even a 135M model
# returns valid calls; streamed as deltas; a tool result goes back into the conversation.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def check_calls(message, names):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return [[c.function.name, json.loads(c.function.arguments)] for c in message.tool_calls]


r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                   max_tokens=120, temperature=0)
assert r.choices[0].finish_reason == "tool_calls", r
required = check_calls(r.choices[0].message, {"get_weather", "get_time"})
one = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                     parallel_tool_calls=False, max_tokens=120, temperature=0)
assert len(one.choices[0].message.tool_calls) == 1, one
named = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                                       temperature=0, tool_choice={"type": "function", "function": {"name": "get_time"}})
assert check_calls(named.choices[0].message, {"get_time"})[0][0] == "get_time", named
calls = {}
finish = None
for c in client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                        max_tokens=120, temperature=0, stream=True):
    for ch in c.choices:
        for d in ch.delta.tool_calls or []:
            # A call's first delta names it (id, type, function name); the rest carry arguments only.
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function" and d.function.name, d
            else:
                assert d.id is None and d.function.name is None, d
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = ch.finish_reason or finish
streamed = [[c["name"], json.loads(c["arguments"])] for _, c in sorted(calls.items())]
assert streamed == required and finish == "tool_calls", (streamed, required, finish)
first = r.choices[0].message.tool_calls[0]
turns = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
    {"role": "tool", "tool_call_id": first.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
]
after = client.chat.completions.create(model=model, messages=turns, tools=[WEATHER, TIME], tool_choice="none",
                                       max_tokens=30, temperature=0)
assert after.choices[0].finish_reason in ("stop", "length") and after.choices[0].message.content, after
assert not after.choices[0].message.tool_calls, after
auto = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0)
assert auto.choices[0].message.content or auto.choices[0].message.tool_calls, auto
single = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                                        temperature=0, parallel_tool_calls=False)
assert len(single.choices[0].message.tool_calls or []) <= 1, single
# tool_choice "required": a valid call for 20 prompts with each of two tools.
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Delhi", "Rome", "Accra"]
asks = [f"What is the weather in {c}?" for c in CITIES] + [f"What time is it in {c}?" for c in CITIES]


def required_call(args):
    prompt, tool = args
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], tools=[tool],
                                       tool_choice="required", max_tokens=80, temperature=0.7, seed=len(prompt))
    return check_calls(r.choices[0].message, {tool["function"]["name"]})


from concurrent.futures import ThreadPoolExecutor  # noqa: E402

with ThreadPoolExecutor(8) as pool:
    valid_calls = list(pool.map(required_call, [(p, t) for p in asks for t in (WEATHER, TIME)]))
assert len(valid_calls) == 40 and all(valid_calls), valid_calls
out["tools"] = {"required": required, "named": named.choices[0].message.tool_calls[0].function.name,
                "after": after.choices[0].message.content}

# --- every sampling field streamed gives what it gives whole (chat and completions).
def whole_and_streamed(kind, **kw):
    if kind == "chat":
        whole = client.chat.completions.create(model=model, messages=CHAT, **kw).choices[0].message.content
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=CHAT, stream=True, **kw) if c.choices]
    else:
        whole = client.completions.create(model=model, prompt=rep, **kw).choices[0].text
        parts = [c.choices[0].text for c in client.completions.create(model=model, prompt=rep, stream=True, **kw)
                 if c.choices]
    assert "".join(parts) == whole, (kind, kw, parts, whole)
    return whole


for kind in ("chat", "completion"):
    base_kw = dict(max_tokens=12, temperature=0.9, seed=21)
    plain_text = whole_and_streamed(kind, **base_kw)
    for extra in (dict(logit_bias={str(first_id): -100}), dict(frequency_penalty=1.5), dict(presence_penalty=1.5),
                  dict(extra_body={"repetition_penalty": 1.8}), dict(extra_body={"top_k": 5, "min_p": 0.1})):
        whole_and_streamed(kind, **base_kw, **extra)
rp = client.completions.create(model=model, prompt=rep, max_tokens=16, temperature=0,
                               extra_body={"repetition_penalty": 1.8}).choices[0].text
assert rp != base.choices[0].text, (rp, base.choices[0].text)
lp_parts = []
for c in client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, stream=True):
    if c.choices and c.choices[0].logprobs:
        lp_parts += c.choices[0].logprobs.token_logprobs
assert lp_parts == out["completion_logprobs"], (lp_parts, out["completion_logprobs"])

# --- errors: OpenAI's type, code and param.
def error(**kw):
    try:
        client.chat.completions.create(model=model, messages=CHAT, **kw)
    except openai.BadRequestError as e:
        return e.body
    raise AssertionError(f"no error for {kw}")


long = [{"role": "user", "content": "word " * 9000}]
try:
    client.chat.completions.create(model=model, messages=long, max_tokens=4)
    raise AssertionError("a prompt past the context was answered")
except openai.BadRequestError as e:
    assert e.body["code"] == "context_length_exceeded" and e.body["param"] == "messages", e.body
    assert e.body["type"] == "invalid_request_error", e.body
e = error(max_tokens=4, extra_body={"best_of": 2})
assert e["param"] == "best_of" and "Unrecognized request argument" in e["message"], e
e = error(max_tokens=4, n=9)
assert e["param"] == "n", e
e = error(max_tokens=4, logprobs=True, top_logprobs=30)
assert e["param"] == "top_logprobs", e
e = error(max_tokens=4, response_format={"type": "xml"})
assert e["param"] == "response_format.type", e
e = error(max_tokens=4, response_format={"type": "json_schema", "json_schema": {
    "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}, "strict": True}})
assert e["param"] == "response_format.json_schema.schema" and "strnig" in e["message"], e
e = error(max_tokens=4, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
assert e["param"] == "tool_choice", e
e = error(max_tokens=4, tools=[{"type": "function", "function": {"name": "a b"}}])
assert e["param"].startswith("tools"), e
e = error(max_tokens=4, extra_body={"messages": [{"role": "user", "content": "hi", "metadata": {}}]})
assert e["param"] == "messages[0].metadata", e
strict = {"type": "function", "function": dict(WEATHER["function"], strict=True)}
e = error(max_tokens=4, tools=[strict])
assert e["param"] == "tools[0].function.strict", e
ok = client.chat.completions.create(model=model, messages=ASK, tools=[strict], tool_choice="required", max_tokens=80,
                                    temperature=0)
check_calls(ok.choices[0].message, {"get_weather"})
e = error(max_tokens=4, tools=[dict(WEATHER, cache_control={})])
assert e["param"] == "tools[0].cache_control", e
e = error(max_tokens=4, parallel_tool_calls=False)
assert e["param"] == "parallel_tool_calls", e
e = error(max_tokens=4, response_format={"type": "json_object"}, extra_body={"ignore_eos": True})
assert e["param"] == "ignore_eos", e
try:
    client.completions.create(model=model, prompt=[PROMPT] * 16, n=8, max_tokens=2)
    raise AssertionError("128 choices were taken")
except openai.BadRequestError as e:
    assert e.body["param"] == "n", e.body
models = client.models.list().model_dump()["data"][0]
assert "logit_bias" in models["honoured_fields"]["/v1/chat/completions"], models
out["errors"] = "ok"

print(json.dumps(out))
