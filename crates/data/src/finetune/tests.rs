use super::*;

const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

fn tokenizer() -> Tokenizer {
    Tokenizer::train_char("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ<>|_\n:?!.,")
}

#[test]
fn jsonl_records_and_bad_lines() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.jsonl");
    std::fs::write(&p, "{\"prompt\": \"Q: hi\", \"completion\": \" A: ho\"}\n\n{\"text\": \"plain\"}\n").unwrap();
    let r = read_jsonl(&p).unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(r[1], Record { body: Body::Text("plain".into()), line: 3, tools: vec![] }, "blank lines counted");
    std::fs::write(&p, "{\"prompt\": \"x\", \"completion\": \"y\"}\n{\"question\": 1}\n").unwrap();
    let e = read_jsonl(&p).unwrap_err().to_string();
    assert!(e.contains("d.jsonl:2:") && e.contains("expected {\"prompt\""), "{e}");
    std::fs::write(&p, "{not json\n").unwrap();
    assert!(read_jsonl(&p).unwrap_err().to_string().contains("d.jsonl:1:"));
    let chat = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "ho"}]}"#;
    std::fs::write(&p, format!("{chat}\n")).unwrap();
    let e = read_jsonl(&p).unwrap_err().to_string();
    assert!(e.contains("d.jsonl:1:") && e.contains("messages[1].role `wizard`"), "{e}");
    std::fs::write(&p, "{\"prompt\": \"x\", \"completion\": \" \"}\n{\"prompt\": \"y\", \"completion\": \"\"}\n")
        .unwrap();
    let e = read_jsonl(&p).unwrap_err().to_string();
    assert!(e.contains("every example's completion is empty (2 of 2)"), "{e}");
    // Named at the first row's line, blank lines before it counted.
    std::fs::write(&p, "\n{\"prompt\": \"x\", \"completion\": \"\"}\n").unwrap();
    let e = read_jsonl(&p).unwrap_err().to_string();
    assert!(e.contains("d.jsonl:2: every example's completion is empty (1 of 1)"), "{e}");
    std::fs::write(&p, "{\"prompt\": \"x\", \"completion\": \"z\"}\n{\"prompt\": \"y\", \"completion\": \"\"}\n")
        .unwrap();
    assert_eq!(read_jsonl(&p).unwrap().len(), 2, "some empty completions: a warning");
}

/// Issue 57: a `messages` row was refused in serde's words (`invalid type: ... expected struct
/// Message`), and an example the template refuses named neither the file nor the line.
#[test]
fn chat_rows_are_refused_in_words_at_their_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.jsonl");
    let refused = |row: &str| {
        std::fs::write(&p, format!("\n{row}\n")).unwrap();
        read_jsonl(&p).unwrap_err().to_string()
    };
    let file = p.display().to_string();
    for (row, want) in [
        (r#"{"messages": 5}"#, r#"2: messages: expected a list of {"role", "content"}, found a number"#),
        (r#"{"messages": [7]}"#, r#"2: messages[0]: expected a message {"role", "content"}, found a number"#),
        (r#"{"messages": [{"role": "user"}]}"#, "2: messages[0].content is missing"),
        (r#"{"messages": [{"role": 1, "content": "a"}]}"#, "2: messages[0].role: expected a string, found a number"),
        (
            r#"{"messages": [{"role": "user", "content": [{"type": "text"}]}]}"#,
            "2: messages[0].content: expected a string, found a list (of parts?)",
        ),
    ] {
        let e = refused(row);
        assert!(e.starts_with(&format!("{file}:{want}")), "{row}: {e}");
    }
    // The template's own refusal, at the line of the row it refused.
    let strict = "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}\
                  {{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}";
    let template = ChatTemplate::new(strict.into(), String::new(), String::new()).unwrap();
    let ok = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}"#;
    let bad = r#"{"messages": [{"role": "assistant", "content": "ho"}, {"role": "user", "content": "hi"}]}"#;
    std::fs::write(&p, format!("{ok}\n\n{bad}\n")).unwrap();
    let records = read_jsonl(&p).unwrap();
    assert_eq!(records.iter().map(|r| r.line).collect::<Vec<_>>(), [1, 3]);
    let e = encode_of_file(&p, &records, &tokenizer(), Some(&template)).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{file}:3: tokenizer: chat template: ")), "{e}");
    assert!(e.contains("Conversation roles must alternate"), "{e}");
    let e = encode_of_file(&p, &records, &tokenizer(), None).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{file}:1: tokenizer: chat messages need a chat template")), "{e}");
}

#[test]
fn a_template_names_its_roles() {
    let plain = ChatTemplate::new(CHATML.into(), String::new(), String::new()).unwrap();
    assert_eq!(plain.roles(), ["system", "user", "assistant"]);
    let tools = format!("{{% if messages[0].role == 'tool' %}}{{% endif %}}{CHATML}");
    assert_eq!(ChatTemplate::new(tools, String::new(), String::new()).unwrap().roles().len(), 4);
}

#[test]
fn only_completions_and_assistant_turns_are_scored() {
    let tok = tokenizer();
    let ex =
        encode(&[Body::Completion { prompt: "Q: hi".into(), completion: " A: ho".into() }.into()], &tok, None).unwrap();
    let scored: String =
        ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
    assert_eq!(scored, " A: ho");
    let template = ChatTemplate::new(CHATML.into(), String::new(), "<|im_end|>".into()).unwrap();
    let chat: Record = Body::Chat(vec![
        Message::new("user", "hi"),
        Message::new("assistant", "ho"),
        Message::new("user", "why"),
        Message::new("assistant", "so"),
    ])
    .into();
    let ex = encode(&[chat], &tok, Some(&template)).unwrap();
    let all = tok.decode(&ex[0].ids).unwrap();
    assert_eq!(all, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nho<|im_end|>\n<|im_start|>user\nwhy<|im_end|>\n<|im_start|>assistant\nso<|im_end|>\n");
    let scored: String =
        ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
    assert_eq!(scored, "ho<|im_end|>\nso<|im_end|>\n");
    assert!(encode(&[Body::Chat(vec![]).into()], &tok, None).is_err());
}

/// The templates of tests/fixtures/templates and what transformers renders with them
/// (`make_expected.py` there).
fn expected_renderings() -> Value {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates");
    serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap()
}

fn fixture_template(name: &str, bos: &str, eos: &str) -> ChatTemplate {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates");
    ChatTemplate::new(std::fs::read_to_string(dir.join(name)).unwrap(), bos.into(), eos.into()).unwrap()
}

/// `text` with the date SmolLM3's template writes (`Today Date: ...`, from `strftime_now`) as
/// `make_expected.py` stops transformers' clock: 02 January 2025.
fn on_the_fixed_day(text: String) -> String {
    let Some(at) = text.find("Today Date: ").map(|i| i + "Today Date: ".len()) else { return text };
    let end = at + text[at..].find('\n').unwrap_or(text.len() - at);
    format!("{}02 January 2025{}", &text[..at], &text[end..])
}

/// Tools and a tool-call round trip (an assistant's call, the tool's answer) render through
/// Qwen2.5's, Qwen3's, Llama 3.1's, Mistral Nemo's and SmolLM3's own templates byte for byte
/// as transformers' `apply_chat_template(tools=...)` renders them.
#[test]
fn tool_calls_render_as_transformers_renders_them() {
    let expected = expected_renderings();
    let Value::Array(items) = &expected["messages"] else { panic!("messages") };
    let messages = messages_of(items, "messages").unwrap();
    assert_eq!(messages[2].tool_calls[0].name, "get_weather");
    assert_eq!(messages[3].tool_call_id.as_deref(), Some("call9abcd"));
    let tools = expected["tools"].as_array().unwrap().clone();
    for (name, want) in expected["rendered"].as_object().unwrap() {
        let (bos, eos) = (want["bos"].as_str().unwrap(), want["eos"].as_str().unwrap());
        let template = fixture_template(name, bos, eos);
        let dated = |text: String| if name.starts_with("smollm3") { on_the_fixed_day(text) } else { text };
        let prompt = dated(template.render_with_tools(&messages[..2], &tools, true).unwrap());
        assert_eq!(prompt, want["prompt"].as_str().unwrap(), "{name}: the prompt");
        let all = dated(template.render_with_tools(&messages, &tools, false).unwrap());
        assert_eq!(all, want["conversation"].as_str().unwrap(), "{name}: the conversation");
    }
    // Without tools, `tools` is undefined: Qwen2.5's plain system turn.
    let plain = fixture_template("qwen2.5.jinja", "", "<|im_end|>").render(&messages[..2], true).unwrap();
    assert!(plain.starts_with("<|im_start|>system\nYou are terse.<|im_end|>\n"), "{plain}");
}

/// SmolLM3's official template (`{% generation %}` tags, `strftime_now`, tools as
/// `xml_tools` written with `| string`) loads and renders a conversation with neither a system
/// turn nor tools; its calls are text in the assistant's content (the template writes no
/// `tool_calls`, as in transformers), and training scores that text.
#[test]
fn smollm3s_template_loads_renders_and_trains() {
    let template = fixture_template("smollm3.jinja", "", "<|im_end|>");
    let today = jinja::strftime_now("%d %B %Y".into()).unwrap();
    let prompt = template.render(&[Message::new("user", "hi")], true).unwrap();
    assert!(prompt.starts_with("<|im_start|>system\n## Metadata\n"), "{prompt}");
    assert!(prompt.contains(&format!("Today Date: {today}\nReasoning Mode: /think\n")), "{prompt}");
    assert!(!prompt.contains("### Tools"), "{prompt}");
    assert!(prompt.ends_with("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), "{prompt}");
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let tools = vec![serde_json::json!({"type": "function", "function": {"name": "get_weather"}})];
    let record = Record {
        tools,
        ..Body::Chat(vec![
            Message::new("system", "Be brief. /no_think"),
            Message::new("user", "Weather in Paris?"),
            Message::new("assistant", call),
            Message::new("tool", "21 C"),
            Message::new("assistant", "It is 21 C."),
        ])
        .into()
    };
    let Body::Chat(messages) = &record.body else { unreachable!() };
    let text = template.render_with_tools(messages, &record.tools, false).unwrap();
    assert!(text.contains("Reasoning Mode: /no_think\n"), "{text}");
    assert!(text.contains("'function': {'name': 'get_weather'}"), "the tools as Python writes them: {text}");
    assert!(text.contains("<|im_start|>user\n21 C<|im_end|>\n"), "the tool's answer as a user turn: {text}");
    let tok = Tokenizer::train_char(&text);
    let ex = encode(&[record], &tok, Some(&template)).unwrap();
    let scored: String =
        ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
    // The empty thinking of `/no_think` comes with the generation prompt: not scored.
    assert_eq!(scored, format!("{call}<|im_end|>\nIt is 21 C.<|im_end|>\n"));
}

#[test]
fn tojson_writes_as_python_does() {
    let t = |source: &str| {
        let template = ChatTemplate::new(source.into(), String::new(), String::new()).unwrap();
        template.render(&[Message::new("user", "a<b> & 'c' é")], false).unwrap()
    };
    assert_eq!(t("{{ messages[0] | tojson }}"), r#"{"role": "user", "content": "a<b> & 'c' é"}"#);
    assert_eq!(t("{{ messages[0].content | tojson(ensure_ascii=true) }}"), r#""a<b> & 'c' \u00e9""#);
    assert_eq!(
        t("{{ messages | tojson(indent=2) }}"),
        "[\n  {\n    \"role\": \"user\",\n    \"content\": \"a<b> & 'c' é\"\n  }\n]"
    );
    assert_eq!(
        t("{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}"),
        r#"{"content":"a<b> & 'c' é","role":"user"}"#
    );
    assert_eq!(t("{{ [] | tojson(indent=2) }}{{ {} | tojson }}"), "[]{}");
}

/// A TRL tool-calling row (`messages` with an assistant's `tool_calls` and a `tool` turn's
/// answer, and the row's `tools`) trains through the template with the tools: the loss covers
/// exactly the assistant turns, its call included, and nothing of the tools or the answer.
#[test]
fn tool_calling_rows_score_the_assistants_calls() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.jsonl");
    let row = serde_json::json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
            ]},
            {"role": "tool", "name": "get_weather", "content": "21 C"},
            {"role": "assistant", "content": "It is 21 C."},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city"}}],
    });
    std::fs::write(&p, format!("{row}\n")).unwrap();
    let records = read_jsonl(&p).unwrap();
    assert_eq!(records[0].tools.len(), 1);
    let Body::Chat(messages) = &records[0].body else { panic!("a chat") };
    assert_eq!(messages[1].tool_calls[0].arguments, serde_json::json!({"city": "Paris"}));
    let template = fixture_template("qwen2.5.jinja", "", "<|im_end|>");
    let text = template.render_with_tools(messages, &records[0].tools, false).unwrap();
    let tok = Tokenizer::train_char(&text);
    let ex = encode(&records, &tok, Some(&template)).unwrap();
    assert_eq!(tok.decode(&ex[0].ids).unwrap(), text);
    assert!(text.contains("\"description\": \"Weather of a city\""), "the tools are in the prompt: {text}");
    let scored: String =
        ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
    let call =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n";
    assert_eq!(scored, format!("{call}It is 21 C.<|im_end|>\n"));
    // Bad rows are refused in words, at their line.
    for (row, want) in [
        (
            r#"{"messages": [{"role": "assistant", "tool_calls": 3}], "tools": []}"#,
            "messages[0].tool_calls: expected a list of tool calls, found a number",
        ),
        (
            r#"{"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]}"#,
            "messages[0].tool_calls[0].function.name is missing",
        ),
        (
            r#"{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]}"#,
            "messages[0].tool_calls[0].function.arguments: expected a JSON object",
        ),
        (
            r#"{"messages": [{"role": "assistant", "content": "x"}], "tools": {"a": 1}}"#,
            "tools: expected a list of tool objects",
        ),
        (r#"{"messages": [{"role": "assistant"}]}"#, "messages[0].content is missing"),
    ] {
        std::fs::write(&p, format!("{row}\n")).unwrap();
        let e = read_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains(&format!("d.jsonl:1: {want}")), "{row}: {e}");
    }
}

/// Templates that cannot write tools or calls get them as text, in training as in the server:
/// SmolLM2's (no tools section) gets the default tools block, the call as Hermes text and the
/// answer as a user turn of `<tool_response>`; SmolLM3's (tools, but no calls) the call as
/// Hermes text. The loss covers the assistant's call and answer, never the tool's result.
#[test]
fn tools_a_template_cannot_write_are_trained_as_text() {
    let kinds = [
        ("qwen2.5.jinja", ToolText::InTemplate),
        ("qwen3.jinja", ToolText::InTemplate),
        ("llama3.1.jinja", ToolText::InTemplate),
        ("mistral-nemo.jinja", ToolText::InTemplate),
        ("smollm2.jinja", ToolText::AllAsText),
        ("smollm3.jinja", ToolText::CallsAsText),
    ];
    for (name, kind) in kinds {
        assert_eq!(fixture_template(name, "", "</s>").tool_text(), kind, "{name}");
    }
    let call =
        ToolCall { id: "c1".into(), name: "get_weather".into(), arguments: serde_json::json!({"city": "Paris"}) };
    let tools = vec![serde_json::json!({"type": "function", "function": {"name": "get_weather"}})];
    let record = Record {
        tools: tools.clone(),
        ..Body::Chat(vec![
            Message::new("user", "Weather in Paris?"),
            Message::calls("", vec![call]),
            Message::tool_result("c1", "21 C"),
            Message::new("assistant", "It is 21 C."),
        ])
        .into()
    };
    let Body::Chat(messages) = &record.body else { unreachable!() };
    let hermes = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    for name in ["smollm2.jinja", "smollm3.jinja"] {
        let template = fixture_template(name, "", "<|im_end|>");
        let text = template.render_conversation(messages, &tools, false).unwrap();
        assert!(text.contains(&format!("<|im_start|>assistant\n{hermes}<|im_end|>\n")), "{name}: {text}");
        let tok = Tokenizer::train_char(&text);
        let ex = encode(std::slice::from_ref(&record), &tok, Some(&template)).unwrap();
        assert_eq!(tok.decode(&ex[0].ids).unwrap(), text, "{name}: encode renders as the server does");
        let scored: String =
            ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
        assert_eq!(scored, format!("{hermes}<|im_end|>\nIt is 21 C.<|im_end|>\n"), "{name}");
    }
    let smollm2 = fixture_template("smollm2.jinja", "", "<|im_end|>");
    let text = smollm2.render_conversation(messages, &tools, false).unwrap();
    let block = tool_text::default_tools_block(&tools);
    assert!(text.starts_with(&format!("<|im_start|>system\n{block}<|im_end|>\n")), "{text}");
    // (The tool's keys in serde_json's order: sorted, unless a crate of the build keeps them.)
    assert!(
        block.contains("<tools>\n{\"")
            && block.contains("{\"name\": \"get_weather\"}")
            && block.contains("}\n</tools>\n"),
        "{block}"
    );
    assert!(text.contains("<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n"), "{text}");
    // Nothing to write: the messages reach the template as they are.
    let plain = [Message::new("user", "hi"), Message::new("assistant", "ho")];
    assert!(matches!(smollm2.with_tools_written(&plain, &[]).0, std::borrow::Cow::Borrowed(_)));
}

#[test]
fn packing_fills_rows_and_masks_targets() {
    let ex = vec![
        Example { ids: vec![1, 2, 3, 4], scored: vec![false, false, true, true] },
        Example { ids: vec![5, 6, 7], scored: vec![false, true, true] },
    ];
    let p = PackedExamples::new(&ex, 3, 0, Packing::Stream, false).unwrap();
    assert_eq!(p.len(), 2);
    assert_eq!(p.get(0).unwrap(), Window { input: vec![1, 2, 3], target: vec![-1, 3, 4], docs: None });
    assert_eq!(p.get(1).unwrap(), Window { input: vec![4, 5, 6], target: vec![-1, 6, 7], docs: None });
    assert_eq!(p.scored_tokens(), 4);
}

#[test]
fn document_packing_keeps_examples_whole_and_apart() {
    let ex = vec![
        Example { ids: vec![1, 2, 3, 4], scored: vec![false, false, true, true] },
        Example { ids: vec![5, 6, 7], scored: vec![false, true, true] },
        Example { ids: vec![8, 9], scored: vec![true, true] },
        Example { ids: vec![10], scored: vec![true] }, // nothing to predict: skipped
    ];
    let p = PackedExamples::new(&ex, 6, 0, Packing::Documents, false).unwrap();
    assert_eq!(p.len(), 1);
    // 3 + 2 positions fit in a row of 6; the third example (1 position) fits too.
    assert_eq!(
        p.get(0).unwrap(),
        Window { input: vec![1, 2, 3, 5, 6, 8], target: vec![-1, 3, 4, 6, 7, 9], docs: Some(vec![0, 0, 0, 3, 3, 5]) }
    );
    assert_eq!(p.scored_tokens(), 5);
    let p = PackedExamples::new(&ex, 4, 0, Packing::Documents, false).unwrap();
    assert_eq!(p.len(), 2);
    assert_eq!(
        p.get(1).unwrap(),
        Window { input: vec![5, 6, 8, 0], target: vec![6, 7, 9, -1], docs: Some(vec![0, 0, 2, 3]) }
    );
    let none = PackedExamples::new(&ex, 6, 0, Packing::None, false).unwrap();
    assert_eq!(none.len(), 3);
    assert_eq!(
        none.get(2).unwrap(),
        Window { input: vec![8, 0, 0, 0, 0, 0], target: vec![9, -1, -1, -1, -1, -1], docs: None }
    );
    let e = PackedExamples::new(&ex, 2, 0, Packing::Documents, false).unwrap_err().to_string();
    assert!(e.contains("example 1 has 4 tokens") && e.contains("3"), "{e}");
    let cut = PackedExamples::new(&ex, 2, 0, Packing::Documents, true).unwrap();
    assert_eq!(cut.get(0).unwrap(), Window { input: vec![1, 2], target: vec![-1, 3], docs: Some(vec![0, 0]) });
}
