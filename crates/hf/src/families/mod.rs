//! The model families, one file each, and their registry: each file holds its families' tensor
//! names (Hugging Face, ember, GGUF, and which GGUF tensors may stay in their stored type), their
//! `config.json` keys read and written, their GGUF metadata read and written and what llama.cpp's
//! architecture can hold, and the hooks the shared readers call (which GGUF files are theirs, how
//! their files spell the tokenizer). [`FAMILIES`] lists them, one line each. The shared readers and
//! writers (`config_map`, `weights`, `gguf`) ask a family through its [`Architecture`] handle
//! ([`Architecture::family`], [`Architecture::gguf`]) and name none.
//!
//! A family's table extends the groups of [`llama`]'s (its attention, norms, head and MLP) with
//! its own. A new family is a file here with its [`Registration`], its `mod` line and its line in
//! [`FAMILIES`]: nothing else in the crate changes.

pub mod deepseek;
pub mod experts;
pub mod gemma3;
pub mod gpt2;
pub mod llama;
pub mod qwen;

use ember_model::ModelConfig;

use crate::family::{Architecture, Family};
use crate::gguf::hparams::GgufRules;
use crate::gguf::tokenizer::VocabRules;
use crate::gguf::{GgufError, GgufFile};

/// A family as registered: its Hugging Face side and its GGUF side.
pub struct Registration {
    /// Its `config.json` keys, parts and tensor names.
    pub hf: Family,
    /// What it adds to llama.cpp's shared keys and tensors.
    pub gguf: GgufRules,
}

impl Registration {
    /// The handle of the family.
    pub const fn architecture(&'static self) -> Architecture {
        Architecture::of(&self.hf)
    }
}

/// Every family. The order decides between families that could both take a model or a file:
/// [`Architecture::for_model`] and [`Architecture::from_gguf`] take the first (Llama before
/// Mistral and Mixtral, which llama.cpp's `llama` also holds).
pub const FAMILIES: &[&Registration] = &[
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

/// `names` as a message lists them: "a, b and c".
fn listed(names: &[&str]) -> String {
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.join(""),
    }
}

impl Architecture {
    /// Its family's registration.
    fn registration(self) -> &'static Registration {
        let class = self.class_name();
        FAMILIES.into_iter().find(|f| f.hf.class_name == class).expect("every architecture is registered")
    }

    /// What its family adds to llama.cpp's shared keys.
    pub fn gguf(self) -> &'static GgufRules {
        &self.registration().gguf
    }

    /// The architecture a GGUF file's `general.architecture` names, if ember maps it: the first
    /// family of llama.cpp's architecture (`llama` is Llama's, not Mistral's).
    pub fn from_gguf(name: &str) -> Option<Self> {
        FAMILIES.into_iter().find(|f| !f.hf.gguf_arch.is_empty() && f.hf.gguf_arch == name).map(|f| f.architecture())
    }

    /// The family GGUF file `f` of llama.cpp's architecture `name` holds: the first of that
    /// architecture's that claims the file ([`GgufRules::claims`]: llama.cpp's `llama` with experts
    /// is Mixtral, its `deepseek2` with selection biases DeepSeek-V3); `None` for a name no family has.
    pub fn of_gguf_file(name: &str, f: &GgufFile) -> Result<Option<Self>, GgufError> {
        for r in FAMILIES.into_iter().filter(|r| !r.hf.gguf_arch.is_empty() && r.hf.gguf_arch == name) {
            if (r.gguf.claims)(f)? {
                return Ok(Some(r.architecture()));
            }
        }
        Ok(Self::from_gguf(name))
    }

    /// The architecture of a `architectures[0]` class name, if ember supports it.
    pub fn from_class(name: &str) -> Option<Self> {
        FAMILIES.into_iter().find(|f| f.hf.class_name == name).map(|f| f.architecture())
    }

    /// Every class name ember reads, as an error message lists them.
    pub fn supported_classes() -> String {
        listed(&FAMILIES.iter().map(|f| f.hf.class_name).collect::<Vec<_>>())
    }

    /// Every GGUF architecture ember reads (each once), as an error message lists them.
    pub fn supported_gguf() -> String {
        let mut names: Vec<&str> = Vec::new();
        for f in FAMILIES.into_iter().filter(|f| !f.hf.gguf_arch.is_empty()) {
            if !names.contains(&f.hf.gguf_arch) {
                names.push(f.hf.gguf_arch);
            }
        }
        listed(&names)
    }

    /// How files of llama.cpp's architecture `name` spell their vocabulary: their family's rules;
    /// for an architecture ember reads no model of, those of the family that names it in
    /// [`VocabRules::also_in`], without its chat template; else the plain ones.
    pub fn vocab_rules(name: &str) -> VocabRules {
        if let Some(arch) = Self::from_gguf(name) {
            return arch.gguf().vocab;
        }
        let kin = FAMILIES.into_iter().map(|f| f.gguf.vocab).find(|v| v.also_in.contains(&name));
        kin.map_or(VocabRules::SCORES, |v| VocabRules { chat_template: None, ..v })
    }

    /// The family an ember model exports as: the first family built from its parts (and its
    /// activation) whose [`Family::exports`] takes it (GPT-2 for LayerNorm and learned positions,
    /// Gemma 3 for Gemma's norms, Qwen3 for q/k norms; among Llama's parts, Qwen2 with q/k/v bias,
    /// Mistral with a sliding window, Llama otherwise); a model no family is built from goes to the
    /// first whose `exports` takes it all the same (latent attention to DeepSeek, experts to a
    /// family with experts, a dense model to Llama's), and `config_map::expressible` says why it fails.
    pub fn for_model(c: &ModelConfig) -> Self {
        let built_from = |f: &Family| f.parts.of(c) && f.activations.iter().any(|&(_, m)| m == c.mlp);
        let takes = || FAMILIES.into_iter().filter(|f| (f.hf.exports)(c));
        let found = takes().find(|f| built_from(&f.hf)).or_else(|| takes().next());
        found.copied().unwrap_or(FAMILIES[0]).architecture()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_model::{MlaConfig, MlpKind, MoeConfig, NormKind};

    /// A model no family is built from goes to the family of its structure: latent attention to
    /// DeepSeek, experts to a family with experts, whole q/k norms to OLMoE, a dense model to Llama's.
    #[test]
    fn a_model_no_family_is_built_from_exports_as_its_structure_says() {
        let gemma_norms = ModelConfig { norm: NormKind::RmsNormPlusOne, ..ModelConfig::tiny(64, 2) };
        let moe = Some(MoeConfig { n_experts: 4, top_k: 2, d_expert: 8, ..Default::default() });
        let mla = Some(MlaConfig { q_rank: None, kv_rank: 4, nope_dim: 4, rope_dim: 4, v_dim: 4, norm_eps: 1e-6 });
        let cases = [
            (gemma_norms.clone(), llama::LLAMA.architecture()),
            (ModelConfig { qkv_bias: true, ..gemma_norms.clone() }, qwen::QWEN2.architecture()),
            (ModelConfig { moe: moe.clone(), ..gemma_norms.clone() }, experts::MIXTRAL.architecture()),
            (ModelConfig { mlp: MlpKind::Gelu, mla, ..ModelConfig::tiny(64, 2) }, deepseek::DEEPSEEK_V2.architecture()),
            (
                ModelConfig { qk_norm: true, qk_norm_whole: true, ..ModelConfig::tiny(64, 2) },
                experts::OLMOE.architecture(),
            ),
            (ModelConfig { qk_norm: true, moe, ..ModelConfig::tiny(64, 2) }, experts::QWEN3_MOE.architecture()),
        ];
        for (c, arch) in cases {
            assert_eq!(Architecture::for_model(&c), arch, "{c:?}");
        }
    }

    /// The lists in the errors are the registry's, each name once.
    #[test]
    fn the_supported_lists_come_from_the_registry() {
        assert_eq!(
            Architecture::supported_gguf(),
            "llama, qwen2, qwen3, gemma3, gpt2, qwen2moe, qwen3moe, olmoe and deepseek2"
        );
        assert!(Architecture::supported_classes().starts_with("LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"));
        assert_eq!(Architecture::vocab_rules("gemma2").chat_template, None, "Gemma 2 files get no Gemma 3 template");
        assert!(Architecture::vocab_rules("gemma3").chat_template.is_some());
    }
}
