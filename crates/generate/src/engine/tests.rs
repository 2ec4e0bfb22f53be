//! The engine against `generate_batch` alone: joining, leaving, shared prefixes, stops, cancels,
//! constraints, seeds and log-probabilities.

use super::*;
use crate::constraint::ConstraintError;
use crate::sample::{generate_batch, generate_batch_constrained, GenerateOptions, SamplingConfig};
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
    Request::new(prompt.to_vec(), max_new_tokens, vec![], greedy())
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
                Event::Token { id, token, .. } => tokens.entry(id).or_default().push(token),
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
        let Event::Done { id, finish, prompt_tokens, completion_tokens, .. } = e else { unreachable!() };
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
    let done = Event::Done { id: b, finish: Finish::Cancelled, prompt_tokens: 1, completion_tokens: 0, error: None };
    assert_eq!(cancelled, done);
    engine.step();
    let Some(Event::Done { finish: Finish::Cancelled, completion_tokens: 2, .. }) = engine.cancel(a) else {
        panic!("a running request is cancelled with its token count")
    };
    assert!(engine.is_idle() && engine.cancel(a).is_none());
}

/// Only even ids; finished after `left` tokens; fails at the mask once `fail_after` tokens
/// are in.
struct Even {
    left: usize,
    fail_after: Option<usize>,
    drawn: Vec<u32>,
    mask: Vec<u32>,
}

impl Even {
    fn new(left: usize, fail_after: Option<usize>) -> Box<Self> {
        Box::new(Self { left, fail_after, drawn: Vec::new(), mask: vec![0x5555_5555; 2] })
    }
}

impl Constraint for Even {
    fn mask(&mut self) -> Result<&[u32], ConstraintError> {
        if self.fail_after.is_some_and(|n| self.drawn.len() >= n) {
            return Err(ConstraintError("the grammar ends here".into()));
        }
        Ok(&self.mask)
    }
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        assert_eq!(token % 2, 0, "a token outside the mask was drawn");
        self.drawn.push(token);
        self.left -= 1;
        Ok(())
    }
    fn finished(&self) -> bool {
        self.left == 0
    }
}

fn sampled(seed: u64) -> Sampler {
    Sampler::new(SamplingConfig { temperature: 1.0, top_k: None, ..Default::default() }, seed).unwrap()
}

#[test]
fn a_constraint_is_obeyed_and_ends_the_request() {
    let model = model();
    let mut engine = Engine::new(model.clone(), EngineConfig { slots: 3, ..Default::default() });
    let constrained = |sampler: Sampler| Request {
        constraint: Some(Even::new(3, None)),
        ..Request::new(vec![1, 2, 3], 10, vec![], sampler)
    };
    let failing = Request { constraint: Some(Even::new(9, Some(2))), ..request(&[4, 5], 10) };
    let late = vec![(0, constrained(greedy())), (0, constrained(sampled(3))), (0, failing)];
    let (tokens, done) = run(&mut engine, late);
    for id in [0, 1] {
        assert_eq!(tokens[&id].len(), 3, "request {id}: {:?}", tokens[&id]);
        assert!(tokens[&id].iter().all(|t| t % 2 == 0), "request {id}: {:?}", tokens[&id]);
    }
    assert_eq!(tokens[&2].len(), 2);
    let by_id = |id: u64| done.iter().find(|e| matches!(e, Event::Done { id: i, .. } if *i == id)).unwrap();
    for id in [0, 1] {
        assert!(matches!(by_id(id), Event::Done { finish: Finish::Stop, completion_tokens: 3, error: None, .. }));
    }
    let Event::Done { finish: Finish::Failed, completion_tokens: 2, error: Some(e), .. } = by_id(2) else {
        panic!("the failing constraint ends its request: {:?}", by_id(2))
    };
    assert_eq!(e, "the grammar ends here");
    // A mask that allows nothing fails too; the batched generator obeys the same constraint.
    let none =
        Request { constraint: Some(Box::new(Even { mask: vec![0, 0], ..*Even::new(3, None) })), ..request(&[1], 5) };
    let (_, done) = run(&mut engine, vec![(0, none)]);
    assert!(matches!(&done[0], Event::Done { finish: Finish::Failed, error: Some(e), .. } if e.contains("no token")));
    let options = GenerateOptions { max_new_tokens: 10, stop_tokens: vec![], block_size: 4 };
    let mut constraints: Vec<Option<Box<dyn Constraint>>> = vec![Some(Even::new(3, None)), None];
    let prompts = [vec![1, 2, 3], vec![1, 2, 3]];
    let mut samplers = [greedy(), greedy()];
    let got =
        generate_batch_constrained(&model, &prompts, &options, &mut samplers, &mut constraints, |_, _| true).unwrap();
    assert_eq!(got[0], tokens[&0], "the engine and the batched generator agree");
    assert_eq!(got[1], alone(&model, &prompts[1], 10), "the free sequence beside it is as alone");
    let mut failing: Vec<Option<Box<dyn Constraint>>> = vec![None, Some(Even::new(9, Some(1)))];
    let e = generate_batch_constrained(&model, &prompts, &options, &mut samplers, &mut failing, |_, _| true);
    assert_eq!(e.unwrap_err().to_string(), "sequence 1: constrained decoding failed: the grammar ends here");
}

#[test]
fn a_seeded_request_draws_the_same_whatever_runs_beside_it() {
    let model = model();
    let seven = || Request::new(vec![3, 1, 4, 1, 5], 12, vec![], sampled(7));
    let mut engine = Engine::new(model.clone(), EngineConfig { slots: 4, ..Default::default() });
    let (lone, _) = run(&mut engine, vec![(0, seven())]);
    let mut engine = Engine::new(model, EngineConfig { slots: 4, ..Default::default() });
    let others = (0..3).map(|i| (0, Request::new(vec![9, i, 2], 12, vec![], sampled(i as u64))));
    let (together, _) = run(&mut engine, others.chain([(0, seven())]).collect());
    assert_eq!(lone[&0], together[&3]);
    assert_ne!(together[&0], together[&3], "the seeds differ");
}

#[test]
fn logprobs_come_with_the_tokens_that_ask_for_them() {
    let model = model();
    let mut engine = Engine::new(model.clone(), EngineConfig { slots: 2, ..Default::default() });
    engine.submit(Request { logprobs: Some(4), ..request(&[1, 2, 3], 5) }).unwrap();
    engine.submit(request(&[1, 2, 3], 5)).unwrap();
    assert_eq!(engine.submit(Request { logprobs: Some(21), ..request(&[1], 1) }), Err(EngineError::TopLogprobs(21)));
    let mut seen = 0;
    while !engine.is_idle() {
        for e in engine.step() {
            let Event::Token { id, token, logprobs } = e else { continue };
            let Some(l) = logprobs else {
                assert_eq!(id, 1, "only the request that asked");
                continue;
            };
            // Greedy and free: the token is the most likely one.
            assert_eq!((id, l.top.len(), l.top[0].0), (0, 4, token));
            assert_eq!(l.logprob, l.top[0].1);
            assert!(l.top.windows(2).all(|w| w[0].1 >= w[1].1) && l.logprob < 0.0);
            seen += 1;
        }
    }
    assert_eq!(seen, 5);
}
