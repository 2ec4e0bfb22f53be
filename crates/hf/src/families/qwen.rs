//! Qwen2 (`Qwen2ForCausalLM`: Llama with q/k/v biases and an optional sliding window) and Qwen3
//! (`Qwen3ForCausalLM`: Qwen2 with per-head q/k norms, no q/k/v bias by default, an explicit
//! `head_dim`). Llama's tables; llama.cpp's `qwen2` and `qwen3` keep Hugging Face's q/k rows.

use ember_model::ModelConfig;
use serde_json::{json, Map, Value};

use super::llama::{llama_like, read_llama_like, LLAMA_PARTS};
use super::Registration;
use crate::config_json::{read_default_rope, rope_parameters, Reader};
use crate::error::HfError;
use crate::family::{dense, Family, Parts};
use crate::gguf::hparams::{ArchKeys, GgufRules};
use crate::gguf::GgufError;

/// Qwen2: `Qwen2ForCausalLM`, llama.cpp's `qwen2`. It exports a dense model with q/k/v bias.
pub const QWEN2: Registration = Registration {
    hf: llama_like("qwen2", "Qwen2ForCausalLM", "qwen2", (read_qwen2, write_qwen2), |c| dense(c) && c.qkv_bias),
    gguf: GgufRules { read: qkv_bias_gguf, ..GgufRules::DENSE },
};

/// Qwen3: `Qwen3ForCausalLM`, llama.cpp's `qwen3`.
pub const QWEN3: Registration = Registration {
    hf: Family {
        parts: Parts { qk_norm: true, ..LLAMA_PARTS },
        replaced_keys: &[&[
            "rope_scaling",
            "rope_theta",
            "rope_parameters",
            "sliding_window",
            "use_sliding_window",
            "attention_bias",
            "layer_types",
        ]],
        ..llama_like("qwen3", "Qwen3ForCausalLM", "qwen3", (read_qwen3, write_qwen3), dense)
    },
    gguf: GgufRules::DENSE,
};

/// llama.cpp's `qwen2` and `qwen2moe` always have the q/k/v biases.
pub(crate) fn qkv_bias_gguf(_: &ArchKeys, c: &mut ModelConfig) -> Result<(), GgufError> {
    c.qkv_bias = true;
    Ok(())
}

pub(crate) fn read_qwen2(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_llama_like(r, c, true)?;
    if r.flag("use_sliding_window") == Some(true) {
        c.sliding_window = r.opt_usize("sliding_window");
    }
    Ok(())
}

pub(crate) fn write_qwen2(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("use_sliding_window".into(), json!(c.sliding_window.is_some()));
    obj.insert("sliding_window".into(), json!(c.sliding_window));
}

pub(crate) fn read_qwen3(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    // `attention_bias` puts a bias on all four projections, o_proj included.
    let bias = r.flag("attention_bias").unwrap_or(false);
    (c.qkv_bias, c.o_bias) = (bias, bias);
    r.require("use_sliding_window", false, "ember reads Qwen3 without sliding windows")?;
    (c.rope_theta, c.rope_scaling) = read_default_rope(r)?;
    Ok(())
}

pub(crate) fn write_qwen3(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("attention_bias".into(), json!(c.qkv_bias));
    obj.insert("use_sliding_window".into(), json!(false));
    obj.insert("sliding_window".into(), Value::Null);
    obj.insert("layer_types".into(), json!(vec!["full_attention"; c.n_layers]));
}
