//! What a model family is to ember: for each Hugging Face family it reads and writes, its class and
//! `model_type`, the `config.json` keys of its sizes and the parts its blocks are built from, the
//! functions that read and write its other keys, and how its tensor names map onto ember's
//! parameter paths. Each family fills one [`Family`] in its own file of `families/`, which also
//! holds its GGUF rules; the registry there lists them, one line each.
//!
//! | family        | class               | norms                  | MLP    | positions | file        |
//! |---------------|---------------------|------------------------|--------|-----------|-------------|
//! | `llama`       | `LlamaForCausalLM`  | RMSNorm                | SwiGLU | RoPE      | `llama.rs`  |
//! | `mistral`     | `MistralForCausalLM`| RMSNorm                | SwiGLU | RoPE      | `llama.rs`  |
//! | `qwen2`       | `Qwen2ForCausalLM`  | RMSNorm                | SwiGLU | RoPE      | `qwen.rs`   |
//! | `qwen3`       | `Qwen3ForCausalLM`  | RMSNorm, q/k norms     | SwiGLU | RoPE      | `qwen.rs`   |
//! | `gemma3_text` | `Gemma3ForCausalLM` | RMSNorm (1 + w), q/k, sandwich | GeGLU | RoPE, two bases | `gemma3.rs` |
//! | `gpt2`        | `GPT2LMHeadModel`   | LayerNorm with bias    | GELU   | learned   | `gpt2.rs`   |
//! | `mixtral`     | `MixtralForCausalLM`| RMSNorm                | experts | RoPE     | `experts.rs` |
//! | `qwen2_moe`   | `Qwen2MoeForCausalLM` | RMSNorm              | experts, shared | RoPE | `experts.rs` |
//! | `qwen3_moe`   | `Qwen3MoeForCausalLM` | RMSNorm, q/k norms   | experts | RoPE     | `experts.rs` |
//! | `olmoe`       | `OlmoeForCausalLM`  | RMSNorm, whole q/k norms | experts | RoPE   | `experts.rs` |
//! | `deepseek_v2` | `DeepseekV2ForCausalLM` | RMSNorm, latent attention | dense, then experts, shared | RoPE (interleaved) | `deepseek.rs` |
//! | `deepseek_v3` | `DeepseekV3ForCausalLM` | RMSNorm, latent attention | dense, then experts (sigmoid), shared | RoPE (interleaved), YaRN | `deepseek.rs` |
//!
//! A tensor rule pairs a Hugging Face name with ember path(s) and with llama.cpp's GGUF name; `{i}`
//! stands for the layer index. The [`Layout`] says how the values move between Hugging Face and
//! ember: as they are, transposed (Hugging Face's `nn.Linear` is `[out, in]`, ember's `[in, out]`),
//! several ember tensors side by side in one file tensor (GPT-2's `c_attn` holds q, k and v; its
//! `Conv1D` weights are already `[in, out]`), or a norm's gain (as it is, in the family's storage of
//! gains). A GGUF tensor holds the Hugging Face one's values, transposed for GPT-2's `Conv1D`
//! weights (llama.cpp keeps every matrix `[out, in]`), and each RMSNorm gain as the factor it
//! multiplies by: Gemma's `1 + w` (see [`Parts::holds_norm`] for how ember keeps those). Experts are
//! one tensor per expert in the file (`{j}` their index) and one stacked `[E, in, out]` parameter in
//! ember ([`Layout::Experts`]).

use ember_model::{MlpKind, ModelConfig, NormKind, Positions};
use serde_json::{Map, Value};

use crate::config_json::Reader;
use crate::error::HfError;

/// A model family ember reads and writes: a handle to its [`Family`] in the registry
/// (`families::FAMILIES`, which also holds its GGUF rules), told apart by its class name. Adding a
/// family adds no variant here: its file registers it.
#[derive(Clone, Copy)]
pub struct Architecture(&'static Family);

impl Architecture {
    /// The handle of `family`, one of the registry's.
    pub(crate) const fn of(family: &'static Family) -> Self {
        Self(family)
    }

    /// Its family: names, keys and parts.
    pub fn family(self) -> &'static Family {
        self.0
    }

    pub fn class_name(self) -> &'static str {
        self.0.class_name
    }

    pub fn model_type(self) -> &'static str {
        self.0.model_type
    }
}

impl PartialEq for Architecture {
    fn eq(&self, other: &Self) -> bool {
        self.0.class_name == other.0.class_name
    }
}

impl Eq for Architecture {}

impl std::fmt::Debug for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.class_name)
    }
}

/// How a family's config.json and tensors map onto ember's. Each family's is in its file of
/// `families/`.
pub struct Family {
    /// llama.cpp's `general.architecture` for the family (Mistral is a `llama` to llama.cpp).
    pub gguf_arch: &'static str,
    /// `architectures[0]` of its config.json.
    pub class_name: &'static str,
    pub model_type: &'static str,
    /// The keys of the sizes.
    pub keys: SizeKeys,
    /// What every model of the family is built from.
    pub parts: Parts,
    /// The values of the activation key, and the MLP each means (the first is the default).
    pub activations: &'static [(&'static str, MlpKind)],
    /// Reads the family's other keys (biases, RoPE, windows, soft caps) into a config that already
    /// holds the sizes and the parts.
    pub read: ReadKeys,
    /// Writes them.
    pub write: WriteKeys,
    /// Keys of a base config.json that `write` replaces, removed first so that none goes stale.
    pub replaced_keys: &'static [&'static [&'static str]],
    /// The tensor names, in groups (the attention's and the MLP's or the experts').
    pub tensors: &'static [&'static [Rule]],
    /// Name endings of tensors some checkpoints carry that are not parameters.
    pub buffers: &'static [&'static str],
    /// A prefix the names may carry or lack (GPT-2's `transformer.`: Hub files have bare names,
    /// transformers writes the prefix, as an export does).
    pub optional_prefix: Option<&'static str>,
    /// The name an export writes for the tensor the family's rules name `name`, given the model
    /// (DeepSeek's query is `q_b_proj` when it is low-rank); [`same_name`] for most.
    pub export_name: fn(&ModelConfig, String) -> String,
    /// Whether an ember model that names no family (one trained from scratch) exports as this one,
    /// the parts aside: [`Architecture::for_model`] takes the first family whose parts and
    /// activation the model has and this says yes, else the first this says yes to.
    pub exports: fn(&ModelConfig) -> bool,
    /// Whether config.json holds the balancing loss's weight (`router_aux_loss_coef`); DeepSeek's
    /// does not (transformers computes no such loss for it): the weight is training's.
    pub aux_loss_in_config: bool,
}

/// Reads a family's own `config.json` keys into a config that holds the sizes and the parts.
pub type ReadKeys = fn(&Reader, &mut ModelConfig) -> Result<(), HfError>;

/// Writes a family's own `config.json` keys.
pub type WriteKeys = fn(&ModelConfig, &mut Map<String, Value>);

/// The name as the rules give it.
pub fn same_name(_: &ModelConfig, name: String) -> String {
    name
}

/// Whether `c` has neither experts nor latent attention: the models the dense families export.
pub(crate) fn dense(c: &ModelConfig) -> bool {
    c.moe.is_none() && c.mla.is_none()
}

/// The config.json keys of the sizes ember's [`ModelConfig`] holds.
pub struct SizeKeys {
    pub d_model: &'static str,
    pub n_layers: &'static str,
    pub n_heads: &'static str,
    /// `None`: as many key/value heads as query heads.
    pub n_kv_heads: Option<&'static str>,
    /// `None`: `d_model / n_heads`.
    pub head_dim: Option<&'static str>,
    pub d_ff: &'static str,
    /// What a null or absent `d_ff` key means, in multiples of `d_model` (GPT-2's `n_inner`: 4).
    pub d_ff_default: Option<usize>,
    pub max_seq_len: &'static str,
    /// The norm epsilon's key and its default.
    pub norm_eps: (&'static str, f64),
    pub activation: &'static str,
    /// `tie_word_embeddings` when absent.
    pub tie_default: bool,
}

/// The parts of the blocks, fixed for a family (its biases are read with its other keys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Parts {
    pub norm: NormKind,
    pub positions: Positions,
    pub qk_norm: bool,
    /// The q/k norms over the whole projections (OLMoE), not per head.
    pub qk_norm_whole: bool,
    pub sandwich_norms: bool,
    pub embed_scale: bool,
}

impl Parts {
    /// Whether `c` is built from these parts (its MLP aside), its norms kept either way
    /// [`Parts::holds_norm`] allows.
    pub fn of(&self, c: &ModelConfig) -> bool {
        self.holds_norm(c.norm)
            && *self
                == Parts {
                    norm: self.norm,
                    positions: c.positions,
                    qk_norm: c.qk_norm,
                    qk_norm_whole: c.qk_norm_whole,
                    sandwich_norms: c.sandwich_norms,
                    embed_scale: c.embed_scale,
                }
    }

    /// Whether a model whose norms are of `kind` is one of these: the family's own kind, or, for
    /// Gemma's RMSNorm (gain stored as `g − 1`), plain gains `g` too. A Gemma imported from GGUF keeps
    /// its gains as llama.cpp stores them (`g`, [`NormKind::RmsNorm`]), so that exporting it to GGUF
    /// again is bit for bit; a Hugging Face export writes `g − 1` ([`Layout::Gain`]).
    pub fn holds_norm(&self, kind: NormKind) -> bool {
        kind == self.norm || (self.norm == NormKind::RmsNormPlusOne && kind == NormKind::RmsNorm)
    }
}

/// How a tensor's values go between the file and ember.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The same shape and order: embeddings, norms, biases, `Conv1D` weights.
    AsIs,
    /// A linear weight: `[out, in]` in the file, `[in, out]` in ember.
    Transposed,
    /// The ember tensors side by side along the last axis, in order (GPT-2's `c_attn`: q, k, v).
    Fused,
    /// An RMSNorm's gain: the same shape, the values as the family stores gains (Gemma's `g − 1`);
    /// exports convert a model that keeps them the other way ([`Parts::holds_norm`]).
    Gain,
    /// Experts' linear weights: expert `j`'s `[out, in]` file tensor is slice `j` of ember's
    /// stacked `[E, in, out]` parameter, transposed.
    Experts,
}

/// One tensor name: Hugging Face's, ember's (several for [`Layout::Fused`]) and llama.cpp's, `{i}`
/// the layer.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub hf: &'static str,
    pub ember: &'static [&'static str],
    pub layout: Layout,
    /// The name in a GGUF file (llama-arch.cpp's); empty where llama.cpp's architecture has no such
    /// tensor (an export of a model that has one is refused).
    pub gguf: &'static str,
    /// Whether the GGUF tensor is the Hugging Face one transposed (GPT-2's `Conv1D` weights).
    pub gguf_transposed: bool,
    /// Which reads of a GGUF file may keep the tensor in its stored block type.
    pub stored: Stored,
}

/// Which reads of a GGUF file may keep a tensor in its stored block type (a quantized weight whose
/// products run on its blocks) rather than dequantize it: what the family's rules say, so that the
/// reader matches no names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// None: norms, biases, fused or `Conv1D` weights, routers, experts and shared experts.
    Dequantized,
    /// A block's projection (q, k, v, o, gate, up, down: one ember linear, transposed): kept by the
    /// read of a LoRA base and by the read for inference.
    Projection,
    /// The embedding table or the LM head: kept by the read for inference only.
    Table,
}

pub(crate) const fn rule(hf: &'static str, ember: &'static [&'static str], layout: Layout) -> Rule {
    Rule { hf, ember, layout, gguf: "", gguf_transposed: false, stored: Stored::Dequantized }
}

pub(crate) const fn as_is(hf: &'static str, ember: &'static [&'static str]) -> Rule {
    rule(hf, ember, Layout::AsIs)
}

pub(crate) const fn linear(hf: &'static str, ember: &'static [&'static str]) -> Rule {
    rule(hf, ember, Layout::Transposed)
}

pub(crate) const fn fused(hf: &'static str, ember: &'static [&'static str]) -> Rule {
    rule(hf, ember, Layout::Fused)
}

pub(crate) const fn gain(hf: &'static str, ember: &'static [&'static str]) -> Rule {
    rule(hf, ember, Layout::Gain)
}

pub(crate) const fn experts(hf: &'static str, ember: &'static [&'static str]) -> Rule {
    rule(hf, ember, Layout::Experts)
}

impl Rule {
    /// The same rule with its GGUF name.
    pub(crate) const fn gguf(self, name: &'static str) -> Rule {
        Rule { gguf: name, ..self }
    }

    /// The same rule with its GGUF name, the GGUF tensor being the Hugging Face one transposed.
    pub(crate) const fn gguf_t(self, name: &'static str) -> Rule {
        Rule { gguf: name, gguf_transposed: true, ..self }
    }

    /// The same rule without a GGUF name (a tensor llama.cpp's architecture lacks).
    pub(crate) const fn no_gguf(self) -> Rule {
        Rule { gguf: "", gguf_transposed: false, ..self }
    }

    /// The same rule with the reads that may keep the GGUF tensor in its stored type.
    pub(crate) const fn stored(self, stored: Stored) -> Rule {
        Rule { stored, ..self }
    }
}

/// `groups` one after the other, `N` rules in all: a family's table made of shared groups.
pub(crate) const fn join<const N: usize>(groups: &[&[Rule]]) -> [Rule; N] {
    let mut out = [rule("", &[], Layout::AsIs); N];
    let (mut n, mut g) = (0, 0);
    while g < groups.len() {
        let mut i = 0;
        while i < groups[g].len() {
            out[n] = groups[g][i];
            (n, i) = (n + 1, i + 1);
        }
        g += 1;
    }
    assert!(n == N, "the groups hold another number of rules");
    out
}

/// `rules` without their GGUF names.
pub(crate) const fn without_gguf<const N: usize>(rules: [Rule; N]) -> [Rule; N] {
    let mut out = rules;
    let mut i = 0;
    while i < N {
        out[i] = rules[i].no_gguf();
        i += 1;
    }
    out
}

/// The layer index `key` has where `pattern` says `{i}`: `Some(None)` for a pattern without one.
/// A pattern with an expert index `{j}` as well matches that index too ([`match_expert`]).
pub(crate) fn match_pattern(pattern: &str, key: &str) -> Option<Option<usize>> {
    if pattern.contains("{j}") {
        return match_expert(pattern, key).map(|(i, _)| Some(i));
    }
    let Some((before, after)) = pattern.split_once("{i}") else {
        return (pattern == key).then_some(None);
    };
    let digits = key.strip_prefix(before)?.strip_suffix(after)?;
    Some(Some(index(digits)?))
}

/// A decimal index as written in a name: `01` and `+1` are not 1.
fn index(digits: &str) -> Option<usize> {
    let i: usize = digits.parse().ok()?;
    (i.to_string() == digits).then_some(i)
}

/// The layer and expert indices of `key` where `pattern` says `{i}`, then `{j}`.
pub(crate) fn match_expert(pattern: &str, key: &str) -> Option<(usize, usize)> {
    let (before, rest) = pattern.split_once("{i}")?;
    let (middle, after) = rest.split_once("{j}")?;
    let rest = key.strip_prefix(before)?.strip_suffix(after)?;
    let end = rest.find(|c: char| !c.is_ascii_digit())?;
    let (layer, tail) = rest.split_at(end);
    Some((index(layer)?, index(tail.strip_prefix(middle)?)?))
}

pub(crate) fn fill(pattern: &str, layer: Option<usize>) -> String {
    match layer {
        Some(i) => pattern.replace("{i}", &i.to_string()),
        None => pattern.to_string(),
    }
}

/// `name` (a pattern filled with its layer) with expert `j`'s index.
pub(crate) fn fill_expert(name: &str, j: usize) -> String {
    name.replace("{j}", &j.to_string())
}

/// A file tensor's place in ember: its path(s) and layout, and an expert's index in its stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToEmber {
    pub paths: Vec<String>,
    pub layout: Layout,
    pub expert: Option<usize>,
}

/// An ember parameter's place in the file: the tensor's name and layout, and, for a fused tensor,
/// every path it holds (this parameter at `part`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToHf {
    pub name: String,
    pub layout: Layout,
    pub paths: Vec<String>,
    pub part: usize,
}

impl Family {
    /// A model of the family's parts and no size: no biases, RoPE base 10 000 on half-split pairs,
    /// no window, soft cap or experts, an untied head. The `config.json` and GGUF readers start
    /// here and fill in what their keys say.
    pub fn base_config(&self) -> ModelConfig {
        let parts = self.parts;
        ModelConfig {
            norm: parts.norm,
            mlp: self.activations[0].1,
            positions: parts.positions,
            qk_norm: parts.qk_norm,
            qk_norm_whole: parts.qk_norm_whole,
            sandwich_norms: parts.sandwich_norms,
            embed_scale: parts.embed_scale,
            ..ModelConfig::llama(0, 0, 0, 0, 0, 0)
        }
    }

    /// Where a file tensor goes; `None` for a name the family does not have.
    pub fn hf_to_ember(&self, key: &str) -> Option<ToEmber> {
        let find = |key: &str| {
            self.rules().find_map(|r| {
                let layer = match_pattern(r.hf, key)?;
                let expert = match_expert(r.hf, key).map(|(_, j)| j);
                let paths = r.ember.iter().map(|e| fill(e, layer)).collect();
                Some(ToEmber { paths, layout: r.layout, expert })
            })
        };
        find(key).or_else(|| {
            let prefix = self.optional_prefix?;
            (!key.starts_with(prefix)).then(|| find(&format!("{prefix}{key}"))).flatten()
        })
    }

    /// Every tensor rule of the family.
    pub fn rules(&self) -> impl Iterator<Item = &'static Rule> {
        self.tensors.iter().flat_map(|group| group.iter())
    }

    /// Where an ember parameter goes; `None` for one the family has no name for (a LoRA adapter).
    /// A stack of experts' name keeps `{j}` for the expert index (`fill_expert`).
    pub fn ember_to_hf(&self, path: &str) -> Option<ToHf> {
        self.rules().find_map(|r| {
            r.ember.iter().enumerate().find_map(|(part, e)| {
                let layer = match_pattern(e, path)?;
                Some(ToHf {
                    name: fill(r.hf, layer),
                    layout: r.layout,
                    paths: r.ember.iter().map(|e| fill(e, layer)).collect(),
                    part,
                })
            })
        })
    }

    /// The Hugging Face name of GGUF tensor `name`, and whether its values are the Hugging Face
    /// ones transposed; `None` for a name the family has no rule for.
    pub fn gguf_to_hf(&self, name: &str) -> Option<(String, bool)> {
        self.gguf_rule(name).map(|(r, layer)| (fill(r.hf, layer), r.gguf_transposed))
    }

    /// The rule of GGUF tensor `name` and its layer; `None` for a name the family has no rule for.
    pub fn gguf_rule(&self, name: &str) -> Option<(&'static Rule, Option<usize>)> {
        self.rules().filter(|r| !r.gguf.is_empty()).find_map(|r| Some((r, match_pattern(r.gguf, name)?)))
    }

    /// The GGUF name of Hugging Face tensor `name` (with or without the optional prefix), and
    /// whether it is stored transposed; `None` where llama.cpp's architecture has no such tensor.
    pub fn hf_to_gguf(&self, name: &str) -> Option<(String, bool)> {
        let find = |key: &str| {
            self.rules().filter(|r| !r.gguf.is_empty()).find_map(|r| {
                let layer = match_pattern(r.hf, key)?;
                Some((fill(r.gguf, layer), r.gguf_transposed))
            })
        };
        find(name).or_else(|| {
            let prefix = self.optional_prefix?;
            (!name.starts_with(prefix)).then(|| find(&format!("{prefix}{name}"))).flatten()
        })
    }

    /// Whether `key` is a buffer, not a parameter.
    pub fn is_buffer(&self, key: &str) -> bool {
        self.buffers.iter().any(|b| key.ends_with(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families::experts::MIXTRAL;
    use crate::families::gemma3::GEMMA3;
    use crate::families::gpt2::GPT2;
    use crate::families::llama::LLAMA;

    #[test]
    fn every_architecture_has_one_row_and_names_round_trip() {
        for registration in crate::families::FAMILIES {
            let (f, arch) = (&registration.hf, registration.architecture());
            assert_eq!(arch.family().class_name, f.class_name);
            assert_eq!(Architecture::from_class(f.class_name), Some(arch));
            // The class name is the handle's identity: one family each.
            assert_eq!(crate::families::FAMILIES.iter().filter(|o| o.hf.class_name == f.class_name).count(), 1);
            for r in f.rules() {
                for (part, e) in r.ember.iter().enumerate() {
                    let (hf, path) = (fill_expert(&fill(r.hf, Some(7)), 3), fill(e, Some(7)));
                    let to = f.hf_to_ember(&hf).unwrap();
                    assert_eq!((to.paths[part].as_str(), to.layout), (path.as_str(), r.layout), "{hf}");
                    let back = f.ember_to_hf(&path).unwrap();
                    // DeepSeek's query is `q_proj` or, low-rank, `q_b_proj`: one ember path, the
                    // first name back (an export renames it by the model's config).
                    let first = f.rules().find(|o| o.ember.contains(e)).unwrap();
                    let hf = if first.hf == r.hf { hf.clone() } else { fill_expert(&fill(first.hf, Some(7)), 3) };
                    assert_eq!((fill_expert(&back.name, 3), back.part), (hf.clone(), part), "{path}");
                    assert_eq!(to.expert, (r.layout == Layout::Experts).then_some(3), "{hf}");
                }
            }
        }
    }

    #[test]
    fn patterns_take_layer_indices_only() {
        assert_eq!(match_pattern("a.{i}.b", "a.12.b"), Some(Some(12)));
        assert_eq!(match_pattern("a.{i}.b", "a.012.b"), None);
        assert_eq!(match_pattern("a.{i}.b", "a.+1.b"), None);
        assert_eq!(match_pattern("a.{i}.b", "a..b"), None);
        assert_eq!(match_pattern("a.b", "a.b"), Some(None));
        assert_eq!(match_expert("a.{i}.e.{j}.w", "a.12.e.3.w"), Some((12, 3)));
        assert_eq!(match_expert("a.{i}.e.{j}.w", "a.12.e.03.w"), None);
        assert_eq!(match_expert("a.{i}.e.{j}.w", "a.1.2.e.3.w"), None);
        assert_eq!(match_pattern("a.{i}.e.{j}.w", "a.12.e.3.w"), Some(Some(12)));
        let mixtral = MIXTRAL.architecture().family();
        let to = mixtral.hf_to_ember("model.layers.1.block_sparse_moe.experts.5.w3.weight").unwrap();
        assert_eq!((to.paths, to.layout, to.expert), (vec!["layers.1.moe.up".to_string()], Layout::Experts, Some(5)));
        let llama = LLAMA.architecture().family();
        assert_eq!(llama.hf_to_ember("model.layers.0.self_attn.rotary_emb.inv_freq"), None);
        assert!(llama.is_buffer("model.layers.0.self_attn.rotary_emb.inv_freq"));
        assert_eq!(llama.ember_to_hf("layers.0.self_attn.q_proj.lora.a"), None);
    }

    #[test]
    fn gpt2_names_come_with_or_without_the_prefix() {
        let gpt2 = GPT2.architecture().family();
        let qkv = |l: usize| -> Vec<String> {
            ["q", "k", "v"].iter().map(|p| format!("layers.{l}.self_attn.{p}_proj.weight")).collect()
        };
        for key in ["h.3.attn.c_attn.weight", "transformer.h.3.attn.c_attn.weight"] {
            let want = ToEmber { paths: qkv(3), layout: Layout::Fused, expert: None };
            assert_eq!(gpt2.hf_to_ember(key), Some(want), "{key}");
        }
        assert_eq!(gpt2.hf_to_ember("wpe.weight").unwrap().paths, ["embed_positions"]);
        assert_eq!(gpt2.hf_to_ember("lm_head.weight").unwrap().layout, Layout::Transposed);
        assert_eq!(gpt2.hf_to_ember("transformer.transformer.wte.weight"), None);
        let k = gpt2.ember_to_hf("layers.3.self_attn.k_proj.weight").unwrap();
        assert_eq!((k.name.as_str(), k.part, k.paths), ("transformer.h.3.attn.c_attn.weight", 1, qkv(3)));
        assert!(gpt2.is_buffer("h.0.attn.bias") && gpt2.is_buffer("transformer.h.0.attn.masked_bias"));
        assert!(!gpt2.is_buffer("h.0.attn.c_attn.bias"));
    }

    #[test]
    fn gemma3_norm_names_are_its_own() {
        let gemma = GEMMA3.architecture().family();
        let path = |k: &str| gemma.hf_to_ember(k).unwrap().paths.remove(0);
        assert_eq!(path("model.layers.2.post_attention_layernorm.weight"), "layers.2.attn_output_norm.weight");
        assert_eq!(path("model.layers.2.pre_feedforward_layernorm.weight"), "layers.2.post_attention_layernorm.weight");
        assert_eq!(path("model.layers.2.post_feedforward_layernorm.weight"), "layers.2.mlp_output_norm.weight");
    }

    /// The rules say which GGUF tensors may stay in their stored type: a block's projections (one
    /// ember linear each, not transposed in the file) and the embedding table and LM head; never a
    /// shared expert, an expert, a router or DeepSeek's latent projections.
    #[test]
    fn only_projections_and_tables_may_stay_stored() {
        for registration in crate::families::FAMILIES {
            for r in registration.hf.rules().filter(|r| r.stored != Stored::Dequantized) {
                assert!(!r.gguf.is_empty() && !r.gguf_transposed, "{}", r.hf);
                match r.stored {
                    Stored::Projection => assert!(r.layout == Layout::Transposed && r.ember.len() == 1, "{}", r.hf),
                    _ => assert!(matches!(r.ember, ["embed_tokens"] | ["lm_head.weight"]), "{}", r.hf),
                }
            }
        }
        let stored = |f: &Family, gguf: &str| f.gguf_rule(gguf).map(|(r, _)| r.stored);
        let qwen2_moe = &crate::families::experts::QWEN2_MOE.hf;
        assert_eq!(stored(qwen2_moe, "blk.0.attn_q.weight"), Some(Stored::Projection));
        for name in ["blk.0.ffn_gate_shexp.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_gate_inp.weight"] {
            assert_eq!(stored(qwen2_moe, name), Some(Stored::Dequantized), "{name}");
        }
        let deepseek = &crate::families::deepseek::DEEPSEEK_V3.hf;
        assert_eq!(stored(deepseek, "blk.0.attn_q_b.weight"), Some(Stored::Dequantized));
        assert_eq!(stored(deepseek, "blk.0.ffn_down.weight"), Some(Stored::Projection));
        assert_eq!(stored(&GPT2.hf, "blk.0.attn_qkv.weight"), Some(Stored::Dequantized));
        assert_eq!(stored(&GPT2.hf, "token_embd.weight"), Some(Stored::Table));
    }
}
