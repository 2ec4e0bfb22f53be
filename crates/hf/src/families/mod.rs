//! The model families, one file each, and their registry: each file holds its family's tensor
//! names (Hugging Face, ember, GGUF), its `config.json` keys read and written, and its GGUF
//! metadata read and written; [`FAMILIES`] lists them, one line each. The shared readers and
//! writers (`config_map`, `weights`, `gguf::model`) ask a family through
//! [`Architecture::family`] and [`Architecture::gguf`].
//!
//! A family's table extends the groups of [`llama`]'s (its attention, norms, head and MLP) with
//! its own. A new family is a file here with its [`Registration`], its `mod` line and its line in
//! [`FAMILIES`], and a variant of [`Architecture`].

pub mod deepseek;
pub mod experts;
pub mod gemma3;
pub mod gpt2;
pub mod llama;
pub mod qwen;

use ember_model::ModelConfig;

use crate::family::{Architecture, Family};
use crate::gguf::hparams::GgufRules;

/// A family as registered: its Hugging Face side and its GGUF side.
pub struct Registration {
    /// Its `config.json` keys, parts and tensor names.
    pub hf: Family,
    /// What it adds to llama.cpp's shared keys and tensors.
    pub gguf: GgufRules,
}

/// Every family, in the order [`Architecture::for_model`] prefers them.
pub const FAMILIES: [&Registration; 12] = [
    &llama::LLAMA,
    &qwen::QWEN2,
    &llama::MISTRAL,
    &qwen::QWEN3,
    &gemma3::GEMMA3,
    &gpt2::GPT2,
    &experts::MIXTRAL,
    &experts::QWEN2_MOE,
    &experts::QWEN3_MOE,
    &experts::OLMOE,
    &deepseek::DEEPSEEK_V2,
    &deepseek::DEEPSEEK_V3,
];

impl Architecture {
    /// Its family's registration.
    fn registration(self) -> &'static Registration {
        FAMILIES.into_iter().find(|f| f.hf.architecture == self).expect("every architecture is registered")
    }

    /// Its family: names, keys and parts.
    pub fn family(self) -> &'static Family {
        &self.registration().hf
    }

    /// What its family adds to llama.cpp's shared keys.
    pub fn gguf(self) -> &'static GgufRules {
        &self.registration().gguf
    }

    pub fn class_name(self) -> &'static str {
        self.family().class_name
    }

    pub fn model_type(self) -> &'static str {
        self.family().model_type
    }

    /// The architecture a GGUF file's `general.architecture` names, if ember maps it (`llama` is
    /// Llama's, not Mistral's).
    pub fn from_gguf(name: &str) -> Option<Self> {
        FAMILIES
            .into_iter()
            .map(|f| &f.hf)
            .find(|f| !f.gguf_arch.is_empty() && f.gguf_arch == name)
            .map(|f| f.architecture)
    }

    /// The architecture of a `architectures[0]` class name, if ember supports it.
    pub fn from_class(name: &str) -> Option<Self> {
        FAMILIES.into_iter().map(|f| &f.hf).find(|f| f.class_name == name).map(|f| f.architecture)
    }

    /// The family an ember model exports as: the one built from its parts (GPT-2 for LayerNorm and
    /// learned positions, Gemma 3 for Gemma's norms, Qwen3 for q/k norms); among Llama's, Qwen2
    /// when it has q/k/v bias, Mistral with a sliding window, Llama otherwise. A model no family
    /// is built from gets Llama's rule, and `config_map::expressible` says why it fails.
    pub fn for_model(c: &ModelConfig) -> Self {
        if c.mla.is_some() {
            let v3 = c.moe.as_ref().is_some_and(|m| m.scoring == ember_model::Scoring::Sigmoid || m.selection_bias);
            return if v3 { Self::DeepseekV3 } else { Self::DeepseekV2 };
        }
        if let Some(moe) = &c.moe {
            return match (c.qk_norm, moe.shared_expert.is_some() || c.qkv_bias) {
                (true, _) if c.qk_norm_whole => Self::Olmoe,
                (true, _) => Self::Qwen3Moe,
                (false, true) => Self::Qwen2Moe,
                (false, false) => Self::Mixtral,
            };
        }
        let llama = || {
            if c.qkv_bias {
                Self::Qwen2
            } else if c.sliding_window.is_some() {
                Self::Mistral
            } else {
                Self::Llama
            }
        };
        match FAMILIES
            .into_iter()
            .map(|f| &f.hf)
            .find(|f| f.parts.of(c) && f.activations.iter().any(|&(_, m)| m == c.mlp))
        {
            Some(f) if f.parts == llama::LLAMA_PARTS => llama(),
            Some(f) => f.architecture,
            None => llama(),
        }
    }
}
