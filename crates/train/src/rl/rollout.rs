//! Sampling a step's answers through the continuous-batching engine: every answer of the step in
//! its own slot, the answers to one prompt submitted together so that the prompt's keys and values
//! are computed once and shared (the engine's prefix sharing), each with its own seeded sampler,
//! and under `rl.json_schema` each with its own constraint of the schema.

use std::path::Path;

use ember_data::Tokenizer;
use ember_eval::schema::Schema;
use ember_generate::engine::{Engine, EngineConfig, Event, Finish, Request};
use ember_generate::sample::{Sampler, SamplingConfig};
use ember_kernels::EmberBackend;
use ember_model::Decoder;

use crate::config::RlConfig;
use crate::error::TrainError;

/// Answers decoded at once.
const MAX_SLOTS: usize = 64;

/// How answers are sampled, from `[rl]`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SampleConfig {
    pub max_new_tokens: usize,
    pub sampling: SamplingConfig,
    /// End-of-sequence ids: an answer ends after one (it is kept, as TRL keeps it).
    pub stop_tokens: Vec<u32>,
    /// An answer ends once its text holds one of these.
    pub stop: Vec<String>,
    /// The JSON Schema every answer is generated under (`rl.json_schema`).
    pub schema: Option<Schema>,
}

/// `rl.json_schema`'s schema, read and compiled for the run's tokenizer before training starts:
/// a file that cannot be read or parsed, or a schema the grammar engine refuses, stops the run
/// there, named by the key and the file.
pub(crate) fn load_schema(path: &Path, tokenizer: &Tokenizer, vocab_size: usize) -> Result<Schema, TrainError> {
    Schema::load(path, tokenizer, &tokenizer.end_ids(), vocab_size)
        .map_err(|e| TrainError::Rl(format!("json_schema = {:?}: {e}", path.display().to_string())))
}

impl SampleConfig {
    /// The sampling of `rl`'s answers; `schema`: `rl.json_schema`'s, loaded ([`Schema::load`]).
    pub(crate) fn of(rl: &RlConfig, tokenizer: &Tokenizer, schema: Option<Schema>) -> Self {
        Self {
            max_new_tokens: rl.max_new_tokens,
            sampling: SamplingConfig {
                temperature: rl.temperature as f32,
                top_k: rl.top_k,
                top_p: (rl.top_p < 1.0).then_some(rl.top_p as f32),
                repetition_penalty: 1.0,
            },
            stop_tokens: tokenizer.end_ids(),
            stop: rl.stop.clone(),
            schema,
        }
    }

    /// The same, greedy (held-out evaluations).
    pub(crate) fn greedy(&self) -> Self {
        Self {
            sampling: SamplingConfig { temperature: 0.0, top_k: None, top_p: None, ..self.sampling.clone() },
            ..self.clone()
        }
    }
}

/// Sampled answers: tokens, and whether each was cut by `max_new_tokens`.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Sampled {
    pub tokens: Vec<Vec<u32>>,
    pub truncated: Vec<bool>,
}

/// Samples one answer per entry of `prompts` (the answers to one prompt next to each other), the
/// `i`-th with the sampler seeded by `seeds[i]`. `lines` name the prompts' rows in errors.
pub(crate) fn sample<B: EmberBackend>(
    model: Decoder<B>,
    prompts: &[&[u32]],
    seeds: &[u64],
    lines: &[String],
    config: &SampleConfig,
    tokenizer: &Tokenizer,
) -> Result<Sampled, TrainError> {
    let n = prompts.len();
    // At most MAX_SLOTS answers decode at once (the cache holds their keys and values); the rest
    // wait their turn in the queue.
    let engine_config = EngineConfig {
        slots: n.clamp(1, MAX_SLOTS),
        queue_limit: n.max(1),
        prefill_chunk: 512,
        block_size: 16,
        share_prefixes: true,
    };
    let mut engine = Engine::new(model, engine_config);
    let mut ids = Vec::with_capacity(n);
    for (i, prompt) in prompts.iter().enumerate() {
        let sampler = Sampler::new(config.sampling.clone(), seeds[i]).map_err(|e| TrainError::Rl(e.to_string()))?;
        let mut request = Request::new(prompt.to_vec(), config.max_new_tokens, config.stop_tokens.clone(), sampler);
        request.constraint = match &config.schema {
            Some(schema) => Some(schema.constraint().map_err(|e| TrainError::Rl(format!("json_schema: {e}")))?),
            None => None,
        };
        let id = engine.submit(request).map_err(|e| TrainError::Rl(format!("the prompt of {}: {e}", lines[i])))?;
        ids.push(id);
    }
    // Request ids are given in submission order from 0.
    let first = ids.first().copied().unwrap_or(0);
    let mut out = Sampled { tokens: vec![Vec::new(); n], truncated: vec![false; n] };
    // Stop texts are looked for in each answer's text, decoded a token at a time (not the whole
    // answer again per token).
    let mut streams: Vec<_> = (0..n).map(|_| tokenizer.decode_stream(&[])).collect();
    let mut texts = vec![String::new(); n];
    let mut finished = 0;
    while finished < n && !engine.is_idle() {
        let mut stopped = Vec::new();
        for event in engine.step() {
            match event {
                Event::Token { id, token, .. } => {
                    let i = (id - first) as usize;
                    out.tokens[i].push(token);
                    if !config.stop.is_empty() {
                        texts[i].push_str(&streams[i].step(token).unwrap_or_default());
                        if config.stop.iter().any(|s| texts[i].contains(s.as_str())) {
                            stopped.push(id);
                        }
                    }
                }
                Event::Done { id, finish, error, .. } => {
                    let i = (id - first) as usize;
                    if finish == Finish::Failed {
                        let error = error.unwrap_or_default();
                        return Err(TrainError::Rl(format!("the answer to {}: json_schema: {error}", lines[i])));
                    }
                    out.truncated[i] = finish == Finish::Length;
                    finished += 1;
                }
            }
        }
        for id in stopped {
            if engine.cancel(id).is_some() {
                finished += 1;
            }
        }
    }
    Ok(out)
}
