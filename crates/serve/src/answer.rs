//! One answer's choices: each choice is a request of the engine, and its events become text (cut
//! at stop strings), tool calls and log-probabilities, collected whole or sent as stream deltas.
//! Choices of one answer run side by side in the engine (they share the prompt's cache blocks).

use std::sync::Arc;

use ember_data::stream::TextStream;
use ember_data::Tokenizer;
use ember_generate::constraint::NOTHING_ALLOWED;
use ember_generate::engine::{Event, Finish, RequestId};
use ember_generate::logprobs::TokenLogprobs;
use ember_grammar::Grammars;
use tokio::sync::mpsc;

use crate::api::{CallOut, Choice, Delta, Kind, TokenLogprob, Usage};
use crate::tools::{ToolDelta, ToolFormat, ToolStream};

/// A choice on the engine.
pub(crate) struct Submitted {
    /// Its place in the answer's `choices`.
    pub index: usize,
    /// The prompt it continues (its place in the request's `prompt` list; 0 for a chat).
    pub prompt_index: usize,
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub events: mpsc::UnboundedReceiver<Event>,
}

/// What every choice of an answer shares.
#[derive(Clone)]
pub(crate) struct Shape {
    pub kind: Kind,
    pub stops: Vec<String>,
    pub ends: Vec<u32>,
    pub logprobs: bool,
    /// Completions' `echo`: the prompt's text first.
    pub echo: bool,
    /// Chat with tools: the answer's calls, written in this format, are told apart from its text.
    pub tools: Option<ToolFormat>,
    /// `parallel_tool_calls: false`: the first call only.
    pub single_call: bool,
    /// The tokens' own bytes (the vocabulary structured output uses), for log-probabilities.
    pub vocab: Option<Arc<Grammars>>,
}

/// Why an answer could not be finished, in words; `client`: the request itself asked for what
/// cannot be (a `logit_bias` that bans every token its grammar allows).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Failed {
    pub message: String,
    pub client: bool,
}

impl Failed {
    fn engine(error: Option<String>) -> Self {
        let message = error.unwrap_or_else(|| ENGINE_FAILED.to_string());
        let client = message == NOTHING_ALLOWED;
        Self { message, client }
    }
}

/// What the server says when the engine ended a request itself (a failed decoding step).
pub(crate) const ENGINE_FAILED: &str = "the model failed while decoding this request; it was ended";

/// One choice's text so far.
pub(crate) struct Follow<'a> {
    pub index: usize,
    tokenizer: &'a Tokenizer,
    shape: &'a Shape,
    text: TextStream<'a>,
    /// Log-probabilities of tokens whose text has not gone out yet.
    pending: Vec<TokenLogprob>,
    /// Bytes of the answer's tokens so far, the echoed prompt included (completions'
    /// `text_offset` of the next token).
    offset: usize,
    /// The prompt's text, to go out first (`echo`).
    echo: Option<String>,
    calls: Option<ToolStream>,
}

/// What an event gave: pieces, and the finish reason and token count once the choice is over
/// (with the calls the answer made, when it has tools).
pub(crate) struct Step {
    pub deltas: Vec<Delta>,
    pub done: Option<(&'static str, usize)>,
    pub calls: Vec<CallOut>,
}

impl<'a> Follow<'a> {
    pub fn new(tokenizer: &'a Tokenizer, shape: &'a Shape, index: usize, prompt: &[u32]) -> Self {
        let echo = shape.echo.then(|| tokenizer.decode(prompt).unwrap_or_default());
        Self {
            index,
            tokenizer,
            shape,
            text: TextStream::new(tokenizer, prompt, shape.stops.clone(), &shape.ends),
            pending: Vec::new(),
            offset: echo.as_ref().map_or(0, String::len),
            echo,
            calls: shape.tools.map(ToolStream::new),
        }
    }

    /// The choice's next event (`None`: the engine went away).
    pub fn on(&mut self, event: Option<Event>) -> Result<Step, Failed> {
        let mut deltas = Vec::new();
        if let Some(echo) = self.echo.take().filter(|e| !e.is_empty()) {
            deltas.push(Delta::Text(echo, self.shape.logprobs.then(Vec::new)));
        }
        let done = match event {
            Some(Event::Token { token, logprobs, .. }) => {
                // An end-of-text token is not part of the answer: no text, no log-probability.
                if let Some(lp) = logprobs.filter(|_| self.shape.logprobs && !self.shape.ends.contains(&token)) {
                    let lp = self.token_logprob(token, &lp);
                    self.offset += lp.bytes.len();
                    self.pending.push(lp);
                }
                let (piece, stopped) = self.text.push(token);
                self.text_out(piece, &mut deltas);
                // A stop string: the caller cancels the request on the engine.
                stopped.then_some(("stop", 0))
            }
            Some(Event::Done { finish: Finish::Failed, error, .. }) => return Err(Failed::engine(error)),
            Some(Event::Done { finish: Finish::Cancelled, .. }) | None => return Err(Failed::engine(None)),
            Some(Event::Done { finish, completion_tokens, .. }) => {
                let piece = self.text.finish();
                self.text_out(piece, &mut deltas);
                let reason = if finish == Finish::Length { "length" } else { "stop" };
                Some((reason, completion_tokens))
            }
        };
        let Some((reason, n)) = done else { return Ok(Step { deltas, done, calls: Vec::new() }) };
        let mut calls = Vec::new();
        if let Some(stream) = self.calls.take() {
            let (last, parsed) = stream.finish();
            self.tool_deltas(last, &mut deltas);
            let keep = if self.shape.single_call { 1 } else { usize::MAX };
            calls = (parsed.calls.iter().zip(&parsed.arguments))
                .take(keep)
                .map(|(c, written)| CallOut { id: c.id.clone(), name: c.name.clone(), arguments: written.clone() })
                .collect();
        }
        // Tokens whose text never went out (held back, or part of a call): their log-probabilities.
        if !self.pending.is_empty() {
            deltas.push(Delta::Text(String::new(), Some(std::mem::take(&mut self.pending))));
        }
        let reason = if !calls.is_empty() && reason == "stop" { "tool_calls" } else { reason };
        Ok(Step { deltas, done: Some((reason, n)), calls })
    }

    /// Hands out `piece` (through the tool-call reader when the answer has tools).
    fn text_out(&mut self, piece: String, deltas: &mut Vec<Delta>) {
        if piece.is_empty() {
            return;
        }
        match self.calls.as_mut() {
            Some(stream) => {
                let said = stream.push(&piece);
                self.tool_deltas(said, deltas);
            }
            None => self.content(piece, deltas),
        }
    }

    /// The answer's text `piece`, with the log-probabilities of the tokens that made it.
    fn content(&mut self, piece: String, deltas: &mut Vec<Delta>) {
        let lp = self.shape.logprobs.then(|| std::mem::take(&mut self.pending));
        deltas.push(Delta::Text(piece, lp));
    }

    fn tool_deltas(&mut self, said: Vec<ToolDelta>, deltas: &mut Vec<Delta>) {
        let single = self.shape.single_call;
        for d in said {
            match d {
                ToolDelta::Content(t) if !t.is_empty() => self.content(t, deltas),
                ToolDelta::Content(_) => {}
                ToolDelta::CallStart { index, .. } | ToolDelta::Arguments { index, .. } if single && index > 0 => {}
                ToolDelta::CallStart { index, id, name } => {
                    deltas.push(Delta::Call { index, id: Some(id), name: Some(name), arguments: String::new() })
                }
                ToolDelta::Arguments { index, text } => {
                    deltas.push(Delta::Call { index, id: None, name: None, arguments: text })
                }
            }
        }
    }

    /// Token `token`'s log-probability and its alternatives', each with the token's own bytes
    /// (a token may hold part of a character: its text then shows U+FFFD) and where it starts in
    /// the answer.
    fn token_logprob(&self, token: u32, lp: &TokenLogprobs) -> TokenLogprob {
        let spelled = |id: u32| -> (String, Vec<u8>) {
            match self.shape.vocab.as_ref().and_then(|v| v.token_bytes(id)) {
                Some(bytes) => (String::from_utf8_lossy(bytes).into_owned(), bytes.to_vec()),
                None => {
                    let text = self.tokenizer.decode(&[id]).unwrap_or_default();
                    let bytes = text.as_bytes().to_vec();
                    (text, bytes)
                }
            }
        };
        let (text, bytes) = spelled(token);
        let top = lp.top.iter().map(|&(id, l)| {
            let (s, b) = spelled(id);
            (s, b, l)
        });
        TokenLogprob { token: text, bytes, logprob: lp.logprob, top: top.collect(), text_offset: self.offset }
    }
}

/// The events of every choice on one receiver, each with its choice's place in `subs`; a choice
/// whose engine side goes away sends `None` once.
pub(crate) fn merge(subs: &mut [Submitted]) -> mpsc::UnboundedReceiver<(usize, Option<Event>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    for (k, sub) in subs.iter_mut().enumerate() {
        let tx = tx.clone();
        let (_, empty) = mpsc::unbounded_channel();
        let mut events = std::mem::replace(&mut sub.events, empty);
        tokio::spawn(async move {
            loop {
                let event = events.recv().await;
                let last = !matches!(event, Some(Event::Token { .. }));
                if tx.send((k, event)).is_err() || last {
                    return;
                }
            }
        });
    }
    rx
}

/// Collects every choice whole, in order of `index`, as their events come; a choice that ends at
/// a stop string is cancelled on the engine at once (`cancel`).
pub(crate) async fn collect(
    tokenizer: &Tokenizer,
    shape: &Shape,
    mut subs: Vec<Submitted>,
    cancel: impl Fn(RequestId),
) -> Result<(Vec<Choice>, Usage), Failed> {
    let prompt_tokens = distinct_prompt_tokens(&subs);
    let mut follows: Vec<Follow<'_>> = subs.iter().map(|s| Follow::new(tokenizer, shape, s.index, &s.prompt)).collect();
    let mut choices: Vec<Choice> = subs
        .iter()
        .map(|s| Choice {
            index: s.index,
            text: String::new(),
            tool_calls: Vec::new(),
            finish: "stop",
            logprobs: shape.logprobs.then(Vec::new),
        })
        .collect();
    let mut counts = vec![0usize; subs.len()];
    let (mut open, mut generated) = (subs.len(), 0);
    let mut merged = merge(&mut subs);
    while open > 0 {
        let Some((k, event)) = merged.recv().await else { return Err(Failed::engine(None)) };
        if counts[k] == usize::MAX {
            continue; // over already (a stop string): the rest of its events are dropped
        }
        if matches!(event, Some(Event::Token { .. })) {
            counts[k] += 1;
        }
        let step = follows[k].on(event)?;
        let choice = &mut choices[k];
        for d in step.deltas {
            if let Delta::Text(t, lp) = d {
                choice.text.push_str(&t);
                if let (Some(all), Some(lp)) = (choice.logprobs.as_mut(), lp) {
                    all.extend(lp);
                }
            }
        }
        if let Some((finish, n)) = step.done {
            cancel(subs[k].id);
            choice.tool_calls = step.calls;
            choice.finish = finish;
            generated += n.max(counts[k]);
            counts[k] = usize::MAX;
            open -= 1;
        }
    }
    Ok((choices, Usage::new(prompt_tokens, generated)))
}

/// Prompt tokens of an answer: each prompt of the request once (its `n` choices share it).
pub(crate) fn distinct_prompt_tokens(subs: &[Submitted]) -> usize {
    let mut seen: Vec<usize> = Vec::new();
    let mut total = 0;
    for s in subs {
        if !seen.contains(&s.prompt_index) {
            seen.push(s.prompt_index);
            total += s.prompt.len();
        }
    }
    total
}
