//! One pre-norm decoder block: `h = x + attn(norm(x))`, `y = h + mlp(norm(h))`. The two residuals are
//! distinct: the MLP output is added to `h`, not to the block input.

use burn::module::Module;
use burn::tensor::{backend::Backend, Tensor};

use crate::attention::{Attention, Keys};
use crate::config::BlockConfig;
use crate::dropout;
use crate::init::Init;
use crate::linear::Linear;
use crate::lora::Target;
use crate::mlp::Mlp;
use crate::norm::RmsNorm;
use ember_kernels::rope::Rope;
use ember_kernels::{Compute, EmberBackend};

#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: Attention<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub mlp: Mlp<B>,
    #[module(skip)]
    dropout: f64,
}

impl BlockConfig {
    /// The part, its weights drawn from `init`. Call [`BlockConfig::validate`] first (as `Decoder::new`
    /// does): a config that breaks its rules builds a part that panics when run.
    pub(crate) fn init<B: Backend>(&self, init: &mut Init, device: &B::Device) -> Block<B> {
        Block {
            input_layernorm: self.norm.init(device),
            self_attn: self.attention.init(init, device),
            post_attention_layernorm: self.norm.init(device),
            mlp: self.mlp.init(init, device),
            dropout: self.dropout,
        }
    }
}

impl<B: Backend> Block<B> {
    /// The projection `target` names.
    pub fn projection(&self, target: Target) -> &Linear<B> {
        let (att, mlp) = (&self.self_attn, &self.mlp);
        match target {
            Target::QProj => &att.q_proj,
            Target::KProj => &att.k_proj,
            Target::VProj => &att.v_proj,
            Target::OProj => &att.o_proj,
            Target::GateProj => &mlp.gate_proj,
            Target::UpProj => &mlp.up_proj,
            Target::DownProj => &mlp.down_proj,
        }
    }

    /// The projection `target` names, to change.
    pub(crate) fn projection_mut(&mut self, target: Target) -> &mut Linear<B> {
        let (att, mlp) = (&mut self.self_attn, &mut self.mlp);
        match target {
            Target::QProj => &mut att.q_proj,
            Target::KProj => &mut att.k_proj,
            Target::VProj => &mut att.v_proj,
            Target::OProj => &mut att.o_proj,
            Target::GateProj => &mut mlp.gate_proj,
            Target::UpProj => &mut mlp.up_proj,
            Target::DownProj => &mut mlp.down_proj,
        }
    }
}

impl<B: EmberBackend> Block<B> {
    /// # Shapes
    /// - x: `[B, T, D]` -> `[B, T, D]`
    pub(crate) fn forward(&self, x: Tensor<B, 3>, rope: &Rope<B>, keys: Keys<'_, B>, cx: Compute) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let attn = self.self_attn.forward(self.input_layernorm.forward(x.clone(), cx), rope, keys, cx);
        let h = (x + dropout(attn, self.dropout)).reshape([b * t, d]); // [B·T, D]
        let y = h.clone() + dropout(self.mlp.forward(self.post_attention_layernorm.forward(h, cx), cx), self.dropout);
        y.reshape([b, t, d])
    }
}
