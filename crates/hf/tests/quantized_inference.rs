//! A GGUF file run for inference on its stored blocks (`gguf:FILE` of sample, chat, serve, eval,
//! bench): the projections, the embedding table and the LM head kept in their block types.
//! - Many rows at once (a prompt) decode tiles for the f32 GEMM: the logits of the file dequantized
//!   to f32, within 1e-5 relative.
//! - One row at a time (decoding through the KV cache) runs on integer dot products with the
//!   activations quantized to 8 bits in blocks of 32 or 256, as llama.cpp does: logits within a few
//!   percent relative of the f32 model's (measured: 1.7% on SmolLM2, most of it the projections'
//!   8-bit inputs, the Q8_0 head adding 0.1%; 8.0% on Gemma 3, whose hidden states have larger
//!   outliers; llama.cpp computes the same way, and tests/gguf.rs checks that the greedy tokens are
//!   llama.cpp's), and the same greedy token wherever the f32 model's top two differ by more than 0.5
//!   (Gemma 3: all but one of 7).
//! - One row at a time with 16-bit activations (`ActivationBits::Sixteen`, `EMBER_ACTIVATIONS=16`:
//!   each block's 8-bit codes and their rounding residual's, on the same integer products): logits
//!   within 1e-2 relative of the f32 model's, what issue 52 asks; with an f16 KV cache too.
//!
//! On SmolLM2-135M-Instruct Q4_1 (its tied embedding Q8_0; `$EMBER_TEST_ASSETS`) and Gemma 3 270M
//! Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0; `$EMBER_GEMMA3_GGUF`, as .ci/run provides it).

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{DType, Int, Tensor, TensorData};
use ember_kernels::ActivationBits;
use ember_model::Decoder;

#[path = "../../../tests/assets.rs"]
mod assets;

fn smollm2_q4_1() -> PathBuf {
    assets::assets().join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Relative difference of two sets of values: `‖a − b‖ / ‖b‖`.
fn relative(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    assert!(norm > 0.0, "a reference of zeros proves nothing");
    (diff / norm).sqrt()
}

fn models(path: &Path) -> (Decoder<Flex>, Decoder<Flex>) {
    let dev = Default::default();
    let kept = ember_hf::gguf::model::import_for_inference::<Flex>(path, &dev).unwrap().imported.model;
    let dense = ember_hf::gguf::model::import::<Flex>(path, DType::F32, &dev).unwrap().imported.model;
    let kept_table = matches!(kept.embed_tokens, ember_model::Weight::Stored(_));
    assert!(kept_table, "{}: the embedding table kept (no f32 copy)", path.display());
    assert!(kept.quantized_projections().0 > 0, "{}: projections kept", path.display());
    (kept, dense)
}

/// Token ids of a short text, spread over the vocabulary.
fn ids(vocab: usize, n: usize) -> Vec<i64> {
    (0..n).map(|i| ((i * 7919 + 31) % vocab.min(20_000)) as i64 + 5).collect()
}

fn forward(model: &Decoder<Flex>, ids: &[i64]) -> Vec<f32> {
    let tokens = Tensor::<Flex, 2, Int>::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), &Default::default());
    model.forward(tokens).into_data().iter::<f32>().collect()
}

/// The logits of each position, fed one token at a time through the KV cache.
fn decoded(model: &Decoder<Flex>, ids: &[i64]) -> Vec<f32> {
    let mut cache = model.new_cache(1, 16);
    let mut out = Vec::new();
    for &id in ids {
        let token = Tensor::<Flex, 2, Int>::from_data(TensorData::new(vec![id], [1, 1]), &Default::default());
        let hidden = model.forward_cached(token, &[1], &mut cache);
        let d = hidden.dims()[2];
        out.extend(model.logits(hidden.reshape([1, d])).into_data().iter::<f32>());
    }
    out
}

/// `bound`: the largest relative difference of the decoded logits; `misses`: clear positions whose
/// greedy token may differ from the f32 model's.
fn check(path: &Path, bound: f64, misses: usize) {
    let (kept, dense) = models(path);
    let v = dense.config().vocab_size;
    let prompt = ids(v, 24);
    // Exact products (what `ember eval` asks for): the prompt's logits are the f32 model's.
    let exact = kept.clone().with_compute(kept.compute().with_int8_inputs(false));
    let (e, f) = (forward(&exact, &prompt), forward(&dense, &prompt));
    assert!(relative(&e, &f) < 1e-5, "{}: exact prompt logits differ by {}", path.display(), relative(&e, &f));
    // 8-bit activations (the default, llama.cpp's): the prompt within the decoded steps' bound
    // (integer products on interleaved weights, exact tiles on the rest).
    let q = forward(&kept, &prompt);
    assert!(relative(&q, &f) < bound, "{}: prompt logits differ by {}", path.display(), relative(&q, &f));

    let steps = &prompt[..12];
    let q = decoded(&kept, steps);
    let f = forward(&dense, steps);
    let r = relative(&q, &f);
    assert!(r < bound && r > 0.0, "{}: decoded logits differ by {r}", path.display());
    let (mut compared, mut agreed) = (0, 0);
    for (row_q, row_f) in q.chunks(v).zip(f.chunks(v)) {
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| row_f[b].total_cmp(&row_f[a]));
        if row_f[order[0]] - row_f[order[1]] > 0.5 {
            compared += 1;
            let best_q = (0..v).max_by(|&a, &b| row_q[a].total_cmp(&row_q[b])).unwrap();
            agreed += usize::from(best_q == order[0]);
        }
    }
    eprintln!("{}: logits {r:.4} relative; {agreed} of {compared} clear greedy tokens", path.display());
    sixteen_bits(&kept, path, (&prompt, steps), (&forward(&dense, &prompt), &f));
    assert!(compared >= 4, "{}: only {compared} positions with a clear top token", path.display());
    assert!(
        agreed + misses >= compared,
        "{}: greedy tokens differ at {} clear positions",
        path.display(),
        compared - agreed
    );
}

/// 16-bit activations: the prompt's logits and the decoded ones within 1e-2 relative of the f32
/// model's (`want`: its logits of `prompt` and of `steps`).
fn sixteen_bits(kept: &Decoder<Flex>, path: &Path, (prompt, steps): (&[i64], &[i64]), want: (&[f32], &[f32])) {
    let fine = kept.clone().with_compute(kept.compute().with_activation_bits(ActivationBits::Sixteen));
    let p = relative(&forward(&fine, prompt), want.0);
    let d = relative(&decoded(&fine, steps), want.1);
    eprintln!("{}: 16-bit activations: prompt logits {p:.2e}, decoded {d:.2e} relative", path.display());
    assert!(p < 1e-2 && d < 1e-2 && d > 0.0, "{}: 16-bit activations: {p}, {d}", path.display());
    // The KV cache in f16 besides (`--kv-cache f16`, llama.cpp's default cache): still within 1e-2.
    let half = fine.clone().with_compute(fine.compute().with_kv_cache(DType::F16));
    let h = relative(&decoded(&half, steps), want.1);
    eprintln!("{}: 16-bit activations, f16 KV cache: decoded {h:.2e} relative", path.display());
    assert!(h < 1e-2 && h != d, "{}: f16 KV cache: {h} (f32 cache: {d})", path.display());
}

#[test]
fn smollm2_q4_1_runs_on_its_stored_blocks() {
    check(&smollm2_q4_1(), 2.5e-2, 0);
}

#[test]
fn gemma3_q4_k_m_runs_on_its_stored_blocks() {
    check(&assets::gemma3_gguf(), 0.1, 1);
}
