//! SwiGLU feed-forward (Shazeer, 2020): `down(silu(gate(x)) ⊙ up(x))`. With F = 8D/3 it costs what a
//! 4D GELU MLP costs.

use burn::module::Module;
use burn::tensor::{backend::Backend, Tensor};

use crate::config::MlpConfig;
use crate::init::Init;
use crate::linear::{forward_packed, Linear};
use ember_kernels::swiglu::swiglu_packed;
use ember_kernels::{Compute, EmberBackend};

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[D, F]`
    pub gate_proj: Linear<B>,
    /// `[D, F]`
    pub up_proj: Linear<B>,
    /// `[F, D]`
    pub down_proj: Linear<B>,
}

impl MlpConfig {
    /// The part, its weights drawn from `init`. Call [`MlpConfig::validate`] first (as `Decoder::new`
    /// does): a config that breaks its rules builds a part that panics when run.
    pub(crate) fn init<B: Backend>(&self, init: &mut Init, device: &B::Device) -> Mlp<B> {
        let (d, f) = (self.d_model, self.d_ff);
        Mlp {
            gate_proj: Linear::new(init, d, f, false, self.init_std, device),
            up_proj: Linear::new(init, d, f, false, self.init_std, device),
            down_proj: Linear::new(init, f, d, false, self.out_std, device),
        }
    }
}

impl<B: EmberBackend> Mlp<B> {
    /// # Shapes
    /// - x: `[N, D]` -> `[N, D]`
    pub(crate) fn forward(&self, x: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
        let gate_up = forward_packed(&[&self.gate_proj, &self.up_proj], x, cx); // [N, 2F]
        self.down_proj.forward(swiglu_packed(gate_up, cx), cx)
    }
}
