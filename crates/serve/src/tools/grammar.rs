//! The grammar that a `tool_choice` of `required` or a named function puts on the answer.

use super::{ToolChoice, ToolFormat, Tools};

/// llguidance's JSON options for the calls: no free white space, `", "` and `": "` between items.
const LAYOUT: &str =
    r#"{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true}"#;

/// The grammar (llguidance's Lark) that `choice` puts on the answer: `Required` admits one call
/// or more, at most one per function offered, of any of `tools` (one for Llama 3, whose template
/// holds one, and where `single`:
/// `parallel_tool_calls: false`), `Named` one call of
/// that function, each in the model's format with the function's `parameters` schema for its
/// arguments; `Auto` and `None` put none. `special` gives the token id of a marker the tokenizer
/// has as one token (`<tool_call>`, `[TOOL_CALLS]`), which the grammar then names by id
/// (`<[151657]>`): a special token is not text a grammar can spell.
pub fn call_grammar(
    format: ToolFormat,
    tools: &Tools,
    choice: &ToolChoice,
    single: bool,
    special: &dyn Fn(&str) -> Option<u32>,
) -> Option<String> {
    let names: Vec<&str> = match choice {
        ToolChoice::None | ToolChoice::Auto => return None,
        ToolChoice::Required => tools.names().collect(),
        ToolChoice::Named(name) => vec![name.as_str()],
    };
    // At most one call per function offered: a small model asked for calls otherwise repeats its
    // last one until the token limit cuts it.
    let more = if single || matches!(choice, ToolChoice::Named(_)) || format == ToolFormat::Llama3 {
        0
    } else {
        names.len().saturating_sub(1)
    };
    let one = more == 0;
    let marker = |text: &str| match special(text) {
        Some(id) => format!("<[{id}]>"),
        None => serde_json::to_string(text).unwrap_or_default(),
    };
    let key = format.arguments_key();
    let mut lark = match format {
        ToolFormat::Hermes | ToolFormat::Default => {
            let call = format!("call: {} \"\\n\" function \"\\n\" {}\n", marker("<tool_call>"), marker("</tool_call>"));
            let start =
                if one { "start: call\n".to_string() } else { format!("start: call (\"\\n\" call){{0,{more}}}\n") };
            format!("{start}{call}")
        }
        ToolFormat::Llama3 => "start: function\n".to_string(),
        ToolFormat::Mistral => {
            let rest = if one { String::new() } else { format!(" (\", \" function){{0,{more}}}") };
            format!("start: {} \"[\" function{rest} \"]\"\n", marker("[TOOL_CALLS]"))
        }
    };
    let rules: Vec<String> = (0..names.len()).map(|i| format!("function_{i}")).collect();
    lark.push_str(&format!("function: {}\n", rules.join(" | ")));
    for (rule, name) in rules.iter().zip(&names) {
        let name_json = serde_json::to_string(name).unwrap_or_default();
        let parameters = tools.parameters(name).to_string();
        // Written out so that `name` comes first whatever order a JSON map keeps; compact JSON in
        // the layout the formats' own examples use (a model given free white space pads with it).
        lark.push_str(&format!(
            "{rule}: %json {{\"x-guidance\": {LAYOUT}, \"type\": \"object\", \"properties\": {{\"name\": {{\"const\": \
             {name_json}}}, \"{key}\": {parameters}}}, \"required\": [\"name\", \"{key}\"], \"additionalProperties\": false}}\n"
        ));
    }
    Some(lark)
}
