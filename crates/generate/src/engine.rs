//! Continuous batching (Yu et al., 2022, "Orca"): requests join and leave the running decode batch
//! at token granularity. The engine holds a fixed number of slots, each a sequence of one paged
//! [`KvCache`]; a request waits in a bounded queue until a slot is free, is prefilled there in
//! chunks of at most `prefill_chunk` tokens (so that a long prompt does not stall the others'
//! decoding), then yields one token per step until a stop token, its `max_new_tokens`, or a cancel.
//!
//! A step runs the decoding slots as one batch of single positions and the prefilling slots as a
//! second batch; idle slots take no part (their cache rows are not touched). The caller drives it:
//! `submit`, then `step` until `is_idle`, passing each [`Event`] on.
//!
//! A request may also ask for log-probabilities (of the model's own distribution) and carry a
//! [`Constraint`]: its draws are among the tokens of its mask, and it ends when the constraint is
//! finished.

use std::collections::VecDeque;

use crate::constraint::Constraint;
use crate::logprobs::{token_logprobs, TokenLogprobs, MAX_TOP_LOGPROBS};
use crate::sample::{check_prompts, draw_constrained, feed_rows, SampleError, Sampler};
use ember_kernels::EmberBackend;
use ember_model::Decoder;
use ember_model::KvCache;

/// The engine's name for a request, in submission order.
pub type RequestId = u64;

/// What a client asks for.
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    /// The request ends after producing one of these (end-of-text ids); the stop token is
    /// reported like any other.
    pub stop_tokens: Vec<u32>,
    pub sampler: Sampler,
    /// `Some(k)`, k at most [`MAX_TOP_LOGPROBS`]: each token comes with its log-probability and
    /// the k most likely tokens' ([`TokenLogprobs`]).
    pub logprobs: Option<usize>,
    /// What the request may produce (a grammar); it ends with [`Finish::Stop`] once the
    /// constraint is finished, with [`Finish::Failed`] if it fails.
    pub constraint: Option<Box<dyn Constraint>>,
}

impl Request {
    /// A request with no log-probabilities and no constraint.
    pub fn new(prompt: Vec<u32>, max_new_tokens: usize, stop_tokens: Vec<u32>, sampler: Sampler) -> Self {
        Self { prompt, max_new_tokens, stop_tokens, sampler, logprobs: None, constraint: None }
    }
}

/// Why a request ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token.
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// [`Engine::cancel`].
    Cancelled,
    /// The request's constraint failed, or allowed no token (the message in [`Event::Done`]).
    Failed,
}

/// What a step produced for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token; `logprobs` where the request asked for them.
    Token { id: RequestId, token: u32, logprobs: Option<TokenLogprobs> },
    /// The request's end; `error` says why it failed (with [`Finish::Failed`] only).
    Done { id: RequestId, finish: Finish, prompt_tokens: usize, completion_tokens: usize, error: Option<String> },
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("the queue is full: {0} requests are waiting")]
    QueueFull(usize),
    #[error("the prompt ({prompt} tokens) and max_tokens ({max_new_tokens}) exceed the model's context of {context} positions, or max_tokens is 0")]
    TooLong { prompt: usize, max_new_tokens: usize, context: usize },
    #[error("top_logprobs must be at most {MAX_TOP_LOGPROBS}, found {0}")]
    TopLogprobs(usize),
    #[error(transparent)]
    Prompt(#[from] SampleError),
}

/// Sizes of an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Requests decoded at once (sequences of the KV cache).
    pub slots: usize,
    /// Requests that may wait for a slot; more are refused with [`EngineError::QueueFull`].
    pub queue_limit: usize,
    /// Prompt tokens a slot prefills per step.
    pub prefill_chunk: usize,
    /// Positions per KV-cache block.
    pub block_size: usize,
    /// Whether a request starts from a prefix of its prompt another slot holds (see the module
    /// doc).
    pub share_prefixes: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self { slots: 8, queue_limit: 64, prefill_chunk: 256, block_size: 64, share_prefixes: true }
    }
}

/// How the engine's KV cache is used, since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUse {
    /// Positions per block.
    pub block_size: usize,
    /// Blocks held now, a shared block counted once (the slots' kept prefixes included).
    pub held_blocks: usize,
    /// The most blocks held at once.
    pub peak_blocks: usize,
    /// Prompt tokens of the requests admitted.
    pub prompt_tokens: u64,
    /// Of those, the tokens that started from a prefix another request had computed.
    pub reused_tokens: u64,
}

/// A request in a slot.
struct Live {
    id: RequestId,
    request: Request,
    /// Prompt tokens fed so far.
    fed: usize,
    /// Prompt and generated tokens (the penalties' history).
    history: Vec<u32>,
    generated: usize,
}

/// What a slot's draw gave.
enum Drawn {
    Token {
        token: u32,
        logprobs: Option<TokenLogprobs>,
        finished: bool,
    },
    /// The constraint failed (its words).
    Failed(String),
}

impl Live {
    fn prefilling(&self) -> bool {
        self.fed < self.request.prompt.len()
    }

    /// The next token from `logits` (`[V]`), under the request's constraint, with its
    /// log-probabilities if asked for.
    fn draw(&mut self, logits: &[f32]) -> Drawn {
        let r = &mut self.request;
        match draw_constrained(&mut r.sampler, &mut r.constraint, logits, &self.history, self.generated) {
            Ok((token, finished)) => {
                let logprobs = r.logprobs.map(|k| token_logprobs(logits, token, k));
                Drawn::Token { token, logprobs, finished }
            }
            Err(e) => Drawn::Failed(e.0),
        }
    }
}

pub struct Engine<B: EmberBackend> {
    model: Decoder<B>,
    cache: KvCache<B>,
    slots: Vec<Option<Live>>,
    /// Per slot: the tokens whose keys and values its cache sequence holds (kept once its request
    /// ends, until the slot is taken again).
    cached: Vec<Vec<u32>>,
    usage: CacheUse,
    queue: VecDeque<(RequestId, Request)>,
    config: EngineConfig,
    next_id: RequestId,
}

impl<B: EmberBackend> Engine<B> {
    pub fn new(model: Decoder<B>, config: EngineConfig) -> Self {
        let config = EngineConfig {
            slots: config.slots.max(1),
            prefill_chunk: config.prefill_chunk.max(1),
            block_size: config.block_size.max(1),
            ..config
        };
        let cache = model.new_cache(config.slots, config.block_size);
        let slots = (0..config.slots).map(|_| None).collect();
        let cached = vec![Vec::new(); config.slots];
        let usage = CacheUse { block_size: config.block_size, ..CacheUse::default() };
        Self { model, cache, slots, cached, usage, queue: VecDeque::new(), config, next_id: 0 }
    }

    /// Queues a request after checking it against the model: a non-empty prompt of known ids that
    /// fits the context together with `max_new_tokens`.
    pub fn submit(&mut self, request: Request) -> Result<RequestId, EngineError> {
        let c = self.model.config();
        check_prompts(&[&request.prompt], c.max_seq_len, c.vocab_size)?;
        // (The prompt fits, checked above: the subtraction cannot wrap, whatever max_new_tokens is.)
        if request.max_new_tokens == 0 || request.max_new_tokens > c.max_seq_len - request.prompt.len() {
            let (prompt, max_new_tokens) = (request.prompt.len(), request.max_new_tokens);
            return Err(EngineError::TooLong { prompt, max_new_tokens, context: c.max_seq_len });
        }
        if let Some(k) = request.logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return Err(EngineError::TopLogprobs(k));
        }
        // Free slots take requests at the next step: only what would wait beyond them counts.
        let free = self.slots.iter().filter(|s| s.is_none()).count();
        if self.queue.len() >= self.config.queue_limit + free {
            return Err(EngineError::QueueFull(self.queue.len()));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.queue.push_back((id, request));
        Ok(id)
    }

    /// Ends a request, waiting or running; its slot is free for the next step. `None` if it is not
    /// known (it has ended already).
    pub fn cancel(&mut self, id: RequestId) -> Option<Event> {
        if let Some(i) = self.queue.iter().position(|(q, _)| *q == id) {
            let (_, request) = self.queue.remove(i)?;
            return Some(Event::Done {
                id,
                finish: Finish::Cancelled,
                prompt_tokens: request.prompt.len(),
                completion_tokens: 0,
                error: None,
            });
        }
        let slot = self.slots.iter().position(|s| s.as_ref().is_some_and(|l| l.id == id))?;
        Some(self.release(slot, Finish::Cancelled))
    }

    /// Ends every request, waiting or running (each with `Finish::Cancelled`), and starts from an
    /// empty cache: what the server does after a step panicked, when the cache may be half written.
    pub fn abort_all(&mut self) -> Vec<Event> {
        let mut events: Vec<Event> = Vec::new();
        for (id, request) in std::mem::take(&mut self.queue) {
            events.push(Event::Done {
                id,
                finish: Finish::Cancelled,
                prompt_tokens: request.prompt.len(),
                completion_tokens: 0,
                error: None,
            });
        }
        for slot in 0..self.slots.len() {
            if self.slots[slot].is_some() {
                events.push(self.release(slot, Finish::Cancelled));
            }
        }
        self.cache = self.model.new_cache(self.config.slots, self.config.block_size);
        self.cached.iter_mut().for_each(Vec::clear);
        self.usage.held_blocks = 0;
        events
    }

    /// How the KV cache is used: blocks held now and at most, prompt tokens reused.
    /// Requests it takes at once: running and waiting (more are refused with
    /// [`EngineError::QueueFull`]).
    pub fn capacity(&self) -> usize {
        self.config.slots + self.config.queue_limit
    }

    pub fn cache_use(&self) -> CacheUse {
        self.usage
    }

    /// Requests running (prefilling or decoding).
    pub(crate) fn running(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Requests waiting for a slot.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.queue.len()
    }

    pub fn is_idle(&self) -> bool {
        self.running() == 0 && self.queue.is_empty()
    }

    /// Admits waiting requests into free slots, then runs one forward pass for the decoding slots
    /// and one for the prefilling ones, and samples a token for every slot whose prompt is in.
    pub fn step(&mut self) -> Vec<Event> {
        self.admit();
        let waiting = match self.config.share_prefixes {
            true => {
                self.catch_up();
                self.followers()
            }
            false => Vec::new(),
        };
        let mut events = Vec::new();
        let (decoding, prefilling): (Vec<usize>, Vec<usize>) = (0..self.slots.len())
            .filter(|&i| self.slots[i].is_some() && !waiting.contains(&i))
            .partition(|&i| self.slots[i].as_ref().is_some_and(|l| !l.prefilling()));
        for group in [decoding, prefilling] {
            if group.is_empty() {
                continue;
            }
            let inputs: Vec<Vec<u32>> = group.iter().map(|&i| self.next_input(i)).collect();
            self.make_room(&group, &inputs);
            let logits = feed_rows(&self.model, &mut self.cache, &group, &inputs);
            for (&slot, input) in group.iter().zip(&inputs) {
                self.cached[slot].extend(input);
            }
            self.count_blocks();
            for (slot, drawn) in self.draw(&group, &logits) {
                self.record(slot, drawn, &mut events);
            }
        }
        events
    }

    /// The next token of every slot of `group` whose prompt is all in, drawn from its row of
    /// `logits`: the slots side by side on the thread pool (each request has its own sampler, so
    /// a seeded request draws the same whatever runs beside it; a temperature draw over a 49k
    /// vocabulary is a few hundred microseconds a row).
    fn draw(&mut self, group: &[usize], logits: &[Vec<f32>]) -> Vec<(usize, Drawn)> {
        use rayon::prelude::*;
        self.slots
            .par_iter_mut()
            .enumerate()
            .filter_map(|(slot, live)| {
                let row = group.binary_search(&slot).ok()?;
                let live = live.as_mut().filter(|l| !l.prefilling())?;
                Some((slot, live.draw(&logits[row])))
            })
            .collect()
    }

    /// Takes waiting requests into free slots, each starting from the longest prefix of its prompt
    /// a slot holds (all but the prompt's last token at most: its logits start the answer).
    fn admit(&mut self) {
        loop {
            let free: Vec<usize> = (0..self.slots.len()).filter(|&s| self.slots[s].is_none()).collect();
            if free.is_empty() {
                break;
            }
            let Some((id, request)) = self.queue.pop_front() else { break };
            let share = self.config.share_prefixes;
            let held = |slot: usize| if share { self.held(slot, &request.prompt) } else { 0 };
            // The free slot whose kept tokens serve the prompt best (a prefix is taken from
            // itself without a copy), and the best prefix of any slot.
            let slot = free.iter().copied().max_by_key(|&s| (held(s), std::cmp::Reverse(s))).unwrap_or(free[0]);
            let from = (0..self.slots.len()).max_by_key(|&s| (held(s), s == slot)).unwrap_or(slot);
            let reused = held(from);
            self.take_prefix((from, slot), &request.prompt, reused, 0);
            self.usage.prompt_tokens += request.prompt.len() as u64;
            let history = request.prompt.clone();
            self.slots[slot] = Some(Live { id, request, fed: reused, history, generated: 0 });
        }
        self.count_blocks();
    }

    /// Prefilling slots start from a longer prefix of their prompt where another slot now holds
    /// one (one that was being prefilled when they were admitted).
    fn catch_up(&mut self) {
        for slot in 0..self.slots.len() {
            let Some(live) = self.slots[slot].as_ref().filter(|l| l.prefilling()) else { continue };
            let best =
                (0..self.slots.len()).filter(|&o| o != slot).map(|o| (self.held(o, &live.request.prompt), o)).max();
            let Some((len, from)) = best.filter(|&(len, _)| len > live.fed) else { continue };
            let (prompt, fed) = (live.request.prompt.clone(), live.fed);
            self.take_prefix((from, slot), &prompt, len, fed);
            if let Some(live) = self.slots[slot].as_mut() {
                live.fed = len;
            }
        }
    }

    /// Tokens of `prompt` slot `o` holds that a request can start from: all but the prompt's last
    /// at most (its logits start the answer).
    fn held(&self, o: usize, prompt: &[u32]) -> usize {
        common_prefix(&self.cached[o], prompt).min(prompt.len() - 1)
    }

    /// Slot `slot` holds the first `len` tokens of `prompt` as slot `from` holds them, the blocks
    /// shared (none for 0: it starts empty); the `len - fed` it did not compute itself count as
    /// reused.
    fn take_prefix(&mut self, (from, slot): (usize, usize), prompt: &[u32], len: usize, fed: usize) {
        self.cache.share_prefix(from, slot, len);
        self.cached[slot] = prompt[..len].to_vec();
        self.usage.reused_tokens += (len - fed) as u64;
    }

    /// Prefilling slots that wait a step: those whose prompt shares at least [`WAIT_FOR_PREFIX`]
    /// more tokens with a lower slot's prompt that is being prefilled and has not fed them yet.
    /// Requests that arrive together with one system prompt then compute it once (the lowest slot
    /// feeds it, the others take it over at the next step) instead of each its own copy.
    fn followers(&self) -> Vec<usize> {
        let prefilling: Vec<(usize, &Live)> = (0..self.slots.len())
            .filter_map(|s| self.slots[s].as_ref().filter(|l| l.prefilling()).map(|l| (s, l)))
            .collect();
        prefilling
            .iter()
            .filter(|(s, live)| {
                let prompt = &live.request.prompt;
                prefilling.iter().any(|(l, leader)| {
                    let shared = common_prefix(&leader.request.prompt, prompt).min(prompt.len() - 1);
                    l < s && shared >= live.fed + WAIT_FOR_PREFIX && leader.fed < shared
                })
            })
            .map(|(s, _)| *s)
            .collect()
    }

    /// Lets go of the prefixes idle slots keep until the pool's free blocks cover what `group`
    /// stores of `inputs` (the pool grows only when they are not enough).
    fn make_room(&mut self, group: &[usize], inputs: &[Vec<u32>]) {
        let need: usize = group.iter().zip(inputs).map(|(&s, input)| self.cache.blocks_needed(s, input.len())).sum();
        for slot in 0..self.slots.len() {
            if self.cache.free_blocks() >= need {
                return;
            }
            if self.slots[slot].is_none() && !self.cached[slot].is_empty() {
                self.cache.reset(slot);
                self.cached[slot].clear();
            }
        }
    }

    fn count_blocks(&mut self) {
        self.usage.held_blocks = self.cache.held_blocks();
        self.usage.peak_blocks = self.usage.peak_blocks.max(self.usage.held_blocks);
    }

    /// The tokens slot `slot` feeds this step: its next prompt chunk, or its last token.
    fn next_input(&mut self, slot: usize) -> Vec<u32> {
        let chunk = self.config.prefill_chunk;
        let Some(live) = self.slots[slot].as_mut() else { return Vec::new() };
        if live.prefilling() {
            let end = (live.fed + chunk).min(live.request.prompt.len());
            let input = live.request.prompt[live.fed..end].to_vec();
            live.fed = end;
            input
        } else {
            live.history.last().map(|&t| vec![t]).unwrap_or_default()
        }
    }

    /// Appends a drawn token to slot `slot`'s output; ends it at a stop token, when its constraint
    /// is finished or has failed, or at its length.
    fn record(&mut self, slot: usize, drawn: Drawn, events: &mut Vec<Event>) {
        let Some(live) = self.slots[slot].as_mut() else { return };
        let (token, logprobs, finished) = match drawn {
            Drawn::Token { token, logprobs, finished } => (token, logprobs, finished),
            Drawn::Failed(message) => return events.push(self.end(slot, Finish::Failed, Some(message))),
        };
        live.history.push(token);
        live.generated += 1;
        events.push(Event::Token { id: live.id, token, logprobs });
        let finish = if finished || live.request.stop_tokens.contains(&token) {
            Some(Finish::Stop)
        } else if live.generated >= live.request.max_new_tokens {
            Some(Finish::Length)
        } else {
            None
        };
        if let Some(finish) = finish {
            events.push(self.release(slot, finish));
        }
    }

    /// Ends slot `slot`'s request; the slot keeps what its cache holds for the next requests to
    /// start from (with prefix sharing off, it lets it go).
    fn release(&mut self, slot: usize, finish: Finish) -> Event {
        self.end(slot, finish, None)
    }

    /// [`Engine::release`], saying why it failed.
    fn end(&mut self, slot: usize, finish: Finish, error: Option<String>) -> Event {
        let live = self.slots[slot].take();
        if !self.config.share_prefixes {
            self.cache.reset(slot);
            self.cached[slot].clear();
        }
        self.count_blocks();
        let (id, prompt_tokens, completion_tokens) =
            live.map_or((0, 0, 0), |l| (l.id, l.request.prompt.len(), l.generated));
        Event::Done { id, finish, prompt_tokens, completion_tokens, error }
    }
}

/// Prompt tokens a prefilling request waits a step for, rather than compute them beside another
/// request that is computing the same ([`Engine::followers`]).
const WAIT_FOR_PREFIX: usize = 16;

/// Tokens `a` and `b` share from the start.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests;
