//! What the fixture tests share: the fixtures' folder, token ids as JSON holds them, and the
//! logits and greedy tokens of a model on the CPU backend.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use ember_generate::sample::{generate_batch, GenerateOptions, Sampler, SamplingConfig};
use ember_model::Decoder;
use serde_json::Value;

pub type B = Flex;

/// `tests/fixtures/hf/<name>` of the repository.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf").join(name)
}

/// A JSON list of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The model's logits for `ids`, flattened (`[T, V]`).
pub fn logits(model: &Decoder<B>, ids: &[u32]) -> Vec<f32> {
    let data: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(data, [1, ids.len()]), &Default::default());
    model.forward(tokens).into_data().to_vec::<f32>().unwrap()
}

/// `n` tokens after `prompt`, greedy, through the KV cache.
pub fn greedy(model: &Decoder<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = [Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() }, 0).unwrap()];
    let opts = GenerateOptions { max_new_tokens: n, stop_tokens: vec![], block_size: 16 };
    generate_batch(model, &[prompt.to_vec()], &opts, &mut s, |_, _| true).unwrap().remove(0)
}
