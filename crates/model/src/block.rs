//! One decoder block. Pre-norm, as Llama: `h = x + attn(norm(x))`, `y = h + mlp(norm(h))` (the two
//! residuals distinct: the MLP output is added to `h`, not to the block input). With sandwich norms
//! (Gemma 2, 3) each branch's output is normed too before its add. A parallel block (GPT-J, PaLM)
//! feeds the attention and the MLP the same normed input: `y = x + attn(norm(x)) + mlp(norm(x))`.

use burn::module::Module;
use burn::tensor::{backend::Backend, Tensor};

use ember_kernels::rope::Rope;
use ember_kernels::{Compute, EmberBackend};

use crate::attention::{Attention, GroupedConfig};
use crate::dropout;
use crate::init::Init;
use crate::keys::Keys;
use crate::kinds::{AttentionPart, ConfigError, PartConfig, Target};
use crate::linear::Linear;
use crate::mla::{LatentAttention, LatentConfig};
use crate::mlp::{Mlp, MlpConfig};
use crate::moe::{Moe, MoePartConfig, Route};
use crate::norm::{Norm, NormConfig};

/// What a [`Block`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BlockConfig {
    pub attention: AttentionConfig,
    pub ffn: FeedForwardConfig,
    /// Every norm of the block.
    pub norm: NormConfig,
    pub sandwich_norms: bool,
    pub parallel: bool,
    pub dropout: f64,
}

/// What a block's self-attention is built from: grouped-query attention, or latent attention
/// (DeepSeek's MLA), each with only the fields it uses.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum AttentionConfig {
    Grouped(GroupedConfig),
    Latent(LatentConfig),
}

impl AttentionConfig {
    /// The variant's config, as every kind of attention answers.
    pub(crate) fn part(&self) -> &dyn AttentionPart {
        match self {
            Self::Grouped(att) => att,
            Self::Latent(att) => att,
        }
    }

    fn init<B: Backend>(&self, init: &mut Init, device: &B::Device) -> SelfAttention<B> {
        match self {
            Self::Grouped(att) => SelfAttention::Grouped(att.init(init, device)),
            Self::Latent(att) => SelfAttention::Latent(att.init(init, device)),
        }
    }
}

/// What a block's feed-forward part is built from: one MLP, or a mixture of experts.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum FeedForwardConfig {
    Dense(MlpConfig),
    Experts(MoePartConfig),
}

impl FeedForwardConfig {
    /// The variant's config, as every feed-forward part answers.
    fn part(&self) -> &dyn PartConfig {
        match self {
            Self::Dense(mlp) => mlp,
            Self::Experts(moe) => moe,
        }
    }

    fn init<B: Backend>(&self, init: &mut Init, device: &B::Device) -> FeedForward<B> {
        match self {
            Self::Dense(mlp) => FeedForward::Mlp(mlp.init(init, device)),
            Self::Experts(moe) => FeedForward::Moe(moe.init(init, device)),
        }
    }
}

impl BlockConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.attention.part().validate()?;
        self.ffn.part().validate()?;
        self.norm.validate()?;
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ConfigError::Dropout(self.dropout));
        }
        Ok(())
    }

    /// The norms a block has: the attention's input norm, the MLP's (not in a parallel block),
    /// and the two output norms of sandwich norms.
    fn norms(&self) -> u64 {
        1 + u64::from(!self.parallel) + 2 * u64::from(self.sandwich_norms)
    }

    /// Its parameters: the attention's, the feed-forward part's and the norms'.
    pub(crate) fn params(&self) -> u64 {
        self.attention.part().params() + self.ffn.part().params() + self.norms() * self.norm.params()
    }

    /// `(in, out)` of the projection `target` names, if the block has it.
    pub(crate) fn projection(&self, target: Target) -> Option<(usize, usize)> {
        self.attention.part().projection(target).or_else(|| self.ffn.part().projection(target))
    }

    /// Weights a token multiplies by in this block (the N of 6N).
    pub(crate) fn matmul_params(&self) -> u64 {
        self.attention.part().matmul_params() + self.ffn.part().matmul_params()
    }

    /// The f32 values autodiff keeps per token at context `seq_len`: the block's input, two norm
    /// outputs (the attention's and the feed-forward part's inputs), and what the attention and
    /// the feed-forward part keep.
    pub(crate) fn activations(&self, seq_len: usize) -> u64 {
        let d = self.norm.d_model as u64;
        d + 2 * self.norm.activations()
            + self.attention.part().activations(seq_len)
            + self.ffn.part().activations(seq_len)
    }

    /// The part, its weights drawn from `init` (the attention's, then the MLP's). Call
    /// [`BlockConfig::validate`] first (as `Decoder::new` does): a config that breaks its rules
    /// builds a part that panics when run.
    pub(crate) fn init<B: Backend>(&self, init: &mut Init, device: &B::Device) -> Block<B> {
        let sandwich = || self.sandwich_norms.then(|| self.norm.init(device));
        Block {
            input_layernorm: self.norm.init(device),
            self_attn: self.attention.init(init, device),
            attn_output_norm: sandwich(),
            post_attention_layernorm: (!self.parallel).then(|| self.norm.init(device)),
            ffn: self.ffn.init(init, device),
            mlp_output_norm: sandwich(),
            dropout: self.dropout,
        }
    }
}

/// A block's self-attention. Its parameters are named by its field whichever the variant,
/// `layers.{i}.self_attn.q_proj.…`, latent attention's other parts `layers.{i}.self_attn.mla.…`
/// (see [`crate::weights`]).
#[derive(Module, Debug)]
pub enum SelfAttention<B: Backend> {
    Grouped(Attention<B>),
    Latent(LatentAttention<B>),
}

impl<B: Backend> SelfAttention<B> {
    /// The projection `target` names, if it is the attention's (q, k, v, o).
    fn projection(&self, target: Target) -> Option<&Linear<B>> {
        let slot = target.attention_slot()?;
        let projections = match self {
            Self::Grouped(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj],
            Self::Latent(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj],
        };
        Some(projections[slot])
    }

    /// The projection `target` names, to change.
    fn projection_mut(&mut self, target: Target) -> Option<&mut Linear<B>> {
        let slot = target.attention_slot()?;
        let projections = match self {
            Self::Grouped(a) => [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj],
            Self::Latent(a) => [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj],
        };
        projections.into_iter().nth(slot)
    }
}

impl<B: EmberBackend> SelfAttention<B> {
    /// # Shapes
    /// - x: `[B, T, D]` -> `[B, T, D]`
    fn forward(&self, x: Tensor<B, 3>, rope: &Rope<B>, keys: Keys<'_, B>, cx: Compute) -> Tensor<B, 3> {
        match self {
            Self::Grouped(att) => att.forward(x, rope, keys, cx),
            Self::Latent(att) => att.forward(x, rope, keys, cx),
        }
    }
}

/// A block's feed-forward part. Its parameters are named by the variant, `layers.{i}.mlp.…` or
/// `layers.{i}.moe.…` (see [`crate::weights`]).
#[derive(Module, Debug)]
pub enum FeedForward<B: Backend> {
    Mlp(Mlp<B>),
    /// A mixture of experts in place of the MLP.
    Moe(Moe<B>),
}

#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// The attention's input norm (a parallel block's only one).
    pub input_layernorm: Norm<B>,
    pub self_attn: SelfAttention<B>,
    /// The attention's output norm (sandwich norms) [Gemma: post_attention_layernorm].
    pub attn_output_norm: Option<Norm<B>>,
    /// The MLP's input norm [Llama: post_attention_layernorm; Gemma: pre_feedforward_layernorm].
    pub post_attention_layernorm: Option<Norm<B>>,
    /// The feed-forward part.
    pub ffn: FeedForward<B>,
    /// The MLP's output norm (sandwich norms) [Gemma: post_feedforward_layernorm].
    pub mlp_output_norm: Option<Norm<B>>,
    #[module(skip)]
    dropout: f64,
}

impl<B: Backend> Block<B> {
    /// The MLP, unless the block has experts.
    pub(crate) fn mlp(&self) -> Option<&Mlp<B>> {
        match &self.ffn {
            FeedForward::Mlp(mlp) => Some(mlp),
            FeedForward::Moe(_) => None,
        }
    }

    /// The mixture of experts, if the block has one.
    pub fn moe(&self) -> Option<&Moe<B>> {
        match &self.ffn {
            FeedForward::Moe(moe) => Some(moe),
            FeedForward::Mlp(_) => None,
        }
    }

    /// The mixture of experts, to change.
    pub(crate) fn moe_mut(&mut self) -> Option<&mut Moe<B>> {
        match &mut self.ffn {
            FeedForward::Moe(moe) => Some(moe),
            FeedForward::Mlp(_) => None,
        }
    }

    /// The projection `target` names (`None`: a plain MLP has no gate, experts no MLP).
    pub fn projection(&self, target: Target) -> Option<&Linear<B>> {
        let mlp = || self.mlp();
        Some(match target {
            Target::QProj | Target::KProj | Target::VProj | Target::OProj => self.self_attn.projection(target)?,
            Target::GateProj => mlp()?.gate_proj.as_ref()?,
            Target::UpProj => &mlp()?.up_proj,
            Target::DownProj => &mlp()?.down_proj,
        })
    }

    /// The projection `target` names, to change.
    pub fn projection_mut(&mut self, target: Target) -> Option<&mut Linear<B>> {
        let mlp = match &mut self.ffn {
            FeedForward::Mlp(mlp) => Some(mlp),
            FeedForward::Moe(_) => None,
        };
        Some(match target {
            Target::QProj | Target::KProj | Target::VProj | Target::OProj => self.self_attn.projection_mut(target)?,
            Target::GateProj => mlp?.gate_proj.as_mut()?,
            Target::UpProj => &mut mlp?.up_proj,
            Target::DownProj => &mut mlp?.down_proj,
        })
    }
}

impl<B: EmberBackend> Block<B> {
    /// The block with its adapters merged into its weights (the experts' and the shared
    /// expert's too), stored weights dequantized on `device`.
    pub(crate) fn merge_lora(mut self, device: &B::Device) -> Self {
        for target in Target::ALL {
            if let Some(lin) = self.projection_mut(target) {
                *lin = lin.clone().merge_lora(device);
            }
        }
        if let FeedForward::Moe(moe) = self.ffn {
            let mut moe = moe.merge_lora();
            if let Some(shared) = moe.shared.as_mut() {
                for lin in shared.gate_proj.iter_mut().chain([&mut shared.up_proj, &mut shared.down_proj]) {
                    *lin = lin.clone().merge_lora(device);
                }
            }
            self.ffn = FeedForward::Moe(moe);
        }
        self
    }

    /// The block's output; a mixture of experts adds its routing to `routes`.
    ///
    /// # Shapes
    /// - x: `[B, T, D]` -> `[B, T, D]`
    pub(crate) fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        keys: Keys<'_, B>,
        cx: Compute,
        routes: &mut Vec<Route<B>>,
    ) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let normed = self.input_layernorm.forward(x.clone(), cx);
        let attn = output(&self.attn_output_norm, self.self_attn.forward(normed.clone(), rope, keys, cx), cx);
        let h = (x + dropout(attn, self.dropout)).reshape([b * t, d]); // [B·T, D]
        let mlp_in = match &self.post_attention_layernorm {
            Some(norm) => norm.forward(h.clone(), cx),
            None => normed.reshape([b * t, d]), // a parallel block: the attention's input
        };
        let ffn = match &self.ffn {
            FeedForward::Moe(moe) => {
                let (y, route) = moe.forward(mlp_in, cx);
                routes.push(route);
                y
            }
            FeedForward::Mlp(mlp) => mlp.forward(mlp_in, cx),
        };
        let mlp = output(&self.mlp_output_norm, ffn, cx);
        let y = h + dropout(mlp, self.dropout);
        y.reshape([b, t, d])
    }
}

/// A branch's output, through its output norm where the block has sandwich norms.
fn output<B: EmberBackend, const D: usize>(norm: &Option<Norm<B>>, y: Tensor<B, D>, cx: Compute) -> Tensor<B, D> {
    match norm {
        Some(norm) => norm.forward(y, cx),
        None => y,
    }
}
