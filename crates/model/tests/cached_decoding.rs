//! Cached decoding gives the logits of a full forward pass, and batched generation gives each
//! prompt's tokens as if it were alone.

use burn::backend::Flex;
use burn::tensor::{DType, Int, Tensor, TensorData};
use ember_generate::sample::{generate, generate_batch, GenerateOptions, Sampler, SamplingConfig};
use ember_model::{Compute, Decoder, KvCache, MlpKind, ModelConfig, RopeLayout};

type B = Flex;

fn config(n_kv_heads: usize, layout: RopeLayout) -> ModelConfig {
    ModelConfig {
        d_model: 48,
        n_layers: 3,
        n_heads: 6,
        n_kv_heads: Some(n_kv_heads),
        d_ff: 96,
        rope_layout: layout,
        qkv_bias: true,
        init_std: 0.2,
        ..ModelConfig::tiny(41, 40)
    }
}

fn tokens(ids: &[u32]) -> Tensor<B, 2, Int> {
    let data: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Tensor::from_data(TensorData::new(data, [1, ids.len()]), &Default::default())
}

fn max_abs_diff(a: Tensor<B, 2>, b: Tensor<B, 2>) -> f32 {
    (a - b).abs().max().into_scalar()
}

#[test]
fn cached_logits_equal_full_forward_at_every_step() {
    let ids: Vec<u32> = (0..29).map(|i| (i * 7 + 3) % 41).collect();
    // Every KV grouping and RoPE layout, and the speedrun's parts (squared ReLU, QK-norm,
    // soft-capped logits).
    let speedrun = ModelConfig {
        mlp: MlpKind::Relu2,
        qk_norm: true,
        final_logit_softcap: Some(30.0),
        ..config(2, RopeLayout::HalfSplit)
    };
    let configs = [6, 2, 1]
        .into_iter()
        .flat_map(|n| [RopeLayout::HalfSplit, RopeLayout::Interleaved].map(|l| config(n, l)))
        .chain([speedrun]);
    for cfg in configs {
        {
            let (n_kv, layout) = (cfg.n_kv_heads(), cfg.rope_layout);
            let model = Decoder::<B>::new(&cfg, 11, &Default::default()).unwrap();
            let full = model.forward(tokens(&ids)).reshape([ids.len(), 41]); // [T, V]
                                                                             // Prefill 5 tokens, then one at a time; block size 4 so that blocks fill and spill.
            let mut cache = model.new_cache(1, 4);
            let prefill = 5;
            let h = model.forward_cached(tokens(&ids[..prefill]), &[prefill], &mut cache); // [1, 5, D]
            let got = model.logits(h.reshape([prefill, cfg.d_model]));
            let diff = max_abs_diff(got, full.clone().narrow(0, 0, prefill));
            assert!(diff < 1e-4, "kv {n_kv} {layout:?} prefill: {diff}");
            for i in prefill..ids.len() {
                let h = model.forward_cached(tokens(&ids[i..i + 1]), &[1], &mut cache);
                let got = model.logits(h.reshape([1, cfg.d_model]));
                let diff = max_abs_diff(got, full.clone().narrow(0, i, 1));
                assert!(diff < 1e-4, "kv {n_kv} {layout:?} step {i}: {diff}");
            }
            assert_eq!(cache.lens(), &[ids.len()]);
            // 2 · L · K · Dh · 4 bytes per position; 8 blocks of 4 hold the 29 positions.
            assert_eq!(cache.bytes_per_token(DType::F32), 2 * 3 * n_kv * 8 * 4);
            assert_eq!(cache.held_blocks(), 8);
        }
    }
}

#[test]
fn sliding_window_cached_equals_full_and_limits_what_a_query_sees() {
    let ids: Vec<u32> = (0..20).map(|i| (i * 5 + 1) % 41).collect();
    let cfg = ModelConfig { sliding_window: Some(6), ..config(2, RopeLayout::HalfSplit) };
    let model = Decoder::<B>::new(&cfg, 3, &Default::default()).unwrap();
    let full = model.forward(tokens(&ids)).reshape([ids.len(), 41]);
    let mut cache = model.new_cache(1, 4);
    let h = model.forward_cached(tokens(&ids[..3]), &[3], &mut cache);
    let mut rows = vec![model.logits(h.reshape([3, cfg.d_model]))];
    for i in 3..ids.len() {
        let h = model.forward_cached(tokens(&ids[i..i + 1]), &[1], &mut cache);
        rows.push(model.logits(h.reshape([1, cfg.d_model])));
    }
    let diff = max_abs_diff(Tensor::cat(rows, 0), full.clone());
    assert!(diff < 1e-4, "{diff}");
    // Token 0 is out of the window of position 12 (with 3 layers the receptive field is 3·5 back,
    // so compare a one-layer model): changing it leaves position 12 alone.
    let one = ModelConfig { n_layers: 1, ..cfg.clone() };
    let m1 = Decoder::<B>::new(&one, 3, &Default::default()).unwrap();
    let mut changed = ids.clone();
    changed[0] = 40;
    let a = m1.forward(tokens(&ids)).narrow(1, 12, 1);
    let b = m1.forward(tokens(&changed)).narrow(1, 12, 1);
    assert_eq!((a - b).abs().max().into_scalar(), 0.0);
    let a = m1.forward(tokens(&ids)).narrow(1, 5, 1);
    let b = m1.forward(tokens(&changed)).narrow(1, 5, 1);
    assert!((a - b).abs().max().into_scalar() > 1e-5, "position 5 still sees token 0");
}

#[test]
fn bf16_parameters_give_logits_close_to_f32() {
    let ids: Vec<u32> = (0..12).map(|i| (i * 3 + 2) % 41).collect();
    let cfg = config(2, RopeLayout::HalfSplit);
    let model = Decoder::<B>::new(&cfg, 3, &Default::default()).unwrap();
    let want = model.forward(tokens(&ids));
    let half = model.clone().with_param_dtype(DType::BF16);
    let ember_model::Weight::Dense(table) = &half.embed_tokens else { panic!("a dense table") };
    assert_eq!(table.val().dtype(), DType::BF16);
    for compute in [DType::F32, DType::BF16] {
        let got = half.clone().with_compute(Compute::default().with_dtype(compute)).forward(tokens(&ids));
        assert_eq!(got.dtype(), DType::F32);
        let diff = (got - want.clone()).abs().max().into_scalar();
        let scale = want.clone().abs().max().into_scalar();
        assert!(diff < 0.05 * scale, "{compute:?}: {diff} against logits up to {scale}");
    }
}

/// A model whose weights are bf16 values (a bf16 file loaded as f32) keeps its projections in
/// bf16 for inference: q, k, v, o, gate, up, down and an untied head narrowed, norms, biases and a
/// tied table left in f32; cached decoding then multiplies the stored bf16 values (the few-rows
/// kernel) and gives the f32 model's logits up to summation order, and its greedy tokens.
#[test]
fn bf16_projections_decode_as_their_f32_widening() {
    let ids: Vec<u32> = (0..10).map(|i| (i * 5 + 1) % 41).collect();
    for tie in [true, false] {
        let cfg = ModelConfig { tie_embeddings: tie, ..config(2, RopeLayout::HalfSplit) };
        let model = Decoder::<B>::new(&cfg, 7, &Default::default()).unwrap();
        let model = model.with_param_dtype(DType::BF16).with_param_dtype(DType::F32);
        let half = model.clone().with_bf16_projections();
        let mut narrowed = Vec::new();
        for (path, data) in ember_model::weights::named_tensors::<B, _>(&half) {
            let projection = path.ends_with("_proj.weight") || path == "lm_head.weight";
            assert_eq!(data.dtype == DType::BF16, projection, "tie {tie}: {path} is {:?}", data.dtype);
            narrowed.push(path);
        }
        assert!(narrowed.iter().any(|p| p == "layers.0.mlp.down_proj.weight"));
        assert_eq!(narrowed.iter().any(|p| p == "lm_head.weight"), !tie);
        // Cached decoding, a token at a time (the few-rows path), against the f32 model.
        let (mut want_cache, mut got_cache) = (model.new_cache(1, 4), half.new_cache(1, 4));
        let step = |m: &Decoder<B>, id: u32, cache: &mut KvCache<B>| {
            let h = m.forward_cached(tokens(&[id]), &[1], cache);
            m.logits(h.reshape([1, cfg.d_model]))
        };
        for &id in &ids {
            let want = step(&model, id, &mut want_cache);
            let got = step(&half, id, &mut got_cache);
            let scale = want.clone().abs().max().into_scalar();
            let diff = (got - want).abs().max().into_scalar();
            assert!(diff <= 1e-4 * scale.max(1.0), "tie {tie}: {diff} against logits up to {scale}");
        }
        let greedy = || Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() }, 0).unwrap();
        let options = GenerateOptions { max_new_tokens: 12, stop_tokens: vec![], block_size: 4 };
        let run = |m: &Decoder<B>| generate_batch(m, &[ids.clone()], &options, &mut [greedy()], |_, _| true).unwrap();
        assert_eq!(run(&half), run(&model), "tie {tie}");
    }
}

#[test]
fn a_batch_of_prompts_generates_what_each_prompt_generates_alone() {
    let cfg = config(2, RopeLayout::HalfSplit);
    let model = Decoder::<B>::new(&cfg, 5, &Default::default()).unwrap();
    let prompts: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![7], vec![4, 9, 16, 25, 36, 8, 2], vec![30, 31]];
    let greedy = || Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() }, 0).unwrap();
    let options = GenerateOptions { max_new_tokens: 12, stop_tokens: vec![], block_size: 4 };
    let mut samplers: Vec<Sampler> = prompts.iter().map(|_| greedy()).collect();
    let batch = generate_batch(&model, &prompts, &options, &mut samplers, |_, _| true).unwrap();
    for (p, got) in prompts.iter().zip(&batch) {
        let alone = generate_batch(&model, std::slice::from_ref(p), &options, &mut [greedy()], |_, _| true).unwrap();
        assert_eq!(got, &alone[0], "prompt {p:?}");
        // The uncached reference produces the same tokens too.
        let reference = generate(&model, p, 12, &mut greedy(), |_| true).unwrap();
        assert_eq!(got, &reference, "prompt {p:?} against the uncached path");
        assert_eq!(got.len(), 12);
    }
}

#[test]
fn sequences_stop_on_their_own() {
    let cfg = config(2, RopeLayout::HalfSplit);
    let model = Decoder::<B>::new(&cfg, 5, &Default::default()).unwrap();
    let prompts: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![7, 8]];
    let greedy = || Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() }, 0).unwrap();
    let free = GenerateOptions { max_new_tokens: 10, stop_tokens: vec![], block_size: 8 };
    let runs = generate_batch(&model, &prompts, &free, &mut [greedy(), greedy()], |_, _| true).unwrap();
    // Stop the first sequence at the third token of its free run; the second goes on unchanged.
    let stop = runs[0][2];
    let first_stop = runs[0].iter().position(|&t| t == stop).unwrap();
    let options = GenerateOptions { stop_tokens: vec![stop], ..free.clone() };
    let got = generate_batch(&model, &prompts, &options, &mut [greedy(), greedy()], |_, _| true).unwrap();
    assert_eq!(got[0], runs[0][..=first_stop].to_vec());
    let second_stop = runs[1].iter().position(|&t| t == stop).map_or(10, |i| i + 1);
    assert_eq!(got[1], runs[1][..second_stop].to_vec());
    // The callback can end one sequence early.
    let got = generate_batch(&model, &prompts, &free, &mut [greedy(), greedy()], |b, _| b != 1).unwrap();
    assert_eq!(got[1].len(), 1);
    assert_eq!(got[0], runs[0]);
    // A prompt longer than the context is an error that says so.
    let long = vec![vec![1u32; 41]];
    let e = generate_batch(&model, &long, &free, &mut [greedy()], |_, _| true).unwrap_err();
    assert_eq!(e.to_string(), "prompt 0 has 41 tokens, more than the model's context of 40");
    // Generation goes on past the context, from the last three quarters of it.
    let near = vec![vec![1u32; 37]];
    let long = GenerateOptions { max_new_tokens: 30, ..free.clone() };
    let got = generate_batch(&model, &near, &long, &mut [greedy()], |_, _| true).unwrap();
    assert_eq!(got[0].len(), 30);
    // Up to the refill the tokens are those of a model with room to spare.
    let roomy = Decoder::<B>::new(&ModelConfig { max_seq_len: 80, ..cfg.clone() }, 5, &Default::default()).unwrap();
    let free_run = generate_batch(&roomy, &near, &long, &mut [greedy()], |_, _| true).unwrap();
    assert_eq!(got[0][..4], free_run[0][..4]);
}

/// A prefix shared by several sequences (`KvCache::share_prefix`): each continues it as if it had
/// computed it itself, the prefix's blocks are held once (a partly filled one copied by each
/// sequence that writes into it but the last), and a block goes back to the pool only when the last
/// sequence holding it lets it go. A sequence shared with itself keeps its first positions only.
#[test]
fn shared_prefixes_continue_as_their_own_and_are_held_once() {
    let model = Decoder::<B>::new(&config(2, RopeLayout::HalfSplit), 5, &Default::default()).unwrap();
    let prefix: Vec<u32> = (0..11).map(|i| (i * 5 + 1) % 41).collect(); // 2 full blocks of 4, 3 more
    let tails: [Vec<u32>; 3] = [vec![7, 8, 9], vec![3], vec![20, 21, 22, 23, 24, 25]];
    let mut cache = model.new_cache(3, 4);
    let _ = model.forward_cached_rows(tokens(&prefix), &[0], &[prefix.len()], &mut cache);
    cache.share_prefix(0, 1, prefix.len());
    cache.share_prefix(0, 2, prefix.len());
    assert_eq!(cache.held_blocks(), 3, "the prefix's 3 blocks, held by all three");
    let continues = |cache: &mut KvCache<B>, row: usize, prefix: &[u32], tail: &[u32]| {
        let hidden = model.forward_cached_rows(tokens(tail), &[row], &[tail.len()], cache);
        let cached = model.logits(hidden.reshape([tail.len(), model.config().d_model]));
        let whole: Vec<u32> = prefix.iter().chain(tail).copied().collect();
        let full = model.forward(tokens(&whole)).reshape([whole.len(), model.config().vocab_size]);
        let full = full.slice([prefix.len()..whole.len()]);
        assert!(max_abs_diff(cached, full) < 1e-4, "sequence {row}");
    };
    for (row, tail) in tails.iter().enumerate() {
        continues(&mut cache, row, &prefix, tail);
    }
    assert_eq!(cache.lens(), &[11 + 3, 11 + 1, 11 + 6]);
    // The 2 full blocks shared; the third copied by sequences 0 and 1 and written in place by 2,
    // the last to hold it; then each sequence's blocks past it (1, 0 and 2).
    assert_eq!(cache.held_blocks(), 2 + 2 + 1 + 3);
    // Sequence 1 keeps 9 of its positions (in the shared blocks, the third its own) and continues
    // from there.
    cache.share_prefix(1, 1, 9);
    assert_eq!(cache.lens()[1], 9);
    continues(&mut cache, 1, &prefix[..9], &[30, 31]);
    let held = cache.held_blocks();
    cache.reset(0);
    cache.reset(1);
    // Sequence 2 still holds the shared blocks and its own.
    assert_eq!(cache.held_blocks(), (11 + 6usize).div_ceil(4));
    assert!(held > cache.held_blocks());
    cache.reset(2);
    assert_eq!(cache.held_blocks(), 0);
}

/// A cache in f16 stores each key and value rounded (half the bytes): its logits stay within that
/// rounding of the full forward pass, and a sequence that continues a shared prefix (the blocks
/// held once, the partly filled one copied) gets the bits it gets alone in an f16 cache.
#[test]
fn an_f16_cache_decodes_within_its_rounding_and_shares_prefixes_exactly() {
    let cfg = config(2, RopeLayout::HalfSplit);
    let model = Decoder::<B>::new(&cfg, 5, &Default::default())
        .unwrap()
        .with_compute(Compute::default().with_kv_cache(DType::F16));
    let v = cfg.vocab_size;
    let ids: Vec<u32> = (0..23).map(|i| (i * 7 + 3) % 41).collect();
    let full = model.forward(tokens(&ids)).reshape([ids.len(), v]);
    let mut cache = model.new_cache(1, 4);
    assert_eq!(cache.dtype(), DType::F16);
    let f32_model = Decoder::<B>::new(&cfg, 5, &Default::default()).unwrap();
    let mut f32_cache = f32_model.new_cache(1, 4);
    let (mut worst, mut moved) = (0f32, 0f32);
    let _ = model.forward_cached(tokens(&ids[..5]), &[5], &mut cache);
    let _ = f32_model.forward_cached(tokens(&ids[..5]), &[5], &mut f32_cache);
    for i in 5..ids.len() {
        let got =
            model.logits(model.forward_cached(tokens(&ids[i..i + 1]), &[1], &mut cache).reshape([1, cfg.d_model]));
        let exact = f32_model
            .logits(f32_model.forward_cached(tokens(&ids[i..i + 1]), &[1], &mut f32_cache).reshape([1, cfg.d_model]));
        worst = worst.max(max_abs_diff(got.clone(), full.clone().narrow(0, i, 1)));
        moved = moved.max(max_abs_diff(got, exact));
    }
    let scale: f32 = full.clone().abs().max().into_scalar();
    assert!(worst < 5e-3 * scale.max(1.0), "f16 cache: {worst} off the full forward (logits up to {scale})");
    assert!(moved > 0.0, "the f16 cache computed the f32 cache's bits: nothing was rounded");

    // Sequence 1 continues sequence 0's 11-position prefix (2 full blocks and a partial one);
    // sequence 2 computes the same 14 positions alone.
    let (prefix, tail) = (&ids[..11], &ids[11..14]);
    let mut cache = model.new_cache(3, 4);
    let _ = model.forward_cached_rows(tokens(prefix), &[0], &[11], &mut cache);
    cache.share_prefix(0, 1, 11);
    let shared = model.forward_cached_rows(tokens(tail), &[1], &[3], &mut cache);
    let _ = model.forward_cached_rows(tokens(prefix), &[2], &[11], &mut cache);
    let alone = model.forward_cached_rows(tokens(tail), &[2], &[3], &mut cache);
    assert_eq!(shared.into_data().to_vec::<f32>().unwrap(), alone.into_data().to_vec::<f32>().unwrap());
    // Sequence 0 continues with its own tail after the copy: the full forward's logits.
    let other = [9u32, 10];
    let h = model.forward_cached_rows(tokens(&other), &[0], &[2], &mut cache);
    let got = model.logits(h.reshape([2, cfg.d_model]));
    let whole: Vec<u32> = prefix.iter().chain(&other).copied().collect();
    let want = model.forward(tokens(&whole)).reshape([whole.len(), v]).slice([11..13]);
    assert!(max_abs_diff(got, want) < 5e-3 * scale.max(1.0), "sequence 0 after the copy");
}
