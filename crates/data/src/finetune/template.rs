//! A Hugging Face chat template (Jinja) compiled once and rendered with minijinja, with
//! transformers' additions (`jinja.rs`) and Python's `json.dumps` as `tojson`.

use std::path::Path;

use serde_json::Value;

use super::{jinja, Message, ToolText, ROLES};
use crate::error::{DataError, Result};

/// A Hugging Face chat template (Jinja), rendered with minijinja and Python-compatible methods.
pub struct ChatTemplate {
    /// The environment holding the compiled template, as `chat`.
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
    roles: Vec<String>,
    source: String,
    /// How it gets a conversation's tools, calls and their results (probed once, in `new`).
    tool_text: ToolText,
}

impl ChatTemplate {
    /// The template of a tokenizer folder: `chat_template.jinja`, or `chat_template` in
    /// `tokenizer_config.json`. `None` when the folder has neither.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(t) => {
                serde_json::from_str(&t).map_err(|e| DataError::Tokenizer(format!("{}: {e}", config_path.display())))?
            }
            Err(_) => Value::Null,
        };
        let token = |k: &str| match config.get(k) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
            _ => String::new(),
        };
        let jinja = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja) {
            Ok(s) => s,
            Err(_) => match config.get("chat_template").and_then(Value::as_str) {
                Some(s) => s.to_string(),
                None => return Ok(None),
            },
        };
        Self::new(source, token("bos_token"), token("eos_token")).map(Some)
    }

    /// Compiles `source` (once; a syntax error is reported here) with the BOS and EOS strings that
    /// templates read as `bos_token` and `eos_token`, in an environment that has what
    /// transformers adds to Jinja: `tojson` as Python writes JSON, `raise_exception`,
    /// `strftime_now`, `string` as Python's `str()` and the `{% generation %}` block (which only
    /// marks the assistant's text; it renders its body).
    pub fn new(source: String, bos: String, eos: String) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_filter("string", |v: &minijinja::Value| jinja::py_string(v));
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", jinja::strftime_now);
        let roles = ROLES
            .iter()
            .filter(|&&r| r != "tool" || source.contains("'tool'") || source.contains("\"tool\""))
            .map(|r| r.to_string())
            .collect();
        env.add_template_owned("chat", jinja::without_generation_tags(&source)).map_err(template_error)?;
        let mut template = Self { env, bos, eos, roles, source, tool_text: ToolText::InTemplate };
        template.tool_text = ToolText::of(&template);
        Ok(template)
    }

    /// How the template gets a conversation's tools, calls and their results: through it, or
    /// written as text where it cannot write them (see [`tool_text`]).
    pub fn tool_text(&self) -> ToolText {
        self.tool_text
    }

    /// `messages` and `tools` as [`ChatTemplate::render_conversation`] gives them to the template:
    /// what it cannot write written as text (see [`tool_text`]). For a caller that reworks the
    /// messages further before [`ChatTemplate::render_with_tools`].
    pub fn with_tools_written<'a>(
        &self,
        messages: &'a [Message],
        tools: &'a [Value],
    ) -> (std::borrow::Cow<'a, [Message]>, &'a [Value]) {
        self.tool_text.write(messages, tools)
    }

    /// A conversation with the functions the assistant may call, rendered as both the server
    /// and fine-tuning render it: through the template where it writes tools, calls and their
    /// results, and as text where it cannot (see [`tool_text`]).
    pub fn render_conversation(
        &self,
        messages: &[Message],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let (messages, tools) = self.with_tools_written(messages, tools);
        self.render_with_tools(&messages, tools, add_generation_prompt)
    }

    /// The template's Jinja source (what a server reads to know its tool-call format).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The roles a message may have: system, user and assistant, and `tool` where the template
    /// names it.
    pub fn roles(&self) -> &[String] {
        &self.roles
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the functions the assistant may call (OpenAI tool objects
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`) as the
    /// template's `tools`, as `apply_chat_template(tools=...)` passes them; none leaves `tools`
    /// undefined, as there. They are `xml_tools` too, the name SmolLM3's template reads.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let err = template_error;
        let tools = (!tools.is_empty()).then_some(tools);
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        };
        let ctx = match tools {
            Some(tools) => minijinja::context! { tools => tools, xml_tools => tools, ..ctx },
            None => ctx,
        };
        self.env.get_template("chat").map_err(err)?.render(ctx).map_err(err)
    }
}

/// Jinja's `tojson` as Hugging Face's templates get it (transformers replaces Jinja's own):
/// Python's `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`: `", "` and `": "` between items, keys in their order, and `<`, `>`, `&`
/// and `'` as they are (minijinja's own escapes them for HTML, which no prompt wants).
fn tojson(
    value: &minijinja::Value,
    indent: Option<minijinja::Value>,
    args: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent = match indent.or(args.get::<Option<minijinja::Value>>("indent")?) {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let separators: Option<Vec<String>> = args.get("separators")?;
    let sort_keys = args.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = args.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    args.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            let why = "tojson: separators must be two strings (item, key)";
            return Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, why));
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let mut out = String::new();
    PyJson { indent, item, key, sort_keys, ensure_ascii }.write(&mut out, value, 0)?;
    Ok(minijinja::Value::from_safe_string(out))
}

/// The settings of one `tojson` call.
struct PyJson {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(&self, out: &mut String, v: &minijinja::Value, depth: usize) -> std::result::Result<(), minijinja::Error> {
        use minijinja::value::ValueKind;
        match v.kind() {
            ValueKind::Map => {
                let mut keys: Vec<minijinja::Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                let items = keys.into_iter().map(|k| {
                    let value = v.get_item(&k).unwrap_or_default();
                    (k, value)
                });
                self.container(out, '{', '}', items, depth, |out, (k, value)| {
                    self.string(out, &k.to_string());
                    out.push_str(&self.key);
                    self.write(out, &value, depth + 1)
                })
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<minijinja::Value> = v.try_iter()?.collect();
                self.container(out, '[', ']', items, depth, |out, item| self.write(out, &item, depth + 1))
            }
            ValueKind::String => {
                self.string(out, v.as_str().unwrap_or_default());
                Ok(())
            }
            ValueKind::Undefined | ValueKind::None => {
                out.push_str("null");
                Ok(())
            }
            // Numbers and booleans as serde writes them (`1.5`, `true`).
            _ => {
                let text = serde_json::to_string(v).map_err(|e| {
                    minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, "tojson: cannot write this value")
                        .with_source(e)
                })?;
                out.push_str(&text);
                Ok(())
            }
        }
    }

    /// `open`, the items each written by `each` (one per line, indented, with `indent`), `close`.
    fn container<T>(
        &self,
        out: &mut String,
        open: char,
        close: char,
        items: impl IntoIterator<Item = T>,
        depth: usize,
        mut each: impl FnMut(&mut String, T) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        let mut any = false;
        for (i, item) in items.into_iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item);
            }
            if let Some(n) = self.indent {
                out.push('\n');
                out.push_str(&" ".repeat(n * (depth + 1)));
            }
            each(out, item)?;
            any = true;
        }
        if let (Some(n), true) = (self.indent, any) {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
        out.push(close);
        Ok(())
    }

    /// A JSON string as Python writes it (serde_json escapes the same characters).
    fn string(&self, out: &mut String, s: &str) {
        let quoted = serde_json::to_string(s).unwrap_or_default();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
}

fn template_error(e: minijinja::Error) -> DataError {
    DataError::Tokenizer(format!("chat template: {e:#}"))
}
