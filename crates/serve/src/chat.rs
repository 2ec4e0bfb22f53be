//! A chat request's messages rendered into the prompt through the model's chat template, system
//! messages included.
//!
//! Some templates have no system turn: they raise on one (Gemma 2's "System role not supported",
//! Mistral's old "roles must alternate") or leave it out without a word. ember probes the template
//! once, as llama.cpp's server does (minja's `supports_system_role`): a system message with a
//! marker text, rendered, must show the marker. A template that fails the probe gets llama.cpp's
//! fallback (minja's `polyfill_system_role`): system messages are put at the head of the next user
//! message (several joined by a line break, and a line break before the user's text), or become a
//! user message of their own when no user message follows; the server logs a warning at start.
//! Whatever the template, a system message whose text is not in the rendered prompt (a template
//! that renders a system message only as the first one) is refused, naming the message, never
//! dropped.
//!
//! Tools (see [`crate::tools`]) reach the template as fine-tuning gives them to it
//! ([`ember_data::finetune::tool_text`]), so that a model is served what it trained on: a template
//! that has a tools section gets them as its `tools`, with the assistant's `tool_calls` and the
//! `tool` messages as they are, except that where it drops an assistant's calls (SmolLM3's) each
//! call is Hermes' `<tool_call>` text after the assistant's own. For a template without one
//! ([`ToolFormat::Default`]) ember writes them all: the tools' description at the end of the
//! system message (or as one, first), each assistant call as Hermes' `<tool_call>` text after the
//! assistant's own, and each run of `tool` messages as one user message of `<tool_response>`
//! blocks.

use ember_data::finetune::{ChatTemplate, Message};

use crate::api::Invalid;
use crate::tools::{ToolFormat, Tools};

/// A model's chat template, whether it renders system messages, and how it writes tool calls.
pub struct ChatPrompt {
    template: ChatTemplate,
    renders_system: bool,
    tool_format: ToolFormat,
    /// The roles a request's messages may have.
    roles: Vec<String>,
}

/// The text of the probe's system message: nothing a template would write by itself.
const PROBE: &str = "<<ember: does this template render a system message?>>";

impl ChatPrompt {
    /// Probes `template` for a system turn (see the module's documentation).
    pub fn new(template: ChatTemplate) -> Self {
        let probe = [message("system", PROBE), message("user", "Hello")];
        let renders_system = template.render(&probe, true).is_ok_and(|text| text.contains(PROBE));
        let tool_format = ToolFormat::detect(template.source());
        let mut roles = template.roles().to_vec();
        if !roles.iter().any(|r| r == "tool") {
            roles.push("tool".into()); // written as a user message (see the module's documentation)
        }
        Self { template, renders_system, tool_format, roles }
    }

    /// How the model writes its tool calls.
    pub fn tool_format(&self) -> ToolFormat {
        self.tool_format
    }

    /// Whether the template renders a system message itself; when not, system messages are put
    /// into the next user message.
    pub fn renders_system(&self) -> bool {
        self.renders_system
    }

    /// The roles a message may have: the template's (see `ChatTemplate::roles`), and `tool`,
    /// which ember writes itself where the template does not know it.
    pub fn roles(&self) -> &[String] {
        &self.roles
    }

    /// The prompt for `messages`, ending with the assistant's turn opened. Refused (param
    /// `messages`, or the message) when the template raises on them, or leaves a system message
    /// out.
    pub fn render(&self, messages: &[Message]) -> Result<String, Invalid> {
        self.render_with_tools(messages, &Tools::default())
    }

    /// [`ChatPrompt::render`] with the functions the model may call (see the module's
    /// documentation).
    pub fn render_with_tools(&self, messages: &[Message], tools: &Tools) -> Result<String, Invalid> {
        let (messages_in, tools_in) = self.template.with_tools_written(messages, tools.json());
        let text = if self.renders_system {
            self.template.render_with_tools(&messages_in, tools_in, true)
        } else {
            self.template.render_with_tools(&fold_system(&messages_in), tools_in, true)
        };
        let text = text.map_err(|e| {
            // The template's own words (a `raise_exception`), without the data crate's prefixes.
            let why = match e {
                ember_data::DataError::Tokenizer(why) => why,
                other => other.to_string(),
            };
            let why = why.strip_prefix("chat template: ").unwrap_or(&why);
            Invalid::new("messages", format!("this model's chat template cannot render these messages: {why}"))
        })?;
        let dropped = messages
            .iter()
            .enumerate()
            .find(|(_, m)| m.role == "system" && !m.content.trim().is_empty() && !text.contains(m.content.trim()));
        if let Some((i, _)) = dropped {
            return Err(Invalid::new(
                format!("messages[{i}]"),
                format!(
                    "this model's chat template leaves the system message messages[{i}] out of the prompt (it \
                     renders a system message only in some places, such as first); send it first, or put its \
                     text in a user message"
                ),
            ));
        }
        Ok(text)
    }
}

fn message(role: &str, content: &str) -> Message {
    Message::new(role, content)
}

/// llama.cpp's fallback for a template without a system turn: each run of system messages (their
/// texts joined by a line break) goes at the head of the next user message, a line break before
/// the user's text; with no user message next, it becomes a user message of its own.
fn fold_system(messages: &[Message]) -> Vec<Message> {
    let mut out = Vec::with_capacity(messages.len());
    let mut pending = String::new();
    for m in messages {
        if m.role == "system" {
            if !pending.is_empty() && !m.content.is_empty() {
                pending.push('\n');
            }
            pending.push_str(&m.content);
            continue;
        }
        let mut m = m.clone();
        if !pending.is_empty() {
            let system = std::mem::take(&mut pending);
            if m.role == "user" {
                m.content = if m.content.is_empty() { system } else { format!("{system}\n{}", m.content) };
            } else {
                out.push(message("user", &system));
            }
        }
        out.push(m);
    }
    if !pending.is_empty() {
        out.push(message("user", &pending));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(source: &str) -> ChatPrompt {
        ChatPrompt::new(ChatTemplate::new(source.into(), "<s>".into(), "</s>".into()).unwrap())
    }

    /// ChatML, as SmolLM2's and Qwen's: every role rendered where it stands.
    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    /// Old Mistral-style: user and assistant alternate, anything else raises.
    const ALTERNATING: &str = "{{ bos_token }}{% for m in messages %}\
        {% if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}\
        {% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}\
        {% else %}{{ raise_exception('only user and assistant roles') }}{% endif %}{% endfor %}";

    /// A template that renders user and assistant turns and says nothing of the others.
    const SILENT: &str = "{% for m in messages %}{% if m.role == 'user' %}<u>{{ m.content }}</u>\
        {% elif m.role == 'assistant' %}<a>{{ m.content }}</a>{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}";

    /// A system turn only as the first message, as Llama 2's and Gemma 3's templates have it.
    const SYSTEM_FIRST: &str = "{% if messages[0].role == 'system' %}<sys>{{ messages[0].content }}</sys>{% endif %}\
        {% for m in messages %}{% if m.role == 'user' %}<u>{{ m.content }}</u>{% elif m.role == 'assistant' %}<a>{{ m.content }}</a>\
        {% endif %}{% endfor %}<a>";

    fn chat(turns: &[(&str, &str)]) -> Vec<Message> {
        turns.iter().map(|(r, c)| message(r, c)).collect()
    }

    #[test]
    fn a_template_with_a_system_turn_renders_it_where_it_stands() {
        let p = prompt(CHATML);
        assert!(p.renders_system());
        let text = p.render(&chat(&[("system", "Be brief."), ("user", "Hi")])).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn a_template_without_one_gets_the_system_text_at_the_head_of_the_next_user_message() {
        for source in [ALTERNATING, SILENT] {
            let p = prompt(source);
            assert!(!p.renders_system(), "{source}");
            let text = p.render(&chat(&[("system", "Be brief."), ("system", "Use French."), ("user", "Hi")])).unwrap();
            assert!(text.contains("Be brief.\nUse French.\nHi"), "{text}");
        }
        let p = prompt(ALTERNATING);
        let text = p.render(&chat(&[("system", "Be brief."), ("user", "Hi")])).unwrap();
        assert_eq!(text, "<s>[INST] Be brief.\nHi [/INST]");
        // A system message after an assistant turn goes into the user message that follows it.
        let text =
            p.render(&chat(&[("user", "Hi"), ("assistant", "Hello"), ("system", "Be brief."), ("user", "Why?")]));
        assert_eq!(text.unwrap(), "<s>[INST] Hi [/INST]Hello</s>[INST] Be brief.\nWhy? [/INST]");
        // Without a user message after it, it is one.
        let folded = fold_system(&chat(&[("user", "Hi"), ("system", "Be brief.")]));
        assert_eq!(folded, chat(&[("user", "Hi"), ("user", "Be brief.")]));
        // The template's own refusals still name the messages.
        let e = p.render(&chat(&[("assistant", "Hello")])).unwrap_err();
        assert_eq!(e.param, "messages");
        assert!(
            e.message.starts_with(
                "this model's chat template cannot render these messages: invalid operation: roles must alternate"
            ),
            "{e}"
        );
    }

    #[test]
    fn a_system_message_the_template_leaves_out_is_refused_by_name() {
        let p = prompt(SYSTEM_FIRST);
        assert!(p.renders_system(), "the probe sends it first");
        assert!(p.render(&chat(&[("system", "Be brief."), ("user", "Hi")])).unwrap().contains("<sys>Be brief.</sys>"));
        let e = p.render(&chat(&[("user", "Hi"), ("system", "Be brief."), ("user", "Why?")])).unwrap_err();
        assert_eq!(e.param, "messages[1]");
        assert!(e.message.contains("leaves the system message messages[1] out of the prompt"), "{e}");
        // An empty system message has nothing to lose.
        assert!(p.render(&chat(&[("user", "Hi"), ("system", " ")])).is_ok());
    }

    fn fixture(name: &str, bos: &str, eos: &str) -> ChatPrompt {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates");
        let source = std::fs::read_to_string(dir.join(name)).unwrap();
        ChatPrompt::new(ChatTemplate::new(source, bos.into(), eos.into()).unwrap())
    }

    /// A round trip: the model's own call text parsed into a call, then written back with the
    /// tool's result through the model's real template (or ember's default for one without a
    /// tools section), shows the tools and the call as the model writes it.
    #[test]
    fn tools_and_calls_round_trip_through_each_models_template() {
        use crate::tools::{parse, Tools};
        let tools = Tools::read(Some(&serde_json::json!([{"type": "function", "function": {
            "name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])))
        .unwrap();
        let cases = [
            (
                "qwen2.5.jinja",
                "",
                "<|im_end|>",
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            ),
            (
                "qwen3.jinja",
                "",
                "<|im_end|>",
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            ),
            (
                "llama3.1.jinja",
                "<|begin_of_text|>",
                "<|eot_id|>",
                "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
            ),
            (
                "mistral-nemo.jinja",
                "<s>",
                "</s>",
                "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
            ),
            (
                "smollm2.jinja",
                "",
                "<|im_end|>",
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            ),
        ];
        for (name, bos, eos, output) in cases {
            let p = fixture(name, bos, eos);
            let ask = [message("user", "Weather in Paris?")];
            let prompt = p.render_with_tools(&ask, &tools).unwrap();
            assert!(
                prompt.contains("\"name\": \"get_weather\"") && prompt.contains("Weather of a city"),
                "{name}: {prompt}"
            );
            let parsed = parse(p.tool_format(), output);
            assert_eq!(parsed.content, "", "{name}");
            assert_eq!(parsed.calls.len(), 1, "{name}: {output}");
            let id = parsed.calls[0].id.clone();
            let conversation = [
                message("user", "Weather in Paris?"),
                Message::calls("", parsed.calls),
                Message { name: Some("get_weather".into()), ..Message::tool_result(id.clone(), "21 C") },
                message("assistant", "It is 21 C."),
                message("user", "Thanks!"),
            ];
            let text = p.render_with_tools(&conversation, &tools).unwrap();
            let written = output.strip_suffix(']').map(|o| format!("{o}, \"id\": \"{id}\"}}]"));
            let written = if p.tool_format() == ToolFormat::Mistral {
                written.unwrap().replacen("}}, ", "}, ", 1)
            } else {
                output.into()
            };
            assert!(text.contains(&written), "{name}: the call as the model writes it, {written}, in\n{text}");
            assert!(
                text.contains("21 C") && text.contains("It is 21 C.") && text.contains("Thanks!"),
                "{name}: {text}"
            );
        }
        // The default: the tools at the end of the system message, results as a user message.
        let p = fixture("smollm2.jinja", "", "<|im_end|>");
        let calls = parse(ToolFormat::Default, cases[4].3).calls;
        let id = calls[0].id.clone();
        let conversation = [
            message("system", "Be brief."),
            message("user", "Weather in Paris?"),
            Message::calls("Let me look.", calls),
            Message::tool_result(&id, "21 C"),
            Message::tool_result(&id, "sunny"),
        ];
        let text = p.render_with_tools(&conversation, &tools).unwrap();
        assert!(text.starts_with("<|im_start|>system\nBe brief.\n\nYou can call functions"), "{text}");
        assert!(text.contains("<|im_start|>assistant\nLet me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"), "{text}");
        assert!(text.contains("<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), "{text}");
        assert!(p.roles().iter().any(|r| r == "tool"), "a tool message is written as a user message");
    }

    /// SmolLM3's official template (with `{% generation %}` tags) loads; it lists the tools
    /// itself (as `xml_tools`, each as Python writes a dict) and asks for Hermes calls, which
    /// parse; a tool's result comes back as a user turn.
    #[test]
    fn smollm3s_template_lists_the_tools_and_its_calls_parse() {
        use crate::tools::{parse, Tools};
        let tools = Tools::read(Some(&serde_json::json!([{"type": "function", "function": {
            "name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])))
        .unwrap();
        let p = fixture("smollm3.jinja", "", "<|im_end|>");
        assert_eq!(p.tool_format(), ToolFormat::Hermes);
        assert!(p.renders_system());
        let ask = [message("system", "Be brief."), message("user", "Weather in Paris?")];
        let prompt = p.render_with_tools(&ask, &tools).unwrap();
        assert!(prompt.contains("Be brief.\n\n### Tools\n"), "{prompt}");
        assert!(
            prompt.contains("'name': 'get_weather'") && prompt.contains("'description': 'Weather of a city'"),
            "{prompt}"
        );
        assert!(prompt.contains("within <tool_call></tool_call> XML tags"), "{prompt}");
        assert!(prompt.ends_with("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"), "{prompt}");
        let output = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let parsed = parse(p.tool_format(), output);
        assert_eq!((parsed.content.as_str(), parsed.calls.len()), ("", 1));
        assert_eq!(parsed.calls[0].arguments, serde_json::json!({"city": "Paris"}));
        let id = parsed.calls[0].id.clone();
        let conversation =
            [message("user", "Weather in Paris?"), Message::calls("", parsed.calls), Message::tool_result(id, "21 C")];
        let text = p.render_with_tools(&conversation, &tools).unwrap();
        assert!(text.ends_with("<|im_start|>user\n21 C<|im_end|>\n<|im_start|>assistant\n"), "{text}");
    }
}
