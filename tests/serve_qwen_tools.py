"""Qwen2.5's tool calling through `ember serve`, against transformers and Qwen's own parser
(tests/serve.rs runs it; issue 55).

    python tests/serve_qwen_tools.py make DIR TOKENIZER_JSON     # the model folder
    python tests/serve_qwen_tools.py check BASE_URL MODEL DIR    # the checks, on `ember serve hf:DIR`

`make` writes a random-weight Qwen2 (Qwen2ForCausalLM's config and tensor names, seeded numpy
weights, 2 layers of width 32) with Qwen's real vocabulary: tokenizer.json is Qwen3's (the same BPE and ids as Qwen2.5, whose
added tokens end at <|file_sep|> 151664: Qwen3's four later ones, <tool_response> to </think>, are
dropped, so that the template's `<tool_response>` is text as in Qwen2.5), and tokenizer_config.json
holds tests/fixtures/templates/qwen2.5.jinja as its chat template.

`check` asserts, printing one JSON object with what it compared:
- the prompt ember renders for a conversation with two tools, an assistant turn of tool calls and a
  tool result is transformers' `apply_chat_template(messages, tools=tools, add_generation_prompt=True)`
  byte for byte: transformers' text tokenized by ember (`/tokenize`) is transformers' ids, as many
  as ember's `usage.prompt_tokens`, and that text sent as a completion prompt gives, greedy, the same
  tokens with the same log-probabilities (top 5 included) as the chat request: on random weights
  any other prompt gives other numbers;
- the `tool_calls` ember returns (whole and streamed) for `tool_choice` `required`, a named
  function and `auto` are what Qwen's parser (the regex `<tool_call>\\s*(.*?)\\s*</tool_call>` over
  the raw answer, then `json.loads`, as Qwen's docs and vLLM's hermes parser do) reads from the
  answer's raw text, rebuilt from the tokens' bytes that `logprobs` returns.
"""

import json
import pathlib
import re
import sys
import urllib.request

HERE = pathlib.Path(__file__).parent
TEMPLATE = HERE / "fixtures/templates/qwen2.5.jinja"
LAST_QWEN25_TOKEN = 151664  # <|file_sep|>


def make(out, tokenizer_json):
    import numpy as np

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab, width, inner, layers, heads, kv_heads = 151936, 32, 64, 2, 4, 2
    head_dim = width // heads
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab, "hidden_size": width,
        "intermediate_size": inner, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "hidden_act": "silu", "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": layers, "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "float32", "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # Seeded weights wider than transformers' init (std 0.02 leaves every logit near 0): a model with
    # preferences, so that a prompt that differs by one token changes the numbers compared. Written
    # as safetensors by hand (an 8-byte header length, the JSON header, the raw little-endian data),
    # so that making the fixture needs numpy alone.
    rng = np.random.default_rng(55)
    tensors = {"model.embed_tokens.weight": rng.normal(0.0, 0.5, (vocab, width))}
    for i in range(layers):
        at = f"model.layers.{i}."
        for name, rows in [("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)]:
            tensors[at + f"self_attn.{name}_proj.weight"] = rng.normal(0.0, 0.5, (rows, width))
            tensors[at + f"self_attn.{name}_proj.bias"] = rng.normal(0.0, 0.1, rows)
        tensors[at + "self_attn.o_proj.weight"] = rng.normal(0.0, 0.5, (width, heads * head_dim))
        tensors[at + "mlp.gate_proj.weight"] = rng.normal(0.0, 0.5, (inner, width))
        tensors[at + "mlp.up_proj.weight"] = rng.normal(0.0, 0.5, (inner, width))
        tensors[at + "mlp.down_proj.weight"] = rng.normal(0.0, 0.5, (width, inner))
        tensors[at + "input_layernorm.weight"] = 1.0 + rng.normal(0.0, 0.1, width)
        tensors[at + "post_attention_layernorm.weight"] = 1.0 + rng.normal(0.0, 0.1, width)
    tensors["model.norm.weight"] = 1.0 + rng.normal(0.0, 0.1, width)
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        data = np.ascontiguousarray(t, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for data in blobs:
            f.write(data)
    tok = json.loads(pathlib.Path(tokenizer_json).read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] <= LAST_QWEN25_TOKEN]
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    config = {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 2048, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
        "chat_template": TEMPLATE.read_text(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))


# Two tools as an OpenAI client writes them (keys in its order, not sorted), with text that JSON
# escapers treat differently (`<`, `>`, `&`, `'`, non-ASCII); the argument schemas close their
# objects and bound their strings, so that a random model's call ends in a few hundred tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city & its <region>, e.g. l'Isère",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Saint-Étienne", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ARGS = {"city": "Saint-Étienne", "unit": "celsius"}
# The conversation: a call, its result, and the next turn to answer.
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Saint-Étienne & <Lyon>, and 2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": "{\"temp\": 21, \"sky\": \"<clear>\"}"},
]
QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def over_the_wire(messages):
    """`messages` as OpenAI's API sends them: a call's arguments a string of JSON (transformers'
    templates take the object)."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"], ensure_ascii=False)
    return out


def qwen_parse(text):
    """Qwen's parser: each `<tool_call>` block's JSON, `[name, arguments]`; the content is the text
    before the first block (as vLLM's hermes parser returns it), or all of it when none parses."""
    calls = []
    for block in QWEN_CALL.findall(text):
        call = json.loads(block)
        calls.append([call["name"], call["arguments"]])
    content = text[: text.index("<tool_call>")] if calls else text
    return {"content": content or None, "calls": calls}


def raw_text(logprobs, special):
    """The answer's text from its tokens' bytes, as transformers decodes it for a parser (vLLM's
    `skip_special_tokens`): without the `special` tokens (`<|box_start|>`...), with `<tool_call>`
    (an added token that is not special), bytes that are no UTF-8 replaced as transformers does
    (U+FFFD for each maximal invalid piece)."""
    return b"".join(bytes(t["bytes"]) for t in logprobs if t["token"] not in special).decode("utf-8", "replace")


def ember_whole(message):
    calls = [[c["function"]["name"], json.loads(c["function"]["arguments"])] for c in message.get("tool_calls") or []]
    return {"content": message.get("content") or None, "calls": calls}


def ember_streamed(client, model, special, **kw):
    """The streamed answer put together: content, calls (by index), raw text and finish reason."""
    content, calls, tokens, finish = "", {}, [], None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0].model_dump()
        delta = ch["delta"]
        content += delta.get("content") or ""
        for d in delta.get("tool_calls") or []:
            call = calls.setdefault(d["index"], {"name": "", "arguments": "", "ids": set()})
            f = d.get("function") or {}
            call["name"] += f.get("name") or ""
            call["arguments"] += f.get("arguments") or ""
            if d.get("id"):
                call["ids"].add(d["id"])
        tokens += (ch.get("logprobs") or {}).get("content") or []
        finish = ch["finish_reason"] or finish
    assert all(len(c["ids"]) == 1 for c in calls.values()), calls
    got = [[calls[i]["name"], json.loads(calls[i]["arguments"])] for i in sorted(calls)]
    return {"content": content or None, "calls": got}, raw_text(tokens, special), finish


def short(*what):
    """`what` for an assertion's message, each part cut to 2000 characters."""
    return " | ".join(json.dumps(w, ensure_ascii=False)[:2000] for w in what)


def same(a, b):
    """Equal, keys in the same order."""
    return json.dumps(a, ensure_ascii=False) == json.dumps(b, ensure_ascii=False)


def check(base_url, model, folder):
    import openai
    from transformers import AutoTokenizer

    root = base_url.rsplit("/v1", 1)[0]

    def post(path, body):
        req = urllib.request.Request(root + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            return json.load(r)

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    out = {}

    # --- The prompt: transformers' rendering, its ids, and ember's.
    tok = AutoTokenizer.from_pretrained(folder)
    added = json.loads((pathlib.Path(folder) / "tokenizer.json").read_text())["added_tokens"]
    special = {t["content"] for t in added if t["special"]}
    assert "<tool_call>" not in special and "<|im_end|>" in special
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    ids = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = list(ids["input_ids"])
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"), text
    assert "Saint-Étienne" in text and "& its <region>" in text and "l'Isère" in text, text
    # The markers are one token each: twice in the tools section, once in the past call.
    assert ids.count(151657) == 3 and ids.count(151658) == 3, ids
    assert post("/tokenize", {"prompt": text})["tokens"] == ids
    wire = over_the_wire(MESSAGES)
    chat = client.chat.completions.create(model=model, messages=wire, tools=TOOLS, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=5).model_dump()
    assert chat["usage"]["prompt_tokens"] == len(ids), (chat["usage"], len(ids))
    plain = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0, logprobs=5).model_dump()
    lp = plain["choices"][0]["logprobs"]
    got = chat["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in got] == lp["tokens"], (got, lp)
    for t, want, top in zip(got, lp["token_logprobs"], lp["top_logprobs"]):
        assert abs(t["logprob"] - want) < 1e-4, (t, want)
        assert [x["token"] for x in t["top_logprobs"]] == list(top), (t, top)
        assert all(abs(x["logprob"] - top[x["token"]]) < 1e-4 for x in t["top_logprobs"]), (t, top)
    out["prompt"] = {"tokens": len(ids), "chat_tokens": chat["usage"]["prompt_tokens"], "text": text}

    # --- The answers' calls: ember's, whole and streamed, are Qwen's parse of the raw text.
    choices = {
        "required": "required",
        "named": {"type": "function", "function": {"name": "get_weather"}},
        "auto": "auto",
    }
    out["calls"] = {}
    for name, choice in choices.items():
        most = 200 if name == "auto" else 1500
        kw = dict(messages=wire, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=most, logprobs=True)
        r = client.chat.completions.create(model=model, **kw).model_dump()
        ch = r["choices"][0]
        raw = raw_text(ch["logprobs"]["content"], special)
        want = qwen_parse(raw)
        whole = ember_whole(ch["message"])
        assert same(whole, want), short(name, whole, want, raw)
        streamed, raw_streamed, finish = ember_streamed(client, model, special, **kw)
        assert raw_streamed == raw, short(name, raw_streamed, raw)
        assert same(streamed, want), short(name, streamed, want, raw)
        assert finish == ch["finish_reason"], (name, finish, ch["finish_reason"])
        if name != "auto":
            assert ch["finish_reason"] == "tool_calls" and want["calls"], (name, r)
        out["calls"][name] = {"finish": ch["finish_reason"], "raw": raw, "qwen": want, "ember": whole}
    assert out["calls"]["named"]["qwen"]["calls"][0][0] == "get_weather"
    print(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(*sys.argv[2:4])
    else:
        check(*sys.argv[2:5])
