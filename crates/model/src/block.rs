//! One pre-norm decoder block: `h = x + attn(norm(x))`, `y = h + mlp(norm(h))`. The two residuals are
//! distinct: the MLP output is added to `h`, not to the block input.

use burn::module::Module;
use burn::tensor::{backend::Backend, DType, Tensor};

use crate::attention::{Attention, Keys};
use crate::config::BlockConfig;
use crate::dropout;
use crate::init::Init;
use crate::mlp::Mlp;
use crate::norm::RmsNorm;
use crate::ops::rope::Rope;
use crate::ops::EmberBackend;

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
    pub fn init<B: Backend>(&self, init: &mut Init, device: &B::Device) -> Block<B> {
        Block {
            input_layernorm: self.norm.init(device),
            self_attn: self.attention.init(init, device),
            post_attention_layernorm: self.norm.init(device),
            mlp: self.mlp.init(init, device),
            dropout: self.dropout,
        }
    }
}

impl<B: EmberBackend> Block<B> {
    /// # Shapes
    /// - x: `[B, T, D]` -> `[B, T, D]`
    pub fn forward(&self, x: Tensor<B, 3>, rope: &Rope<B>, keys: Keys<'_, B>, compute: DType) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let attn = self.self_attn.forward(self.input_layernorm.forward(x.clone()), rope, keys, compute);
        let h = (x + dropout(attn, self.dropout)).reshape([b * t, d]); // [B·T, D]
        let y = h.clone() + dropout(self.mlp.forward(self.post_attention_layernorm.forward(h), compute), self.dropout);
        y.reshape([b, t, d])
    }
}
