//! Continuous batching (Yu et al., 2022, "Orca"): requests join and leave the running decode batch
//! at token granularity. The engine holds a fixed number of slots, each a sequence of one paged
//! [`KvCache`]; a request waits in a bounded queue until a slot is free, is prefilled there in
//! chunks of at most `prefill_chunk` tokens (so that a long prompt does not stall the others'
//! decoding), then yields one token per step until a stop token, its `max_new_tokens`, or a cancel.
//!
//! A step runs the decoding slots as one batch of single positions and the prefilling slots as a
//! second batch; idle slots take no part (their cache rows are not touched). The caller drives it:
//! `submit`, then `step` until `is_idle`, passing each [`Event`] on.

use std::collections::VecDeque;

use crate::sample::{check_prompts, feed_rows, SampleError, Sampler};
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
}

/// What a step produced for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Token { id: RequestId, token: u32 },
    Done { id: RequestId, finish: Finish, prompt_tokens: usize, completion_tokens: usize },
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("the queue is full: {0} requests are waiting")]
    QueueFull(usize),
    #[error("the prompt ({prompt} tokens) and max_tokens ({max_new_tokens}) exceed the model's context of {context} positions, or max_tokens is 0")]
    TooLong { prompt: usize, max_new_tokens: usize, context: usize },
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
    /// Prompt and generated tokens (the repetition penalty's history).
    history: Vec<u32>,
    generated: usize,
}

impl Live {
    fn prefilling(&self) -> bool {
        self.fed < self.request.prompt.len()
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
            for (slot, token) in self.draw(&group, &logits) {
                self.record(slot, token, &mut events);
            }
        }
        events
    }

    /// The next token of every slot of `group` whose prompt is all in, drawn from its row of
    /// `logits`: the slots side by side on the thread pool (each request has its own sampler; a
    /// temperature draw over a 49k vocabulary is a few hundred microseconds a row).
    fn draw(&mut self, group: &[usize], logits: &[Vec<f32>]) -> Vec<(usize, u32)> {
        use rayon::prelude::*;
        self.slots
            .par_iter_mut()
            .enumerate()
            .filter_map(|(slot, live)| {
                let row = group.binary_search(&slot).ok()?;
                let live = live.as_mut().filter(|l| !l.prefilling())?;
                let token = live.request.sampler.sample_with_history(&logits[row], &live.history) as u32;
                Some((slot, token))
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

    /// Appends `token` to slot `slot`'s output; ends it at a stop token or its length.
    fn record(&mut self, slot: usize, token: u32, events: &mut Vec<Event>) {
        let Some(live) = self.slots[slot].as_mut() else { return };
        live.history.push(token);
        live.generated += 1;
        events.push(Event::Token { id: live.id, token });
        let finish = if live.request.stop_tokens.contains(&token) {
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
        let live = self.slots[slot].take();
        if !self.config.share_prefixes {
            self.cache.reset(slot);
            self.cached[slot].clear();
        }
        self.count_blocks();
        let (id, prompt_tokens, completion_tokens) =
            live.map_or((0, 0, 0), |l| (l.id, l.request.prompt.len(), l.generated));
        Event::Done { id, finish, prompt_tokens, completion_tokens }
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
mod tests {
    use super::*;
    use crate::sample::{generate_batch, GenerateOptions, SamplingConfig};
    use crate::TestBackend as B;
    use ember_model::ModelConfig;
    use std::collections::HashMap;

    fn model() -> Decoder<B> {
        let config = ModelConfig { init_std: 0.2, ..ModelConfig::tiny(41, 48) };
        Decoder::new(&config, 5, &Default::default()).unwrap()
    }

    fn greedy() -> Sampler {
        Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() }, 0).unwrap()
    }

    fn request(prompt: &[u32], max_new_tokens: usize) -> Request {
        Request { prompt: prompt.to_vec(), max_new_tokens, stop_tokens: vec![], sampler: greedy() }
    }

    /// What `generate_batch` gives the prompt alone.
    fn alone(model: &Decoder<B>, prompt: &[u32], n: usize) -> Vec<u32> {
        let options = GenerateOptions { max_new_tokens: n, stop_tokens: vec![], block_size: 4 };
        generate_batch(model, &[prompt.to_vec()], &options, &mut [greedy()], |_, _| true).unwrap().remove(0)
    }

    /// Steps until idle, submitting `late` requests after `at` steps; the tokens of each request.
    fn run(engine: &mut Engine<B>, late: Vec<(usize, Request)>) -> (HashMap<RequestId, Vec<u32>>, Vec<Event>) {
        let mut late: VecDeque<(usize, Request)> = late.into();
        let (mut tokens, mut done) = (HashMap::<RequestId, Vec<u32>>::new(), Vec::new());
        let mut step = 0;
        while !engine.is_idle() || !late.is_empty() {
            while late.front().is_some_and(|(at, _)| *at <= step) {
                let (_, r) = late.pop_front().unwrap();
                engine.submit(r).unwrap();
            }
            for e in engine.step() {
                match e {
                    Event::Token { id, token } => tokens.entry(id).or_default().push(token),
                    done_event => done.push(done_event),
                }
            }
            step += 1;
            assert!(step < 500, "the engine does not finish");
        }
        (tokens, done)
    }

    #[test]
    fn requests_joining_and_leaving_get_what_they_get_alone() {
        let model = model();
        let prompts: [&[u32]; 4] = [&[1, 2, 3], &[7; 11], &[30, 4], &[9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13]];
        let lens = [12, 5, 9, 7];
        // Two slots for four requests (two wait), prompts prefilled in chunks of 4, arriving at
        // steps 0, 0, 2 and 6.
        let config = EngineConfig { slots: 2, queue_limit: 8, prefill_chunk: 4, block_size: 4, share_prefixes: false };
        let mut engine = Engine::new(model.clone(), config);
        let arrivals = [0, 0, 2, 6];
        let late = (0..4).map(|i| (arrivals[i], request(prompts[i], lens[i]))).collect();
        let (tokens, done) = run(&mut engine, late);
        for i in 0..4 {
            assert_eq!(tokens[&(i as u64)], alone(&model, prompts[i], lens[i]), "request {i}");
        }
        assert_eq!(done.len(), 4);
        for e in done {
            let Event::Done { id, finish, prompt_tokens, completion_tokens } = e else { unreachable!() };
            assert_eq!(
                (finish, prompt_tokens, completion_tokens),
                (Finish::Length, prompts[id as usize].len(), lens[id as usize])
            );
        }
    }

    /// Requests that open with the same tokens (a system prompt), running together or one after
    /// the other, start from the prefix a slot holds: each gets what it gets alone, the prefix's
    /// blocks are held once, and the reused tokens are counted.
    #[test]
    fn requests_sharing_a_prefix_get_what_they_get_alone_and_hold_it_once() {
        let model = model();
        let system: Vec<u32> = (0..14).map(|i| (i * 7 + 3) % 41).collect();
        let ask = |tail: &[u32]| system.iter().chain(tail).copied().collect::<Vec<u32>>();
        let prompts = [ask(&[1, 2]), ask(&[5]), ask(&[9, 9, 9, 9, 9, 9]), system[..10].to_vec(), ask(&[1, 2, 3])];
        let lens = [6, 9, 5, 4, 7];
        let arrivals = [0, 0, 1, 12, 30];
        let run_with = |share_prefixes: bool| {
            let config = EngineConfig { slots: 3, queue_limit: 8, prefill_chunk: 5, block_size: 4, share_prefixes };
            let mut engine = Engine::new(model.clone(), config);
            let late = (0..prompts.len()).map(|i| (arrivals[i], request(&prompts[i], lens[i]))).collect();
            let (tokens, _) = run(&mut engine, late);
            (tokens, engine.cache_use())
        };
        let (tokens, shared) = run_with(true);
        // Four requests at once with one 40-token system prompt: the first prefills it, the other
        // three wait a step and take it over.
        let long: Vec<u32> = (0..40).map(|i| (i * 11 + 2) % 41).collect();
        let together: Vec<Vec<u32>> = (0..4).map(|q| long.iter().copied().chain([q, q + 1]).collect()).collect();
        let config = EngineConfig { slots: 4, queue_limit: 8, prefill_chunk: 64, block_size: 4, share_prefixes: true };
        let mut engine = Engine::new(model.clone(), config);
        let (got, _) = run(&mut engine, together.iter().map(|p| (0, request(p, 3))).collect());
        for (i, p) in together.iter().enumerate() {
            assert_eq!(got[&(i as u64)], alone(&model, p, 3), "request {i} of the four");
        }
        assert_eq!(engine.cache_use().reused_tokens, 3 * 40, "three requests took over the system prompt");
        for (i, prompt) in prompts.iter().enumerate() {
            assert_eq!(tokens[&(i as u64)], alone(&model, prompt, lens[i]), "request {i}");
        }
        let (unshared_tokens, unshared) = run_with(false);
        assert_eq!(tokens, unshared_tokens);
        assert_eq!(shared.prompt_tokens, prompts.iter().map(|p| p.len() as u64).sum::<u64>());
        // Requests 0 and 1 start together, from nothing; request 2 from the 5 tokens their first
        // chunk fed; request 3 from 9 of its 10 tokens (the last one feeds its logits); request 4
        // from the 14 of the system prompt that request 1's slot still holds once request 3 took
        // request 0's (more where a generated token happens to continue a prompt).
        assert!(shared.reused_tokens >= 5 + 9 + 14, "{shared:?}");
        assert_eq!(unshared.reused_tokens, 0);
        assert!(shared.peak_blocks < unshared.peak_blocks, "{shared:?} against {unshared:?}");
    }

    #[test]
    fn a_stop_token_ends_a_request_and_frees_its_slot() {
        let model = model();
        let free = alone(&model, &[5, 6], 8);
        let stop = free[3];
        let first = free.iter().position(|&t| t == stop).unwrap();
        let mut engine = Engine::new(model, EngineConfig { slots: 1, ..Default::default() });
        let r = Request { stop_tokens: vec![stop], ..request(&[5, 6], 8) };
        let (tokens, done) = run(&mut engine, vec![(0, r), (0, request(&[5, 6], 2))]);
        assert_eq!(tokens[&0], free[..=first].to_vec());
        assert_eq!(tokens[&1], free[..2].to_vec(), "the second request ran in the freed slot");
        assert!(matches!(done[0], Event::Done { finish: Finish::Stop, .. }));
    }

    #[test]
    fn bad_requests_a_full_queue_and_cancels() {
        let mut engine = Engine::new(model(), EngineConfig { slots: 1, queue_limit: 2, ..Default::default() });
        let too_long = engine.submit(request(&[1; 40], 9)).unwrap_err();
        assert_eq!(too_long, EngineError::TooLong { prompt: 40, max_new_tokens: 9, context: 48 });
        assert!(matches!(engine.submit(request(&[], 1)), Err(EngineError::Prompt(SampleError::EmptyPrompt))));
        assert!(matches!(engine.submit(request(&[41], 1)), Err(EngineError::Prompt(_))));
        let a = engine.submit(request(&[1, 2], 20)).unwrap();
        let b = engine.submit(request(&[3], 20)).unwrap();
        // Before a step, the free slot takes one more: a, b and c fit; d does not.
        let c = engine.submit(request(&[4], 20)).unwrap();
        assert_eq!(engine.submit(request(&[4], 1)), Err(EngineError::QueueFull(3)));
        assert!(matches!(engine.cancel(c), Some(Event::Done { finish: Finish::Cancelled, .. })));
        engine.step(); // a runs, b waits
        assert_eq!((engine.running(), engine.waiting()), (1, 1));
        let huge = engine.submit(request(&[1, 2], usize::MAX)).unwrap_err();
        assert!(matches!(huge, EngineError::TooLong { .. }), "no overflow past the context check");
        assert!(matches!(engine.submit(request(&[1], 0)), Err(EngineError::TooLong { .. })));
        let cancelled = engine.cancel(b).unwrap();
        assert_eq!(cancelled, Event::Done { id: b, finish: Finish::Cancelled, prompt_tokens: 1, completion_tokens: 0 });
        engine.step();
        let Some(Event::Done { finish: Finish::Cancelled, completion_tokens: 2, .. }) = engine.cancel(a) else {
            panic!("a running request is cancelled with its token count")
        };
        assert!(engine.is_idle() && engine.cancel(a).is_none());
    }
}
