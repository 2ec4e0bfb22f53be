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

use ember_data::finetune::{ChatTemplate, Message};

use crate::api::Invalid;

/// A model's chat template and whether it renders system messages.
pub struct ChatPrompt {
    template: ChatTemplate,
    renders_system: bool,
}

/// The text of the probe's system message: nothing a template would write by itself.
const PROBE: &str = "<<ember: does this template render a system message?>>";

impl ChatPrompt {
    /// Probes `template` for a system turn (see the module's documentation).
    pub fn new(template: ChatTemplate) -> Self {
        let probe = [message("system", PROBE), message("user", "Hello")];
        let renders_system = template.render(&probe, true).is_ok_and(|text| text.contains(PROBE));
        Self { template, renders_system }
    }

    /// Whether the template renders a system message itself; when not, system messages are put
    /// into the next user message.
    pub fn renders_system(&self) -> bool {
        self.renders_system
    }

    /// The roles a message may have (the template's, see `ChatTemplate::roles`).
    pub fn roles(&self) -> &[String] {
        self.template.roles()
    }

    /// The prompt for `messages`, ending with the assistant's turn opened. Refused (param
    /// `messages`, or the message) when the template raises on them, or leaves a system message
    /// out.
    pub fn render(&self, messages: &[Message]) -> Result<String, Invalid> {
        let text = if self.renders_system {
            self.template.render(messages, true)
        } else {
            self.template.render(&fold_system(messages), true)
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
    Message { role: role.into(), content: content.into() }
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
}
