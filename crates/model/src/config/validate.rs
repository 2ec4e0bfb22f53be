//! A config's rules, checked before anything is built: sizes within ember's limits, each part's
//! own rules, then the rules between parts.

use super::{ConfigError, MlpKind, ModelConfig, NormKind, RopeScaling};

/// Upper bounds on a config's sizes, checked before anything is allocated: far above any released
/// model of this family (Llama 3 405B: d_model 16,384, 126 layers, 128 heads, d_ff 53,248; Gemma's
/// 262,144-token vocabulary; 1M-token contexts), low enough that products of them cannot overflow.
pub(crate) const LIMITS: [(&str, u64); 8] = [
    ("vocab_size", 1 << 24),
    ("d_model", 1 << 16),
    ("n_layers", 1 << 10),
    ("n_heads", 1 << 10),
    ("n_kv_heads", 1 << 10),
    ("head_dim", 1 << 12),
    ("d_ff", 1 << 20),
    ("max_seq_len", 1 << 20),
];

/// Parameters a config may describe (4.4 trillion).
pub(crate) const MAX_PARAMS: u64 = 1 << 42;

impl ModelConfig {
    /// Checks every rule `init` relies on, so that building never panics on a bad config: the
    /// sizes, then each part's own rules, then the model-wide ones.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_sizes()?;
        if self.n_kv_heads() == 0 {
            return Err(ConfigError::NotPositive { name: "n_kv_heads", value: 0.0 });
        }
        if self.head_dim.is_none() && !self.d_model.is_multiple_of(self.n_heads) {
            return Err(ConfigError::NotDivisible {
                divisor: "n_heads",
                divisor_value: self.n_heads,
                dividend: "d_model",
                dividend_value: self.d_model,
            });
        }
        self.block(0).validate()?;
        self.block(self.n_layers - 1).validate()?;
        self.validate_latent()?;
        if let Some(moe) = &self.moe {
            moe.validate()?; // also when every layer is dense
            if moe.dense_layers > self.n_layers {
                return Err(ConfigError::Needs { key: "moe.dense_layers", needs: "a value no larger than n_layers" });
            }
        }
        if let Some(scaling) = &self.rope_scaling {
            validate_rope_scaling(scaling)?;
        }
        let optional = [
            ("rope_local_theta", self.rope_local_theta),
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("attn_logit_softcap", self.attn_logit_softcap),
            ("final_logit_softcap", self.final_logit_softcap),
        ];
        let given = optional.into_iter().filter_map(|(name, value)| Some((name, value?)));
        for (name, value) in [("rope_theta", self.rope_theta), ("init_std", self.init_std)].into_iter().chain(given) {
            if !(value > 0.0 && value.is_finite()) {
                return Err(ConfigError::NotPositive { name, value });
            }
        }
        if self.sliding_window_pattern == Some(0) {
            return Err(ConfigError::NotPositive { name: "sliding_window_pattern", value: 0.0 });
        }
        if self.moe.is_some() && (self.mlp != MlpKind::Swiglu || self.mlp_bias) {
            return Err(ConfigError::Needs {
                key: "moe",
                needs: "mlp = \"swiglu\" without mlp_bias (the experts are SwiGLU)",
            });
        }
        if self.qk_norm_whole && !self.qk_norm {
            return Err(ConfigError::Needs { key: "qk_norm_whole", needs: "qk_norm" });
        }
        if self.norm_bias && self.norm != NormKind::LayerNorm {
            return Err(ConfigError::Needs { key: "norm_bias", needs: "norm = \"layer_norm\"" });
        }
        // Both describe the local layers of a windowed model: without a window every layer is global.
        for (key, given) in [
            ("sliding_window_pattern", self.sliding_window_pattern.is_some()),
            ("rope_local_theta", self.rope_local_theta.is_some()),
        ] {
            if given && self.sliding_window.is_none() {
                return Err(ConfigError::Needs { key, needs: "sliding_window" });
            }
        }
        let params = self.num_params();
        if params > MAX_PARAMS {
            return Err(ConfigError::TooLarge { name: "parameter count", value: params, limit: MAX_PARAMS });
        }
        Ok(())
    }

    /// With `[model.mla]`, none of the options latent attention has no place for: a window, q/k
    /// norms, soft-capped scores; key/value heads, if given, still divide the query heads (a
    /// config written back names them, and an export writes them).
    fn validate_latent(&self) -> Result<(), ConfigError> {
        if self.mla.is_none() {
            return Ok(());
        }
        let kv_heads = self.n_kv_heads();
        if kv_heads > 0 && !self.n_heads.is_multiple_of(kv_heads) {
            return Err(ConfigError::NotDivisible {
                divisor: "n_kv_heads",
                divisor_value: kv_heads,
                dividend: "n_heads",
                dividend_value: self.n_heads,
            });
        }
        let other = [
            ("sliding_window", self.sliding_window.is_some()),
            ("qk_norm", self.qk_norm),
            ("attn_logit_softcap", self.attn_logit_softcap.is_some()),
        ];
        match other.into_iter().find(|&(_, set)| set) {
            Some((key, _)) => Err(ConfigError::Needs { key, needs: "plain attention (not [model.mla])" }),
            None => Ok(()),
        }
    }

    /// Every size positive (the vocabulary set) and within [`LIMITS`].
    fn validate_sizes(&self) -> Result<(), ConfigError> {
        if self.vocab_size == 0 {
            return Err(ConfigError::VocabUnset);
        }
        let sizes = [
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("d_ff", self.d_ff),
            ("max_seq_len", self.max_seq_len),
        ];
        if let Some((name, _)) = sizes.into_iter().find(|&(_, value)| value == 0) {
            return Err(ConfigError::NotPositive { name, value: 0.0 });
        }
        let values = [
            self.vocab_size,
            self.d_model,
            self.n_layers,
            self.n_heads,
            self.n_kv_heads(),
            self.head_dim.unwrap_or(0),
            self.d_ff,
            self.max_seq_len,
        ];
        for ((name, limit), value) in LIMITS.into_iter().zip(values) {
            if value as u64 > limit {
                return Err(ConfigError::TooLarge { name, value: value as u64, limit });
            }
        }
        Ok(())
    }
}

/// Checks Hugging Face's `rope_scaling` factors: each positive and finite, the high-frequency
/// factor above the low one.
fn validate_rope_scaling(scaling: &RopeScaling) -> Result<(), ConfigError> {
    let factors: Vec<(&'static str, f64)> = match *scaling {
        RopeScaling::Linear { factor } => vec![("rope_scaling.factor", factor)],
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            vec![
                ("rope_scaling.factor", factor),
                ("rope_scaling.low_freq_factor", low_freq_factor),
                ("rope_scaling.high_freq_factor - low_freq_factor", high_freq_factor - low_freq_factor),
                ("rope_scaling.original_max_position_embeddings", original_max_position_embeddings as f64),
            ]
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            mscale,
            mscale_all_dim,
            ..
        } => vec![
            ("rope_scaling.factor", factor),
            ("rope_scaling.original_max_position_embeddings", original_max_position_embeddings as f64),
            ("rope_scaling.beta_slow", beta_slow),
            ("rope_scaling.beta_fast - beta_slow", beta_fast - beta_slow),
            ("rope_scaling.attention_factor", attention_factor.unwrap_or(1.0)),
            // 0 is "not given" to Hugging Face; negative or not finite is no scale.
            ("rope_scaling.mscale", mscale.map_or(1.0, |m| if m == 0.0 { 1.0 } else { m })),
            ("rope_scaling.mscale_all_dim", mscale_all_dim.map_or(1.0, |m| if m == 0.0 { 1.0 } else { m })),
        ],
    };
    match factors.into_iter().find(|(_, v)| !(*v > 0.0 && v.is_finite())) {
        Some((name, value)) => Err(ConfigError::NotPositive { name, value }),
        None => Ok(()),
    }
}
