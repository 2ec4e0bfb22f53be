use serde_json::json;

use super::*;

fn fixture(name: &str) -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates");
    std::fs::read_to_string(dir.join(name)).unwrap()
}

#[test]
fn the_format_is_read_from_the_template() {
    for (name, format) in [
        ("qwen2.5.jinja", ToolFormat::Hermes),
        ("qwen3.jinja", ToolFormat::Hermes),
        ("llama3.1.jinja", ToolFormat::Llama3),
        ("mistral-nemo.jinja", ToolFormat::Mistral),
        ("smollm2.jinja", ToolFormat::Default),
        // SmolLM3 asks for `<tool_call>` JSON in its tools section (its template writes no calls).
        ("smollm3.jinja", ToolFormat::Hermes),
    ] {
        assert_eq!(ToolFormat::detect(&fixture(name)), format, "{name}");
    }
}

/// `text` read in pieces of `size` bytes (cut at character boundaries): the deltas and the result.
fn streamed(format: ToolFormat, text: &str, size: usize) -> (Vec<ToolDelta>, Parsed) {
    let mut stream = ToolStream::new(format);
    let mut deltas = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let mut end = (at + size).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        deltas.extend(stream.push(&text[at..end]));
        at = end;
    }
    let (last, parsed) = stream.finish();
    deltas.extend(last);
    (deltas, parsed)
}

/// The deltas put together: the content, and each call's id, name and arguments text.
fn assemble(deltas: &[ToolDelta]) -> (String, Vec<(String, String, String)>) {
    let mut content = String::new();
    let mut calls: Vec<(String, String, String)> = Vec::new();
    for d in deltas {
        match d {
            ToolDelta::Content(t) => content.push_str(t),
            ToolDelta::CallStart { index, id, name } => {
                assert_eq!(*index, calls.len(), "calls start in order");
                calls.push((id.clone(), name.clone(), String::new()));
            }
            ToolDelta::Arguments { index, text } => calls[*index].2.push_str(text),
        }
    }
    (content, calls)
}

fn call(name: &str, arguments: Value) -> (String, Value) {
    (name.to_string(), arguments)
}

/// Each format's calls, read whole and in pieces of 1 to 7 bytes: the same calls, and deltas
/// that put together are the content and the calls (ids included).
#[test]
fn calls_parse_the_same_whole_and_streamed() {
    let weather = json!({"city": "Paris", "unit": "celsius"});
    let add = json!({"a": 1, "b": 2.5});
    // The format, the answer, its content and its calls.
    type Case = (ToolFormat, String, &'static str, Vec<(String, Value)>);
    let cases: Vec<Case> = vec![
        (
            ToolFormat::Hermes,
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \
             \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2.5}}\n</tool_call>\n"
                .into(),
            "Let me check.",
            vec![call("get_weather", weather.clone()), call("add", add.clone())],
        ),
        (
            // Arguments as a string of JSON, a list in one block, braces and a marker inside strings.
            ToolFormat::Hermes,
            "<tool_call>\n[{\"arguments\": \"{\\\"q\\\": \\\"}{\\\"}\", \"name\": \"search\"}, {\"name\": \"note\", \
             \"arguments\": {\"text\": \"a </tool_call> b {\"}}]\n</tool_call>"
                .into(),
            "",
            vec![call("search", json!({"q": "}{"})), call("note", json!({"text": "a </tool_call> b {"}))],
        ),
        (
            ToolFormat::Default,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>"
                .into(),
            "",
            vec![call("get_weather", weather.clone())],
        ),
        (
            ToolFormat::Llama3,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}".into(),
            "",
            vec![call("get_weather", weather.clone())],
        ),
        (
            ToolFormat::Llama3,
            "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 1, \"b\": 2.5}}".into(),
            "",
            vec![call("add", add.clone())],
        ),
        (
            ToolFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}, \
             {\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2.5}, \"id\": \"abcdefghi\"}]"
                .into(),
            "",
            vec![call("get_weather", weather.clone()), call("add", add.clone())],
        ),
    ];
    for (format, text, content, calls) in cases {
        let whole = parse(format, &text);
        assert_eq!(whole.content, content, "{format:?}: {text}");
        let got: Vec<_> = whole.calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
        assert_eq!(got, calls, "{format:?}: {text}");
        let id_len = if format == ToolFormat::Mistral { 9 } else { 29 };
        assert!(whole.calls.iter().all(|c| c.id.len() == id_len), "{:?}", whole.calls);
        for size in 1..=7 {
            let (deltas, parsed) = streamed(format, &text, size);
            assert_eq!(parsed.content, content, "{format:?} in pieces of {size}: {text}");
            let got: Vec<_> = parsed.calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
            assert_eq!(got, calls, "{format:?} in pieces of {size}: {text}");
            let (said, said_calls) = assemble(&deltas);
            assert_eq!(said, content, "{format:?} in pieces of {size}: the content deltas");
            assert_eq!(said_calls.len(), calls.len(), "{format:?} in pieces of {size}: {deltas:?}");
            for ((id, name, arguments), c) in said_calls.iter().zip(&parsed.calls) {
                assert_eq!((id, name), (&c.id, &c.name));
                let arguments: Value = serde_json::from_str(arguments).unwrap();
                assert_eq!(arguments, c.arguments, "{format:?} in pieces of {size}: {deltas:?}");
            }
        }
    }
}

/// Arguments stream as the model writes them, not all at the end.
#[test]
fn arguments_stream_as_they_come() {
    let mut s = ToolStream::new(ToolFormat::Hermes);
    assert_eq!(s.push("Sure.\n<tool_"), vec![ToolDelta::Content("Sure.".into())]);
    assert_eq!(s.push("call>\n{\"name\": \"add\", \"argu"), vec![]);
    let d = s.push("ments\": {\"a\": 1");
    assert!(
        matches!(&d[..], [ToolDelta::CallStart { index: 0, name, .. }, ToolDelta::Arguments { index: 0, text }]
        if name == "add" && text == "{\"a\": 1"),
        "{d:?}"
    );
    assert_eq!(s.push(", \"b\": 2}}"), vec![ToolDelta::Arguments { index: 0, text: ", \"b\": 2}".into() }]);
    assert_eq!(s.push("\n</tool_call>"), vec![]);
    let (last, parsed) = s.finish();
    assert_eq!((last, parsed.content.as_str(), parsed.calls.len()), (vec![], "Sure.", 1));
}

/// What is not a well-formed call stays text, all of it, whole or streamed.
#[test]
fn malformed_calls_stay_content() {
    for (format, text) in [
        (ToolFormat::Hermes, "<tool_call>\n{\"name\": 5, \"arguments\": {}}\n</tool_call> then"),
        (ToolFormat::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1"),
        (ToolFormat::Hermes, "I write <tool_call> tags and <tool_ things."),
        (ToolFormat::Hermes, "<tool_call>\n{\"name\": \"add\"} and more\n</tool_call>"),
        (ToolFormat::Hermes, "<tool_call>not json</tool_call>"),
        (ToolFormat::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": [1]}\n</tool_call>"),
        (ToolFormat::Hermes, "a } b ] c <tool_call>}"),
        (ToolFormat::Llama3, "{\"answer\": 42}"),
        (ToolFormat::Llama3, "The call: {\"name\": \"add\", \"parameters\": {}}"),
        (ToolFormat::Llama3, "  {\"name\": \"add\", \"parameters\": {"),
        (ToolFormat::Mistral, "[TOOL_CALLS] not json"),
        (ToolFormat::Mistral, "[TOOL_CALLS][]"),
        (ToolFormat::Mistral, "Plain [TOOL_ text, é and ü."),
        (ToolFormat::Default, "Plain text with < and <tool and \n\n"),
    ] {
        assert_eq!(
            parse(format, text),
            Parsed { content: text.into(), calls: vec![], arguments: vec![] },
            "{format:?}: {text}"
        );
        for size in 1..=7 {
            let (deltas, parsed) = streamed(format, text, size);
            assert_eq!(
                parsed,
                Parsed { content: text.into(), calls: vec![], arguments: vec![] },
                "{format:?} in {size}: {text}"
            );
            let cut_off = text.ends_with('{') || text.ends_with('1');
            if !cut_off {
                assert_eq!(assemble(&deltas), (text.to_string(), vec![]), "{format:?} in {size}: {text}");
            }
        }
    }
}

#[test]
fn tools_and_tool_choice_are_checked_naming_the_field() {
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "add"}},
    ]);
    let t = Tools::read(Some(&tools)).unwrap();
    assert_eq!(t.names().collect::<Vec<_>>(), ["get_weather", "add"]);
    for (bad, param) in [
        (json!({"a": 1}), "tools"),
        (json!([5]), "tools[0]"),
        (json!([{"type": "code", "function": {"name": "a"}}]), "tools[0].type"),
        (json!([{"type": "function"}]), "tools[0].function"),
        (json!([{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
        (json!([{"type": "function", "function": {"name": "a", "parameters": 3}}]), "tools[0].function.parameters"),
        (json!([{"function": {"name": "a"}}, {"function": {"name": "a"}}]), "tools[1].function.name"),
    ] {
        assert_eq!(Tools::read(Some(&bad)).unwrap_err().param, param, "{bad}");
    }
    let choice = |v: Value| ToolChoice::read(Some(&v), &t);
    assert_eq!(choice(json!("none")).unwrap(), ToolChoice::None);
    assert_eq!(choice(json!("auto")).unwrap(), ToolChoice::Auto);
    assert_eq!(choice(json!("required")).unwrap(), ToolChoice::Required);
    assert_eq!(
        choice(json!({"type": "function", "function": {"name": "add"}})).unwrap(),
        ToolChoice::Named("add".into())
    );
    assert_eq!(ToolChoice::read(None, &t).unwrap(), ToolChoice::Auto);
    assert_eq!(ToolChoice::read(None, &Tools::default()).unwrap(), ToolChoice::None);
    for bad in
        [json!("always"), json!(3), json!({"type": "function", "function": {"name": "sub"}}), json!({"function": {}})]
    {
        let e = choice(bad.clone()).unwrap_err();
        assert_eq!(e.param, "tool_choice", "{bad}");
    }
    let e = ToolChoice::read(Some(&json!("required")), &Tools::default()).unwrap_err();
    assert!(e.message.contains("no tools"), "{}", e.message);
}

fn weather_tools() -> Tools {
    Tools::read(Some(&json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "add"}},
    ])))
    .unwrap()
}

#[test]
fn required_and_named_choices_have_a_grammar_in_the_models_format() {
    let tools = weather_tools();
    let none = |_: &str| None;
    assert_eq!(call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::Auto, false, &none), None);
    assert_eq!(call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::None, false, &none), None);
    let hermes = call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::Required, false, &none).unwrap();
    assert!(
        hermes.starts_with(
            "start: call (\"\\n\" call){0,1}\ncall: \"<tool_call>\" \"\\n\" function \"\\n\" \"</tool_call>\"\n"
        ),
        "{hermes}"
    );
    assert!(hermes.contains("function: function_0 | function_1\n"), "{hermes}");
    assert!(hermes.contains("function_0: %json {\"x-guidance\": {\"whitespace_flexible\": false, "), "{hermes}");
    assert!(
        hermes.contains(
            "\"type\": \"object\", \"properties\": {\"name\": {\"const\": \"get_weather\"}, \"arguments\": {"
        ),
        "{hermes}"
    );
    let qwen = |t: &str| (t == "<tool_call>").then_some(151657).or((t == "</tool_call>").then_some(151658));
    let named = call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::Named("add".into()), false, &qwen).unwrap();
    assert!(named.starts_with("start: call\ncall: <[151657]> \"\\n\" function \"\\n\" <[151658]>\n"), "{named}");
    assert!(named.contains("function: function_0\nfunction_0: %json {\"x-guidance\": "), "{named}");
    assert!(
        named.contains("\"properties\": {\"name\": {\"const\": \"add\"}, \"arguments\": {\"type\":\"object\"}}"),
        "{named}"
    );
    let llama = call_grammar(ToolFormat::Llama3, &tools, &ToolChoice::Required, false, &none).unwrap();
    assert!(llama.starts_with("start: function\n") && llama.contains("\"parameters\": {"), "{llama}");
    let mistral = call_grammar(ToolFormat::Mistral, &tools, &ToolChoice::Required, false, &|_| Some(5)).unwrap();
    assert!(mistral.starts_with("start: <[5]> \"[\" function (\", \" function){0,1} \"]\"\n"), "{mistral}");
    // `parallel_tool_calls: false`: one call.
    let single = call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::Required, true, &none).unwrap();
    assert!(single.starts_with("start: call\n"), "{single}");
}

/// Text that a grammar admits parses back into the calls it was written for.
#[test]
fn what_the_grammar_admits_parses() {
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>";
    let parsed = parse(ToolFormat::Default, text);
    assert_eq!(parsed.calls.len(), 2);
    let block = default_tools_block(weather_tools().json());
    assert!(
        block.contains("<tools>\n{\"type\": \"function\", \"function\": {")
            && block.contains("\"name\": \"get_weather\""),
        "{block}"
    );
    assert!(
        block.contains(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"argument_name\": \"value\"}}\n</tool_call>"
        ),
        "{block}"
    );
}

/// Every format's grammar compiles in llguidance, and forces text that parses into calls.
#[test]
fn the_grammars_compile() {
    use ember_grammar::{Grammars, Spec};
    let alphabet: String = (' '..='~').chain(['\n']).collect();
    let tokenizer = ember_data::tokenizer::Tokenizer::train_char(&alphabet);
    let end = tokenizer.vocab_size() as u32 - 1;
    let grammars = Grammars::new(&tokenizer, &[end], tokenizer.vocab_size()).unwrap();
    let tools = weather_tools();
    for format in [ToolFormat::Hermes, ToolFormat::Llama3, ToolFormat::Mistral, ToolFormat::Default] {
        for choice in [ToolChoice::Required, ToolChoice::Named("get_weather".into())] {
            for special in [None, Some(3)] {
                let lark = call_grammar(format, &tools, &choice, false, &|_| special).unwrap();
                if let Err(e) = grammars.check(&Spec::Lark(lark.clone())) {
                    panic!("{format:?} {choice:?}: {e}\n{lark}");
                }
            }
        }
    }
}

#[test]
fn a_call_cut_off_after_whole_ones_keeps_the_whole_ones() {
    let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"argu";
    let parsed = parse(ToolFormat::Default, text);
    assert_eq!(parsed.calls.len(), 1, "{parsed:?}");
    assert_eq!(parsed.calls[0].name, "a");
    assert!(parsed.content.trim_start().starts_with("<tool_call>\n{\"name\": \"b\""), "{parsed:?}");
}

#[test]
fn a_marker_that_comes_token_by_token_is_a_marker() {
    let mut stream = ToolStream::new(ToolFormat::Default);
    let mut said = Vec::new();
    for piece in [
        "<",
        "tool",
        "_",
        "call",
        ">",
        "\n",
        "{\"",
        "name",
        "\":",
        " \"",
        "a",
        "\", \"arguments\": {}}",
        "\n",
        "</",
        "tool_call",
        ">",
    ] {
        said.extend(stream.push(piece));
    }
    let (last, parsed) = stream.finish();
    said.extend(last);
    assert_eq!(parsed.calls.len(), 1, "{parsed:?} {said:?}");
    assert_eq!(parsed.content, "", "{parsed:?}");
}

#[test]
fn a_whole_call_without_its_closing_marker_is_still_a_call() {
    let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\nHello";
    let parsed = parse(ToolFormat::Default, text);
    assert_eq!(parsed.calls.len(), 1, "{parsed:?}");
    assert_eq!(parsed.content.trim(), "Hello", "{parsed:?}");
    let parsed = parse(ToolFormat::Default, "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}");
    assert_eq!(parsed.calls.len(), 1, "{parsed:?}");
}
