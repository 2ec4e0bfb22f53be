//! One answer's choices: each choice is a request of the engine, and its events become text (cut
//! at stop strings), tool calls and log-probabilities, collected whole or sent as stream deltas.
//! Choices of one answer run side by side in the engine (they share the prompt's cache blocks).

use ember_data::stream::TextStream;
use ember_data::Tokenizer;
use ember_generate::engine::{Event, Finish, RequestId};
use ember_generate::logprobs::TokenLogprobs;
use tokio::sync::mpsc;

use crate::api::{CallOut, Choice, Delta, Kind, TokenLogprob, Usage};
use crate::tools::{ToolDelta, ToolFormat, ToolStream};

/// A choice on the engine.
pub(crate) struct Submitted {
    /// Its place in the answer's `choices`.
    pub index: usize,
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
}

/// Why an answer could not be finished: the engine failed or went away, with its words.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Failed(pub String);

/// What the server says when the engine ended a request itself (a failed decoding step).
pub(crate) const ENGINE_FAILED: &str = "the model failed while decoding this request; it was ended";

/// One choice's text so far.
pub(crate) struct Follow<'a> {
    pub index: usize,
    tokenizer: &'a Tokenizer,
    text: TextStream<'a>,
    logprobs: bool,
    /// Log-probabilities of tokens whose text has not gone out yet.
    pending: Vec<TokenLogprob>,
    /// Bytes of text handed out (completions' `text_offset`).
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
    pub fn new(tokenizer: &'a Tokenizer, shape: &Shape, index: usize, prompt: &[u32]) -> Self {
        let echo = shape.echo.then(|| tokenizer.decode(prompt).unwrap_or_default());
        Self {
            index,
            tokenizer,
            text: TextStream::new(tokenizer, prompt, shape.stops.clone(), &shape.ends),
            logprobs: shape.logprobs,
            pending: Vec::new(),
            offset: 0,
            echo,
            calls: shape.tools.map(ToolStream::new),
        }
    }

    /// The choice's next event.
    pub fn on(&mut self, event: Option<Event>) -> Result<Step, Failed> {
        let mut deltas = Vec::new();
        if let Some(echo) = self.echo.take().filter(|e| !e.is_empty()) {
            self.offset += echo.len();
            deltas.push(Delta::Text(echo, self.logprobs.then(Vec::new)));
        }
        let done = match event {
            Some(Event::Token { token, logprobs, .. }) => {
                if let Some(lp) = logprobs.filter(|_| self.logprobs) {
                    self.pending.push(self.token_logprob(token, &lp));
                }
                let (piece, stopped) = self.text.push(token);
                self.text_out(piece, &mut deltas);
                // A stop string: the caller cancels the request on the engine.
                stopped.then_some(("stop", 0))
            }
            Some(Event::Done { finish: Finish::Failed, error, .. }) => {
                return Err(Failed(error.unwrap_or_else(|| ENGINE_FAILED.to_string())))
            }
            Some(Event::Done { finish: Finish::Cancelled, .. }) | None => return Err(Failed(ENGINE_FAILED.to_string())),
            Some(Event::Done { finish, completion_tokens, .. }) => {
                let piece = self.text.finish();
                self.text_out(piece, &mut deltas);
                let reason = if finish == Finish::Length { "length" } else { "stop" };
                Some((reason, completion_tokens))
            }
        };
        let mut calls = Vec::new();
        let over = match (done, &self.calls) {
            (Some(done), Some(_)) => self.calls.take().map(|stream| (done, stream)),
            _ => None,
        };
        if let Some(((reason, n), stream)) = over {
            let (last, parsed) = stream.finish();
            self.tool_deltas(last, &mut deltas);
            calls = parsed.calls.iter().map(|c| CallOut {
                id: c.id.clone(),
                name: c.name.clone(),
                arguments: c.arguments.to_string(),
            }).collect();
            let reason = if !calls.is_empty() && reason == "stop" { "tool_calls" } else { reason };
            if let Some(lp) = self.logprobs.then(|| std::mem::take(&mut self.pending)).filter(|lp| !lp.is_empty()) {
                deltas.push(Delta::Text(String::new(), Some(lp)));
            }
            return Ok(Step { deltas, done: Some((reason, n)), calls });
        }
        Ok(Step { deltas, done, calls })
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
        let base = self.offset;
        self.offset += piece.len();
        let lp = self.logprobs.then(|| {
            let mut lp = std::mem::take(&mut self.pending);
            lp.iter_mut().for_each(|t| t.text_offset = base);
            lp
        });
        deltas.push(Delta::Text(piece, lp));
    }

    fn tool_deltas(&mut self, said: Vec<ToolDelta>, deltas: &mut Vec<Delta>) {
        for d in said {
            match d {
                ToolDelta::Content(t) if !t.is_empty() => self.content(t, deltas),
                ToolDelta::Content(_) => {}
                ToolDelta::CallStart { index, id, name } => {
                    deltas.push(Delta::Call { index, id: Some(id), name: Some(name), arguments: String::new() })
                }
                ToolDelta::Arguments { index, text } => {
                    deltas.push(Delta::Call { index, id: None, name: None, arguments: text })
                }
            }
        }
    }

    fn token_logprob(&self, token: u32, lp: &TokenLogprobs) -> TokenLogprob {
        let text = |id: u32| {
            let t = self.tokenizer.decode(&[id]).unwrap_or_default();
            let bytes = t.as_bytes().to_vec();
            (t, bytes)
        };
        let (t, bytes) = text(token);
        let top = lp.top.iter().map(|&(id, l)| {
            let (s, b) = text(id);
            (s, b, l)
        });
        TokenLogprob { token: t, bytes, logprob: lp.logprob, top: top.collect(), text_offset: self.offset }
    }
}

/// Collects every choice whole, in order of `index`; the usage counts each prompt once.
/// A choice that ends at a stop string is cancelled on the engine at once (`cancel`).
pub(crate) async fn collect(
    tokenizer: &Tokenizer,
    shape: &Shape,
    subs: Vec<Submitted>,
    cancel: impl Fn(RequestId),
) -> Result<(Vec<Choice>, Usage), Failed> {
    let prompt_tokens = distinct_prompt_tokens(&subs);
    let (mut choices, mut generated) = (Vec::with_capacity(subs.len()), 0);
    for mut sub in subs {
        let mut follow = Follow::new(tokenizer, shape, sub.index, &sub.prompt);
        let mut choice = Choice {
            index: sub.index,
            text: String::new(),
            tool_calls: Vec::new(),
            finish: "stop",
            logprobs: shape.logprobs.then(Vec::new),
        };
        let mut count = 0;
        loop {
            let event = sub.events.recv().await;
            if matches!(event, Some(Event::Token { .. })) {
                count += 1;
            }
            let step = follow.on(event)?;
            for d in step.deltas {
                if let Delta::Text(t, lp) = d {
                    choice.text.push_str(&t);
                    if let (Some(all), Some(lp)) = (choice.logprobs.as_mut(), lp) {
                        all.extend(lp);
                    }
                }
            }
            if let Some((finish, n)) = step.done {
                cancel(sub.id);
                choice.tool_calls = step.calls;
                choice.finish = finish;
                generated += n.max(count);
                break;
            }
        }
        choices.push(choice);
    }
    Ok((choices, Usage::new(prompt_tokens, generated)))
}

/// Prompt tokens of an answer: each distinct prompt once (its `n` choices share it).
pub(crate) fn distinct_prompt_tokens(subs: &[Submitted]) -> usize {
    let mut seen: Vec<&[u32]> = Vec::new();
    for s in subs {
        if !seen.contains(&s.prompt.as_slice()) {
            seen.push(&s.prompt);
        }
    }
    seen.iter().map(|p| p.len()).sum()
}
