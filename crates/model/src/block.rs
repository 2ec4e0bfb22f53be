//! One decoder block. Pre-norm, as Llama: `h = x + attn(norm(x))`, `y = h + mlp(norm(h))` (the two
//! residuals distinct: the MLP output is added to `h`, not to the block input). With sandwich norms
//! (Gemma 2, 3) each branch's output is normed too before its add. A parallel block (GPT-J, PaLM)
//! feeds the attention and the MLP the same normed input: `y = x + attn(norm(x)) + mlp(norm(x))`.

use burn::module::Module;
use burn::tensor::{backend::Backend, Tensor};

use ember_kernels::rope::Rope;
use ember_kernels::{Compute, EmberBackend};

use crate::attention::{Attention, AttentionConfig, Keys};
use crate::config::ConfigError;
use crate::dropout;
use crate::init::Init;
use crate::linear::Linear;
use crate::lora::Target;
use crate::mlp::{Mlp, MlpConfig};
use crate::moe::{Moe, MoePartConfig, Route};
use crate::norm::{Norm, NormConfig};

/// What a [`Block`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BlockConfig {
    pub attention: AttentionConfig,
    pub mlp: MlpConfig,
    /// Experts in place of the MLP.
    pub moe: Option<MoePartConfig>,
    /// Every norm of the block.
    pub norm: NormConfig,
    pub sandwich_norms: bool,
    pub parallel: bool,
    pub dropout: f64,
}

impl BlockConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.attention.validate()?;
        match &self.moe {
            Some(moe) => moe.validate()?,
            None => self.mlp.validate()?,
        }
        self.norm.validate()?;
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ConfigError::Dropout(self.dropout));
        }
        Ok(())
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
            mlp: self.moe.is_none().then(|| self.mlp.init(init, device)),
            moe: self.moe.as_ref().map(|moe| moe.init(init, device)),
            mlp_output_norm: sandwich(),
            dropout: self.dropout,
        }
    }
}

#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// The attention's input norm (a parallel block's only one).
    pub input_layernorm: Norm<B>,
    pub self_attn: Attention<B>,
    /// The attention's output norm (sandwich norms) [Gemma: post_attention_layernorm].
    pub attn_output_norm: Option<Norm<B>>,
    /// The MLP's input norm [Llama: post_attention_layernorm; Gemma: pre_feedforward_layernorm].
    pub post_attention_layernorm: Option<Norm<B>>,
    /// The feed-forward part, unless the block has experts.
    pub mlp: Option<Mlp<B>>,
    /// The mixture of experts in place of the MLP.
    pub moe: Option<Moe<B>>,
    /// The MLP's output norm (sandwich norms) [Gemma: post_feedforward_layernorm].
    pub mlp_output_norm: Option<Norm<B>>,
    #[module(skip)]
    dropout: f64,
}

impl<B: Backend> Block<B> {
    /// The projection `target` names (`None`: a plain MLP has no gate, experts no MLP).
    pub fn projection(&self, target: Target) -> Option<&Linear<B>> {
        let att = &self.self_attn;
        let mlp = || self.mlp.as_ref();
        Some(match target {
            Target::QProj => &att.q_proj,
            Target::KProj => &att.k_proj,
            Target::VProj => &att.v_proj,
            Target::OProj => &att.o_proj,
            Target::GateProj => mlp()?.gate_proj.as_ref()?,
            Target::UpProj => &mlp()?.up_proj,
            Target::DownProj => &mlp()?.down_proj,
        })
    }

    /// The projection `target` names, to change.
    pub fn projection_mut(&mut self, target: Target) -> Option<&mut Linear<B>> {
        let (att, mlp) = (&mut self.self_attn, self.mlp.as_mut());
        Some(match target {
            Target::QProj => &mut att.q_proj,
            Target::KProj => &mut att.k_proj,
            Target::VProj => &mut att.v_proj,
            Target::OProj => &mut att.o_proj,
            Target::GateProj => mlp?.gate_proj.as_mut()?,
            Target::UpProj => &mut mlp?.up_proj,
            Target::DownProj => &mut mlp?.down_proj,
        })
    }
}

impl<B: EmberBackend> Block<B> {
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
        let ffn = match (&self.moe, &self.mlp) {
            (Some(moe), _) => {
                let (y, route) = moe.forward(mlp_in, cx);
                routes.push(route);
                y
            }
            (None, Some(mlp)) => mlp.forward(mlp_in, cx),
            (None, None) => mlp_in.zeros_like(), // no feed-forward part adds nothing
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
