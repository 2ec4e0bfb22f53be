use super::*;

fn llama2_7b() -> ModelConfig {
    ModelConfig::llama(32_000, 4096, 32, 32, 11_008, 4096)
}

fn qwen25_05b() -> ModelConfig {
    ModelConfig {
        vocab_size: 151_936,
        d_model: 896,
        n_layers: 24,
        n_heads: 14,
        n_kv_heads: Some(2),
        d_ff: 4864,
        max_seq_len: 32_768,
        rope_theta: 1e6,
        norm_eps: 1e-6,
        qkv_bias: true,
        tie_embeddings: true,
        ..tiny_config()
    }
}

#[test]
fn published_parameter_counts() {
    // Llama 2 7B model card total; Qwen2.5-0.5B: 494,032,768 (tied embeddings, q/k/v bias).
    assert_eq!(llama2_7b().num_params(), 6_738_415_616);
    assert_eq!(qwen25_05b().num_params(), 494_032_768);
}

#[test]
fn flops_formula() {
    let c = tiny_config();
    let n = c.matmul_params() as f64;
    let t = 16;
    assert_eq!(c.train_flops_per_token(t), 6.0 * n + 12.0 * 2.0 * 16.0 * 32.0);
    // Tied: the head is the embedding table, still counted once as a matmul.
    let tied = ModelConfig { tie_embeddings: true, ..c.clone() };
    assert_eq!(tied.matmul_params(), c.matmul_params());
    assert_eq!(tied.num_params() + 32 * 37, c.num_params());
}

#[test]
fn validation_names_the_problem() {
    let c = ModelConfig { n_kv_heads: Some(3), ..tiny_config() };
    let e = c.validate().unwrap_err();
    assert_eq!(e.to_string(), "model.n_kv_heads (3) must divide model.n_heads (4)");
    let c = ModelConfig { n_heads: 5, n_kv_heads: Some(5), ..tiny_config() };
    assert!(matches!(c.validate(), Err(ConfigError::NotDivisible { divisor: "n_heads", .. })));
    let c = ModelConfig { vocab_size: 0, ..tiny_config() };
    assert_eq!(c.validate(), Err(ConfigError::VocabUnset));
    let c = ModelConfig { head_dim: Some(7), ..tiny_config() };
    assert_eq!(c.validate(), Err(ConfigError::OddHeadDim(7)));
    let c = ModelConfig { norm_eps: -1.0, ..tiny_config() };
    assert!(matches!(c.validate(), Err(ConfigError::NotPositive { name: "norm_eps", .. })));
    assert!(tiny_config().validate().is_ok());
}

#[test]
fn parts_get_their_configs_from_the_model_and_check_their_own_rules() {
    use crate::attention::GroupedConfig;
    use crate::block::BlockConfig;
    use crate::kinds::PartConfig;
    use crate::mlp::MlpConfig;
    use crate::norm::NormConfig;
    let c = ModelConfig::tiny(50, 16);
    let att = c.grouped_attention(0);
    assert_eq!((att.n_heads, att.n_kv_heads, att.head_dim), (4, 2, 8));
    assert!((att.out_std - 0.02 / 2.0).abs() < 1e-12, "GPT-2 residual init: 0.02 / sqrt(2·2)");
    assert!((att.scale - 1.0 / 8f64.sqrt()).abs() < 1e-15 && att.softcap.is_none() && att.qk_norm.is_none());
    assert_eq!(c.mlp().d_ff, 64);
    assert_eq!(c.norm(), NormConfig { eps: 1e-5, ..NormConfig::new(32) });
    c.block(0).validate().unwrap();

    let gqa = GroupedConfig { n_kv_heads: 3, ..GroupedConfig::new(32, 4) };
    let err = gqa.validate().unwrap_err().to_string();
    assert!(err.contains("n_kv_heads") && err.contains('3') && err.contains('4'), "{err}");
    let odd = GroupedConfig { head_dim: 7, ..GroupedConfig::new(32, 4) };
    assert!(matches!(odd.validate(), Err(ConfigError::OddHeadDim(7))));
    let err = MlpConfig::new(32, 0).validate().unwrap_err().to_string();
    assert!(err.contains("d_ff"), "{err}");
    let err = NormConfig { eps: 0.0, ..NormConfig::new(8) }.validate().unwrap_err().to_string();
    assert!(err.contains("norm_eps"), "{err}");
    let block = BlockConfig { dropout: 1.0, ..c.block(0) };
    assert!(matches!(block.validate(), Err(ConfigError::Dropout(_))));
    // A model config whose part breaks a rule is refused with the part's error.
    let bad = ModelConfig { n_kv_heads: Some(3), ..c };
    assert!(matches!(bad.validate(), Err(ConfigError::NotDivisible { divisor: "n_kv_heads", .. })));
}

#[test]
fn the_layer_pattern_and_the_scores_follow_the_config() {
    // Gemma 3's five local layers to one global.
    let c = ModelConfig {
        n_layers: 12,
        sliding_window: Some(4),
        sliding_window_pattern: Some(6),
        rope_local_theta: Some(10_000.0),
        rope_theta: 1e6,
        query_pre_attn_scalar: Some(16.0),
        attn_logit_softcap: Some(50.0),
        ..tiny_config()
    };
    let local: Vec<bool> = (0..12).map(|l| c.is_local(l)).collect();
    assert_eq!(local, [true, true, true, true, true, false, true, true, true, true, true, false]);
    let att = |l| c.grouped_attention(l);
    assert_eq!((att(0).sliding_window, att(5).sliding_window), (Some(4), None));
    assert_eq!((att(0).scale, att(0).softcap), (0.25, Some(50.0)));
    // Mistral: every layer local; no window: none.
    let mistral = ModelConfig { sliding_window: Some(4), ..tiny_config() };
    assert!((0..2).all(|l| mistral.is_local(l)) && !tiny_config().is_local(0));
    for (bad, name) in [
        (ModelConfig { sliding_window_pattern: Some(0), ..c.clone() }, "sliding_window_pattern"),
        (ModelConfig { query_pre_attn_scalar: Some(0.0), ..c.clone() }, "query_pre_attn_scalar"),
        (ModelConfig { final_logit_softcap: Some(f64::NAN), ..c.clone() }, "final_logit_softcap"),
    ] {
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains(name), "{e}");
    }
    let e = ModelConfig { qk_norm_whole: true, ..tiny_config() }.validate().unwrap_err().to_string();
    assert_eq!(e, "model.qk_norm_whole needs qk_norm");
    let whole = ModelConfig { qk_norm: true, qk_norm_whole: true, ..tiny_config() };
    // Norms over [H·Dh] and [K·Dh] = 32 + 16 a block, not 2·Dh = 16.
    assert_eq!(whole.num_params(), ModelConfig { qk_norm: true, ..tiny_config() }.num_params() + 2 * 32);
    let e = ModelConfig { norm_bias: true, ..tiny_config() }.validate().unwrap_err().to_string();
    assert_eq!(e, "model.norm_bias needs norm = \"layer_norm\"");
    // The local layers' keys without a window describe nothing.
    let e = ModelConfig { sliding_window: None, ..c.clone() }.validate().unwrap_err().to_string();
    assert_eq!(e, "model.sliding_window_pattern needs sliding_window");
    let e = ModelConfig { sliding_window: None, sliding_window_pattern: None, ..c }.validate().unwrap_err();
    assert_eq!(e.to_string(), "model.rope_local_theta needs sliding_window");
}

#[test]
fn parameter_counts_follow_the_parts() {
    // GPT-2 small: 124,439,808 parameters (Hugging Face's count, tied head).
    let gpt2 = ModelConfig {
        vocab_size: 50_257,
        d_model: 768,
        n_layers: 12,
        n_heads: 12,
        n_kv_heads: None,
        d_ff: 3072,
        max_seq_len: 1024,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        norm: NormKind::LayerNorm,
        norm_bias: true,
        mlp: MlpKind::Gelu,
        positions: Positions::Learned,
        tie_embeddings: true,
        ..tiny_config()
    };
    assert_eq!(gpt2.num_params(), 124_439_808);
    // Qwen3-0.6B: 596,049,920 (q/k norms, head_dim 128 over d_model 1024, tied).
    let qwen3 = ModelConfig {
        vocab_size: 151_936,
        d_model: 1024,
        n_layers: 28,
        n_heads: 16,
        n_kv_heads: Some(8),
        head_dim: Some(128),
        d_ff: 3072,
        max_seq_len: 40_960,
        qk_norm: true,
        tie_embeddings: true,
        ..tiny_config()
    };
    assert_eq!(qwen3.num_params(), 596_049_920);
    // Gemma-3-270M: 268,098,176 (four norms a block, q/k norms, GeGLU, tied 262,144 vocabulary).
    let gemma = ModelConfig {
        vocab_size: 262_144,
        d_model: 640,
        n_layers: 18,
        n_heads: 4,
        n_kv_heads: Some(1),
        head_dim: Some(256),
        d_ff: 2048,
        max_seq_len: 32_768,
        norm: NormKind::RmsNormPlusOne,
        mlp: MlpKind::Geglu,
        qk_norm: true,
        sandwich_norms: true,
        tie_embeddings: true,
        ..tiny_config()
    };
    assert_eq!(gemma.num_params(), 268_098_176);
}

#[test]
fn expert_parameter_counts_are_mixtral_s() {
    // Mixtral 8x7B: 46,702,792,704 in all; a token multiplies by 2 of the 8 experts (the
    // "12.9B active" counts the embedding too: 12,748,587,008 + 131,072,000).
    let mixtral = ModelConfig {
        vocab_size: 32_000,
        d_model: 4096,
        n_layers: 32,
        n_heads: 32,
        n_kv_heads: Some(8),
        d_ff: 14_336,
        max_seq_len: 32_768,
        moe: Some(MoeConfig {
            n_experts: 8,
            top_k: 2,
            d_expert: 14_336,
            norm_topk: true,
            shared_expert: None,
            shared_expert_gate: false,
            aux_loss_coef: 0.02,
            z_loss_coef: 0.0,
            ..Default::default()
        }),
        ..tiny_config()
    };
    mixtral.validate().unwrap();
    assert_eq!(mixtral.num_params(), 46_702_792_704);
    assert_eq!(mixtral.matmul_params(), 12_748_587_008);
    // The experts are SwiGLU: another MLP kind with them is refused by name.
    let e = ModelConfig { mlp: MlpKind::Gelu, ..mixtral }.validate().unwrap_err().to_string();
    assert!(e.starts_with("model.moe needs mlp = \"swiglu\""), "{e}");
}
