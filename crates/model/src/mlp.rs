//! The feed-forward part. Gated (Shazeer, 2020): `down(act(gate(x)) ⊙ up(x))` with SiLU (SwiGLU:
//! Llama, Qwen, Mistral) or tanh GELU (GeGLU: Gemma); with F = 8D/3 it costs what a 4D plain MLP
//! costs. Plain: `down(gelu(up(x)))` (GPT-2, whose `c_fc` is `up` and `c_proj` is `down`), with the
//! tanh GELU Hugging Face runs GPT-2 with or the exact erf GELU nanoGPT uses, or squared ReLU
//! (`down(relu(up(x))²)`, the modded-nanogpt speedrun's).

use burn::module::Module;
use burn::tensor::{backend::Backend, Tensor};

use ember_kernels::gelu::{gelu, Gelu};
use ember_kernels::relu_squared::relu_squared;
use ember_kernels::swiglu::{geglu_packed, swiglu_packed};
use ember_kernels::{Compute, EmberBackend};

use crate::init::Init;
use crate::kinds::{positive_std, ConfigError, MlpKind, PartConfig, Target};
use crate::linear::{forward_packed, Linear};

/// What an [`Mlp`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MlpConfig {
    pub d_model: usize,
    pub d_ff: usize,
    pub kind: MlpKind,
    /// Biases on the projections (GPT-2).
    pub bias: bool,
    /// Init standard deviation of the gate and up projections and of the down projection.
    pub init_std: f64,
    pub out_std: f64,
}

impl MlpConfig {
    /// A SwiGLU MLP of width `d_ff` over `d_model`, init std 0.02.
    #[cfg(test)]
    pub(crate) fn new(d_model: usize, d_ff: usize) -> Self {
        Self { d_model, d_ff, kind: MlpKind::Swiglu, bias: false, init_std: 0.02, out_std: 0.02 }
    }

    /// The part, its weights drawn from `init` (gate, up, down in that order). Call
    /// [`MlpConfig::validate`] first (as `Decoder::new` does): a config that breaks its rules
    /// builds a part that panics when run.
    pub(crate) fn init<B: Backend>(&self, init: &mut Init, device: &B::Device) -> Mlp<B> {
        let (d, f, bias) = (self.d_model, self.d_ff, self.bias);
        Mlp {
            gate_proj: self.kind.gated().then(|| Linear::new(init, d, f, bias, self.init_std, device)),
            up_proj: Linear::new(init, d, f, bias, self.init_std, device),
            down_proj: Linear::new(init, f, d, bias, self.out_std, device),
            kind: self.kind,
        }
    }
}

impl PartConfig for MlpConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some((name, _)) = [("d_model", self.d_model), ("d_ff", self.d_ff)].into_iter().find(|&(_, v)| v == 0) {
            return Err(ConfigError::NotPositive { name, value: 0.0 });
        }
        positive_std(self.init_std, self.out_std)
    }

    /// Its parameters: the projections and their biases.
    fn params(&self) -> u64 {
        let (d, f) = (self.d_model as u64, self.d_ff as u64);
        let biases = match (self.bias, self.kind.gated()) {
            (false, _) => 0,
            (true, true) => 2 * f + d,
            (true, false) => f + d,
        };
        self.matmul_params() + biases
    }

    /// Weights a token multiplies by: `3·D·F` gated, `2·D·F` plain.
    fn matmul_params(&self) -> u64 {
        let projections = if self.kind.gated() { 3 } else { 2 };
        projections * self.d_model as u64 * self.d_ff as u64
    }

    /// `(in, out)` of the projection `target` names, if the MLP has it (a plain MLP no gate).
    fn projection(&self, target: Target) -> Option<(usize, usize)> {
        let (d, f) = (self.d_model, self.d_ff);
        match target {
            Target::GateProj if self.kind.gated() => Some((d, f)),
            Target::UpProj => Some((d, f)),
            Target::DownProj => Some((f, d)),
            _ => None,
        }
    }

    /// The f32 values autodiff keeps per token: the gate, up, activation and product (4F; a plain
    /// MLP's up and activation counted as much, a bound), and the output (D).
    fn activations(&self, _seq_len: usize) -> u64 {
        4 * self.d_ff as u64 + self.d_model as u64
    }
}

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[D, F]`, in a gated MLP.
    pub gate_proj: Option<Linear<B>>,
    /// `[D, F]` [GPT-2: c_fc].
    pub up_proj: Linear<B>,
    /// `[F, D]` [GPT-2: c_proj].
    pub down_proj: Linear<B>,
    #[module(skip)]
    pub kind: MlpKind,
}

impl<B: EmberBackend> Mlp<B> {
    /// # Shapes
    /// - x: `[N, D]` -> `[N, D]`
    pub(crate) fn forward(&self, x: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
        let hidden = match (&self.gate_proj, self.kind) {
            (Some(gate), kind) => {
                let gate_up = forward_packed(&[gate, &self.up_proj], x, cx); // [N, 2F]
                match kind {
                    MlpKind::Geglu => geglu_packed(gate_up, cx),
                    _ => swiglu_packed(gate_up, cx),
                }
            }
            (None, MlpKind::GeluExact) => gelu(self.up_proj.forward(x, cx), Gelu::Erf, cx),
            (None, MlpKind::Relu2) => relu_squared(self.up_proj.forward(x, cx), cx),
            (None, _) => gelu(self.up_proj.forward(x, cx), Gelu::Tanh, cx),
        }; // [N, F]
        self.down_proj.forward(hidden, cx)
    }
}
