//! `ember chat`: a terminal chat through the checkpoint's chat template, as llama.cpp's and
//! Ollama's: a prompt marker, line editing and history (rustyline), answers streamed in colour,
//! Ctrl-C stops an answer and keeps the session, and commands to reset, set the system prompt and
//! save the conversation as fine-tuning data. When stdin is not a terminal it reads one message a
//! line and prints the answers alone, for scripts.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::tensor::Device;
use clap::Args;
use ember_data::finetune::{ChatTemplate, Message};
use ember_data::stream::TextStream;
use ember_data::tokenizer::Tokenizer;
use ember_generate::sample::{generate_batch_constrained, GenerateOptions, Sampler, SamplingConfig};
use ember_kernels::{EmberBackend, TrainBackend};
use ember_model::Decoder;
use ember_serve::sampling::ChatDefaults;
use rustyline::error::ReadlineError;
use rustyline::{Cmd, ConditionalEventHandler, Event, EventContext, EventHandler, KeyEvent, Movement, RepeatCount};

use crate::backend::{dispatch, DeviceSpec, Job};
use crate::commands::sample::{read_schema, JsonSchema};
use crate::commands::source::ModelSource;

/// The `--help` text on sampling defaults of `chat`, `sample` and `serve` (a test keeps its numbers
/// equal to [`ember_serve::sampling`]'s).
pub const SAMPLING_HELP: &str = "Chat sampling defaults (`ember chat`, `ember sample --chat`, and `ember serve` \
requests that leave temperature or top_p out): the model's generation_config.json when its checkpoint has \
one (`ember import` keeps it from a Hugging Face folder), else ember's: temperature 0.2, top-p 0.9, no top-k, \
no repetition penalty. A flag (or request field) replaces its one setting.";

#[derive(Args, Debug)]
#[command(after_help = SAMPLING_HELP)]
pub struct ChatArgs {
    /// A run directory (its latest checkpoint) or a checkpoint folder inside it, or `gguf:FILE` (run on its stored
    /// quantized weights) or `hf:DIR`, with a chat template.
    #[arg(long)]
    checkpoint: PathBuf,
    #[command(flatten)]
    kv_cache: super::KvCacheFlag,
    /// Softmax temperature; 0 is greedy [default: the chat defaults, below].
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Sample among the most likely tokens holding this much probability, in (0, 1] (1 keeps all)
    /// [default: the chat defaults].
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Sample among the K most likely tokens; 0 keeps all [default: the chat defaults].
    #[arg(long)]
    top_k: Option<usize>,
    /// New tokens per answer at most.
    #[arg(long, default_value_t = 512)]
    max_new_tokens: usize,
    /// An instruction placed before the conversation as a system message (`/system` changes it).
    #[arg(long)]
    system: Option<String>,
    /// The sampler's seed, for a session that replays [default: a new one each session, shown at
    /// the start].
    #[arg(long)]
    seed: Option<u64>,
    /// Hold every answer to the JSON schema in FILE (compact JSON, keys in the schema's order; a
    /// keyword the grammar engine cannot enforce is an error).
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
    /// cpu, wgpu[:N] or cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
}

/// Sampling flags a user may give (`None`: not given), laid over a model's defaults.
#[derive(Debug, Clone, Copy, Default)]
pub struct SamplingFlags {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// 0 keeps all tokens.
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
}

impl SamplingFlags {
    fn any(&self) -> bool {
        self.temperature.is_some() || self.top_p.is_some() || self.top_k.is_some() || self.repetition_penalty.is_some()
    }

    /// `config` (these flags over `defaults`) in words, and where it comes from.
    pub fn describe(&self, config: &SamplingConfig, defaults: &ChatDefaults) -> String {
        if self.any() {
            format!("{} (the flags over {})", ember_serve::sampling::describe(config), defaults.describe())
        } else {
            defaults.describe()
        }
    }
    /// `defaults` with each given flag in place of its setting, checked; an error names the flag.
    pub fn over(&self, defaults: &SamplingConfig) -> anyhow::Result<SamplingConfig> {
        let mut config = defaults.clone();
        if let Some(t) = self.temperature {
            config.temperature = t;
        }
        if let Some(p) = self.top_p {
            // 1 keeps every token: the same as no top-p (and lets a user turn a default's off).
            config.top_p = if p == 1.0 { None } else { Some(p) };
        }
        if let Some(k) = self.top_k {
            config.top_k = (k > 0).then_some(k);
        }
        if let Some(r) = self.repetition_penalty {
            config.repetition_penalty = r;
        }
        config.validate().map_err(|e| {
            let flag = match e.setting() {
                Some("temperature") => format!("--temperature {}", self.temperature.unwrap_or(f32::NAN)),
                Some("top_k") => format!("--top-k {}", self.top_k.unwrap_or(0)),
                Some("top_p") => format!("--top-p {}", self.top_p.unwrap_or(f32::NAN)),
                Some("repetition_penalty") => {
                    format!("--repetition-penalty {}", self.repetition_penalty.unwrap_or(f32::NAN))
                }
                _ => return anyhow::Error::from(e),
            };
            anyhow::anyhow!("{flag}: {e}")
        })?;
        Ok(config)
    }
}

pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    let flags =
        SamplingFlags { temperature: args.temperature, top_p: args.top_p, top_k: args.top_k, repetition_penalty: None };
    // The flags are checked before a checkpoint is opened.
    flags.over(&ChatDefaults::built_in().sampling)?;
    // The schema file is read (its errors named) before a checkpoint is opened, compiled after.
    let schema = args.json_schema.as_deref().map(read_schema).transpose()?;
    let checkpoint = ModelSource::open(&args.checkpoint)?;
    let schema = match (&args.json_schema, schema) {
        (Some(file), Some(schema)) => Some(JsonSchema::new(file, schema, &checkpoint)?),
        _ => None,
    };
    let template = ChatTemplate::from_dir(&checkpoint.dir)?.with_context(|| {
        format!("{} has no chat template (tokenizer_config.json or chat_template.jinja)", checkpoint.dir.display())
    })?;
    let defaults = ChatDefaults::for_checkpoint(&checkpoint.dir)?;
    let sampling = flags.over(&defaults.sampling)?;
    let described = flags.describe(&sampling, &defaults);
    let device = args.device;
    dispatch(device, false, ChatJob { args, checkpoint, template, sampling, described, schema })
}

struct ChatJob {
    args: ChatArgs,
    checkpoint: ModelSource,
    template: ChatTemplate,
    sampling: SamplingConfig,
    /// The sampling in words, for the greeting.
    described: String,
    /// `--json-schema`: what every answer is held to.
    schema: Option<JsonSchema>,
}

/// The conversation: a system prompt and the turns since the last `/reset`.
struct Conversation {
    system: Option<String>,
    turns: Vec<Message>,
}

impl Conversation {
    fn messages(&self) -> Vec<Message> {
        let system = self.system.iter().map(|s| Message::new("system", s.clone()));
        system.chain(self.turns.iter().cloned()).collect()
    }

    /// Appends the conversation to `path` as one line of the fine-tuning chat format,
    /// `{"messages": [{"role": …, "content": …}, …]}`; the number of messages written.
    fn save(&self, path: &Path) -> anyhow::Result<usize> {
        let messages: Vec<serde_json::Value> =
            self.messages().iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
        let mut line = serde_json::to_string(&serde_json::json!({ "messages": messages }))?;
        line.push('\n');
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        file.write_all(line.as_bytes()).with_context(|| format!("writing {}", path.display()))?;
        Ok(messages.len())
    }
}

/// How the chat looks: colours only on a terminal and without `NO_COLOR` (https://no-color.org).
struct Style {
    colour: bool,
}

impl Style {
    fn paint(&self, code: &str, text: &str) -> String {
        if self.colour {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }
    /// The user's prompt marker.
    fn prompt(&self) -> String {
        self.paint("1;32", "> ")
    }
    /// The start and end of an answer: cyan, so that the model's words differ from the user's.
    fn answer_start(&self) -> &'static str {
        if self.colour {
            "\x1b[36m"
        } else {
            ""
        }
    }
    fn answer_end(&self) -> &'static str {
        if self.colour {
            "\x1b[0m"
        } else {
            ""
        }
    }
    /// A note from ember (not the model's words), dimmed and in brackets.
    fn note(&self, text: &str) -> String {
        self.paint("2", &format!("({text})"))
    }
}

const HELP: &str = "\
/reset          clear the conversation (the system prompt stays)
/system TEXT    set the system prompt (/system alone shows it; /system - removes it)
/save FILE      append the conversation to FILE as one JSONL line, {\"messages\": [...]}, for fine-tuning
/help           this list
/exit           end the session (also Ctrl-D, or Ctrl-C at an empty prompt)
Ctrl-C during an answer stops it; up and down arrows recall earlier lines; start a message with // to send
one that begins with /.";

/// What one input line asks for.
#[derive(Debug, PartialEq)]
enum Input<'a> {
    Nothing,
    Message(&'a str),
    Reset,
    System(Option<&'a str>),
    Save(Option<&'a str>),
    Help,
    Exit,
    Unknown(&'a str),
}

fn parse(line: &str) -> Input<'_> {
    let line = line.trim();
    if line.is_empty() {
        return Input::Nothing;
    }
    if line.starts_with("//") {
        // The first '/' is one byte.
        return Input::Message(&line[1..]);
    }
    let Some(command) = line.strip_prefix('/') else {
        return Input::Message(line);
    };
    let (name, rest) = command.split_once(char::is_whitespace).unwrap_or((command, ""));
    let rest = rest.trim();
    let arg = (!rest.is_empty()).then_some(rest);
    match name {
        "reset" | "clear" => Input::Reset,
        "system" => Input::System(arg),
        "save" => Input::Save(arg),
        "help" | "?" => Input::Help,
        "exit" | "quit" | "bye" => Input::Exit,
        _ => Input::Unknown(name),
    }
}

/// Ctrl-C at the prompt: on a line with text it clears the line (as a shell does); on an empty
/// line it ends the session.
struct CtrlC;

impl ConditionalEventHandler for CtrlC {
    fn handle(&self, _: &Event, _: RepeatCount, _: bool, ctx: &EventContext) -> Option<Cmd> {
        Some(if ctx.line().is_empty() { Cmd::Interrupt } else { Cmd::Kill(Movement::WholeLine) })
    }
}

/// While an answer is written to a terminal, the keys typed are not echoed: a Ctrl-C would print
/// `^C` into the answer, and a line typed ahead would land in the middle of it. The line is still
/// read at the next prompt. The terminal's settings come back when this is dropped.
struct QuietKeys(Option<libc::termios>);

impl QuietKeys {
    fn on_stdin() -> Self {
        // SAFETY: tcgetattr and tcsetattr read and write the struct given; fd 0 is stdin.
        unsafe {
            let mut settings: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(0, &mut settings) != 0 {
                return Self(None);
            }
            let saved = settings;
            settings.c_lflag &= !(libc::ECHO | libc::ECHOCTL);
            if libc::tcsetattr(0, libc::TCSANOW, &settings) != 0 {
                return Self(None);
            }
            Self(Some(saved))
        }
    }
}

impl Drop for QuietKeys {
    fn drop(&mut self) {
        if let Some(saved) = &self.0 {
            // SAFETY: as above, with the settings read before.
            unsafe { libc::tcsetattr(0, libc::TCSANOW, saved) };
        }
    }
}

/// Where the lines come from: a line editor on a terminal, plain lines otherwise.
enum Lines {
    Editor(Box<rustyline::DefaultEditor>),
    Piped(std::io::Lines<std::io::StdinLock<'static>>),
}

impl Lines {
    /// The next line; `None` at the end of the session.
    fn next(&mut self, prompt: &str) -> anyhow::Result<Option<String>> {
        match self {
            Lines::Editor(editor) => match editor.readline(prompt) {
                Ok(line) => {
                    if !line.trim().is_empty() {
                        editor.add_history_entry(line.as_str())?;
                    }
                    Ok(Some(line))
                }
                Err(ReadlineError::Interrupted | ReadlineError::Eof) => Ok(None),
                Err(e) => Err(e).context("reading the terminal"),
            },
            Lines::Piped(lines) => Ok(lines.next().transpose().context("reading stdin")?),
        }
    }
}

impl Job for ChatJob {
    type Output = ();
    fn run<B: TrainBackend>(self, device: Device<B>, _name: &str) -> anyhow::Result<()> {
        let compute = self.args.kv_cache.apply(crate::env::compute());
        let model = self.checkpoint.decoder::<B::InnerBackend>(&device)?.with_compute(compute);
        let seed = self.args.seed.unwrap_or_else(|| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            now.map_or(0, |d| d.as_nanos() as u64) ^ u64::from(std::process::id())
        });
        let interactive = std::io::stdin().is_terminal();
        let style = Style {
            colour: interactive
                && std::io::stdout().is_terminal()
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        };
        let mut session = Session {
            model: &model,
            tokenizer: &self.checkpoint.tokenizer,
            template: &self.template,
            max_new_tokens: self.args.max_new_tokens,
            has_system: self.template.roles().iter().any(|r| r == "system"),
            chat: Conversation { system: self.args.system.clone(), turns: Vec::new() },
            sampler: Sampler::new(self.sampling.clone(), seed)?,
            schema: self.schema.as_ref(),
            style,
            interactive,
            out: std::io::stdout(),
        };
        let dir = self.checkpoint.dir.display();
        let mut lines = if interactive {
            let config = rustyline::Config::builder().max_history_size(1000)?.auto_add_history(false).build();
            let mut editor = rustyline::DefaultEditor::with_config(config)?;
            editor.bind_sequence(KeyEvent::ctrl('C'), EventHandler::Conditional(Box::new(CtrlC)));
            // Ctrl-C while an answer is written stops it (the terminal is not in raw mode then).
            crate::signals::catch_interrupt().context("asking for SIGINT")?;
            session.note(&format!(
                "chatting with {dir}; sampling: {}, seed {seed}. /help lists the commands; Ctrl-C stops an answer, \
                 Ctrl-D ends",
                self.described
            ))?;
            Lines::Editor(Box::new(editor))
        } else {
            tracing::info!("chatting with {dir}: one message a line; sampling: {}, seed {seed}", self.described);
            Lines::Piped(std::io::stdin().lock().lines())
        };
        let marker = if interactive { session.style.prompt() } else { String::new() };
        while let Some(line) = lines.next(&marker)? {
            match session.command(parse(&line))? {
                Next::Answer(message) => session.answer(message)?,
                Next::Prompt => {}
                Next::End => break,
            }
        }
        if interactive {
            // The shell's prompt on a line of its own after Ctrl-D.
            writeln!(session.out)?;
        }
        Ok(())
    }
}

/// What follows a line.
enum Next {
    /// The model answers this message.
    Answer(String),
    /// The next line.
    Prompt,
    End,
}

/// A chat in progress: the model, the conversation and where it is shown.
struct Session<'a, M: EmberBackend> {
    model: &'a Decoder<M>,
    tokenizer: &'a Tokenizer,
    template: &'a ChatTemplate,
    max_new_tokens: usize,
    /// Whether the template knows a system role.
    has_system: bool,
    chat: Conversation,
    sampler: Sampler,
    /// `--json-schema`: what every answer is held to.
    schema: Option<&'a JsonSchema>,
    style: Style,
    interactive: bool,
    out: std::io::Stdout,
}

impl<M: EmberBackend> Session<'_, M> {
    fn note(&mut self, text: &str) -> std::io::Result<()> {
        writeln!(self.out, "{}", self.style.note(text))
    }

    /// Carries out a command line (with a note of what it did), or passes a message on to be answered.
    fn command(&mut self, input: Input) -> anyhow::Result<Next> {
        let note = match input {
            Input::Nothing => return Ok(Next::Prompt),
            Input::Exit => return Ok(Next::End),
            Input::Message(m) => return Ok(Next::Answer(m.to_string())),
            Input::Help => {
                writeln!(self.out, "{HELP}")?;
                return Ok(Next::Prompt);
            }
            Input::Reset => {
                self.chat.turns.clear();
                "conversation cleared".to_string()
            }
            Input::System(None) => {
                self.chat.system.as_deref().map_or("no system prompt".into(), |s| format!("system: {s}"))
            }
            Input::System(Some("-")) => {
                self.chat.system = None;
                "system prompt removed".to_string()
            }
            Input::System(Some(_)) if !self.has_system => {
                "this model's chat template has no system role; the system prompt is unchanged".to_string()
            }
            Input::System(Some(text)) => {
                self.chat.system = Some(text.to_string());
                "system prompt set; it applies from the next answer".to_string()
            }
            Input::Save(None) => "/save FILE: name the file to append the conversation to".to_string(),
            Input::Save(Some(_)) if self.chat.turns.is_empty() => "nothing to save yet".to_string(),
            Input::Save(Some(file)) => match self.chat.save(Path::new(file)) {
                Ok(n) => format!("appended the conversation ({n} messages) to {file}"),
                Err(e) => format!("not saved: {e:#}"),
            },
            Input::Unknown(name) => {
                format!("unknown command /{name}: /help lists them (// sends a message beginning with /)")
            }
        };
        self.note(&note)?;
        Ok(Next::Prompt)
    }

    /// The conversation with `message` added, as the model's prompt; a note instead when it cannot
    /// be one (the message is then left out).
    fn prompt(&mut self, message: String) -> anyhow::Result<Option<Vec<u32>>> {
        self.chat.turns.push(Message::new("user", message));
        let rendered = self.template.render(&self.chat.messages(), true).map_err(anyhow::Error::from);
        let context = self.model.config().max_seq_len;
        let problem = match rendered.and_then(|text| Ok(self.tokenizer.encode_prompt(&text)?)) {
            Ok(prompt) if prompt.len() < context => return Ok(Some(prompt)),
            Ok(_) => format!("the conversation fills the model's context of {context} tokens: /reset"),
            Err(e) => format!("the chat template cannot render this conversation: {e:#}"),
        };
        self.chat.turns.pop();
        self.note(&problem)?;
        Ok(None)
    }

    /// Streams the model's answer to `message` and adds both to the conversation. Ctrl-C stops the
    /// answer where it is (what was written stays in the conversation).
    fn answer(&mut self, message: String) -> anyhow::Result<()> {
        let Some(prompt) = self.prompt(message)? else { return Ok(()) };
        let ends = self.tokenizer.end_ids();
        let room = self.model.config().max_seq_len - prompt.len();
        let options = GenerateOptions {
            max_new_tokens: self.max_new_tokens.min(room),
            stop_tokens: ends.clone(),
            block_size: 64,
        };
        let mut constraint = [self.schema.map(JsonSchema::constraint).transpose()?];
        let mut text = TextStream::new(self.tokenizer, &prompt, Vec::new(), &ends);
        let mut answer = String::new();
        // A Ctrl-C pressed at the prompt or between answers is not this answer's.
        crate::signals::take_interrupt();
        let quiet = self.interactive.then(QuietKeys::on_stdin);
        let out = &mut self.out;
        write!(out, "{}", self.style.answer_start())?;
        let mut write_err = None;
        generate_batch_constrained(
            self.model,
            std::slice::from_ref(&prompt),
            &options,
            std::slice::from_mut(&mut self.sampler),
            &mut constraint,
            |_, id| {
                let (piece, stopped) = text.push(id);
                answer.push_str(&piece);
                if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                    write_err = Some(e);
                    return false;
                }
                !stopped && !crate::signals::interrupted()
            },
        )?;
        if let Some(e) = write_err {
            return Err(anyhow::Error::from(e).context("writing the answer"));
        }
        let rest = text.finish();
        answer.push_str(&rest);
        writeln!(out, "{rest}{}", self.style.answer_end())?;
        drop(quiet);
        if crate::signals::take_interrupt() {
            self.note("stopped")?;
        }
        if let Some(e) = text.take_error() {
            return Err(anyhow::Error::from(e).context("decoding the answer"));
        }
        self.chat.turns.push(Message::new("assistant", answer));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_messages_or_commands() {
        assert_eq!(parse("  "), Input::Nothing);
        assert_eq!(parse(" What is 2 + 2? "), Input::Message("What is 2 + 2?"));
        assert_eq!(parse("/reset"), Input::Reset);
        assert_eq!(parse("/system  Answer in French. "), Input::System(Some("Answer in French.")));
        assert_eq!(parse("/system"), Input::System(None));
        assert_eq!(parse("/save chat.jsonl"), Input::Save(Some("chat.jsonl")));
        assert_eq!(parse("/save"), Input::Save(None));
        assert_eq!(parse("/bye"), Input::Exit);
        assert_eq!(parse("/usr/bin"), Input::Unknown("usr/bin"));
        assert_eq!(parse("//usr/bin is a folder"), Input::Message("/usr/bin is a folder"));
    }

    #[test]
    fn flags_replace_their_setting_and_name_themselves_when_wrong() {
        let defaults = ChatDefaults::built_in().sampling;
        let none = SamplingFlags::default();
        assert_eq!(none.over(&defaults).unwrap(), defaults);
        let greedy = SamplingFlags { temperature: Some(0.0), top_p: Some(1.0), top_k: Some(0), ..none };
        let s = greedy.over(&defaults).unwrap();
        assert_eq!((s.temperature, s.top_p, s.top_k), (0.0, None, None));
        let e = SamplingFlags { top_p: Some(1.5), ..none }.over(&defaults).unwrap_err().to_string();
        assert!(e.starts_with("--top-p 1.5:"), "{e}");
        let e = SamplingFlags { temperature: Some(-1.0), ..none }.over(&defaults).unwrap_err().to_string();
        assert!(e.starts_with("--temperature -1:"), "{e}");
    }

    #[test]
    fn the_help_states_the_defaults_in_use() {
        let (t, p) = (ember_serve::sampling::CHAT_TEMPERATURE, ember_serve::sampling::CHAT_TOP_P);
        assert!(SAMPLING_HELP.contains(&format!("temperature {t}, top-p {p}")), "{SAMPLING_HELP}");
    }
}
