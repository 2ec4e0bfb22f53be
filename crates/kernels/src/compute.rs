//! How a run computes, as one value: the dtype of the matrix products' tensors, which CPU
//! products take bf16 operands, ember's kernels or the reference compositions, and which copies
//! of the CPU kernels may run. A binary resolves it once (from its flags and environment), the
//! model carries it into every op, and an op's backward pass runs as its forward did. Nothing here
//! is process-wide state: two models with different values run side by side in one process.

use burn::tensor::DType;

pub use crate::bf16_gemm::Kernel as Bf16Kernel;
pub use crate::simd::Tier;

/// What the CPU kernels may use: the widest instruction-set copy of the element-wise kernels, and
/// the kernel that multiplies bf16 operands (`None`: every product in f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cpu {
    pub tier: Tier,
    pub bf16: Option<Bf16Kernel>,
}

impl Cpu {
    /// Everything this CPU (and OS) runs: its widest tier and its fastest bf16 kernel (AMX tiles
    /// where Linux grants them, else AVX512_BF16). The detection is cached; asking for the tiles
    /// happens once a process.
    pub fn detect() -> Self {
        Self { tier: crate::simd::detected(), bf16: Bf16Kernel::reachable().into_iter().next() }
    }

    /// Element-wise kernels of the widest copy this CPU has, every product in f32.
    pub fn f32_products() -> Self {
        Self { tier: crate::simd::detected(), bf16: None }
    }

    /// This CPU with copies no wider than `tier` (how tests reach narrower CPUs' paths).
    pub fn capped(self, tier: Tier) -> Self {
        Self { tier: self.tier.min(tier), ..self }
    }

    /// The same with bf16 products only where `on`.
    pub(crate) fn bf16_if(self, on: bool) -> Self {
        Self { bf16: self.bf16.filter(|_| on), ..self }
    }
}

impl Default for Cpu {
    fn default() -> Self {
        Self::detect()
    }
}

/// The classes of matrix products whose CPU operands may be rounded to bf16 (sums stay f32), each
/// on or off: what `--precision bf16` turns on where the CPU has the instructions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bf16Products {
    /// The large GEMMs of the linear layers (forward, input and weight gradients).
    pub linear: bool,
    /// The LM head's GEMMs inside the fused loss.
    pub head: bool,
    /// The attention's products (sequences over 256 positions), on the vector kernel.
    pub attention: bool,
    /// The kernel of Muon's Newton-Schulz iteration with `ns_dtype = "bf16"`, whose operands are
    /// bf16 values either way: a bf16 kernel, or (`None`) f32 products of those values, whichever
    /// this CPU runs faster. Not a product of the model: [`Bf16Products::any`] leaves it out.
    pub newton_schulz: Option<Bf16Kernel>,
}

impl Bf16Products {
    pub const NONE: Self = Self { linear: false, head: false, attention: false, newton_schulz: None };
    /// Every class of the model's products.
    pub const ALL: Self = Self { linear: true, head: true, attention: true, newton_schulz: None };

    /// Whether any of the model's classes is on (a bf16 run).
    pub fn any(self) -> bool {
        self.linear || self.head || self.attention
    }
}

/// Whether the ops run ember's kernels where the backend has them, or the reference compositions
/// everywhere (to compare speeds, or to rule the kernels out when debugging).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Kernels,
    Reference,
}

/// How finely the integer products of a few rows quantize those rows ([`Compute::int8_inputs`]
/// on; the `qdot` module's blocks of 32 or 256 values, one f32 scale each).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ActivationBits {
    /// 8-bit codes (llama.cpp's): a product about 1% of its row's scale off the f32 one.
    #[default]
    Eight,
    /// A high and a low 8-bit part: the block's 8-bit codes, then the codes of their rounding
    /// residual on its own scale (at most 1/254 of the block's), each multiplied by the weight's
    /// codes on the same integer products and the two sums added in f32. Twice the integer work,
    /// about 1/(127·254) of the scale off: logits within 1e-3 of the f32 model's.
    Sixteen,
}

/// How a run computes. See the module's doc.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Compute {
    /// The dtype of the matrix products' tensors: f32, or bf16/f16 on devices that run them natively
    /// (mixed precision: parameters, norms, softmax and the loss stay f32).
    pub dtype: DType,
    /// Which CPU products take bf16 operands under f32 tensors.
    pub bf16: Bf16Products,
    pub path: Path,
    pub cpu: Cpu,
    /// Whether products of a few rows with block-quantized weights quantize those rows to 8 bits
    /// for integer dot products (the `qdot` module's, as llama.cpp does: fast, about 1% off); off,
    /// they are the exact f32 products of the decoded blocks (evaluation's log-likelihoods).
    pub int8_inputs: bool,
    /// With `int8_inputs`: those rows in one 8-bit part or in two (16 bits).
    pub activation_bits: ActivationBits,
    /// With `int8_inputs`: a prompt's rows, however many, take the same integer products as a
    /// decode step's, on weights in the file's layout too (interleaved weights always do). A
    /// position then gets the same bits whether its prompt was computed whole, in chunks, after
    /// a shared prefix or beside other requests (what `serve` promises for a seeded request), at
    /// a cost to prompts where the CPU lacks AVX-512 VNNI (their f32 tiles run faster there).
    pub uniform_products: bool,
    /// The type a KV cache stores its keys and values in: f32, or f16 (half the memory and half
    /// the bytes a decode step's attention reads, each value rounded to f16 as llama.cpp's default
    /// cache does; the products stay f32). Latent attention's caches stay f32.
    pub kv_cache: DType,
}

impl Default for Compute {
    /// f32 products on ember's kernels, with everything the CPU has.
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            bf16: Bf16Products::NONE,
            path: Path::Kernels,
            cpu: Cpu::detect(),
            int8_inputs: true,
            activation_bits: ActivationBits::Eight,
            uniform_products: false,
            kv_cache: DType::F32,
        }
    }
}

impl Compute {
    /// Matrix products' tensors in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        Self { dtype, ..self }
    }

    /// The CPU products of `classes` with bf16 operands (only where the CPU has a bf16 kernel).
    pub fn with_bf16(self, classes: Bf16Products) -> Self {
        Self { bf16: classes, ..self }
    }

    pub fn with_path(self, path: Path) -> Self {
        Self { path, ..self }
    }

    pub fn with_cpu(self, cpu: Cpu) -> Self {
        Self { cpu, ..self }
    }

    pub fn with_int8_inputs(self, int8_inputs: bool) -> Self {
        Self { int8_inputs, ..self }
    }

    pub fn with_activation_bits(self, activation_bits: ActivationBits) -> Self {
        Self { activation_bits, ..self }
    }

    /// KV caches in `dtype` (f32 or f16).
    pub fn with_kv_cache(self, dtype: DType) -> Self {
        Self { kv_cache: dtype, ..self }
    }

    pub fn with_uniform_products(self, uniform_products: bool) -> Self {
        Self { uniform_products, ..self }
    }

    /// Whether an op on tensors of `dtype` runs as one node on `B`'s kernel (the backend has one
    /// that beats the composition, and the kernels are not switched off).
    pub fn fused<B: crate::EmberBackend>(&self, dtype: DType) -> bool {
        self.path == Path::Kernels && B::fused(dtype)
    }

    /// Whether some CPU products actually run on the bf16 kernel.
    pub fn cpu_bf16(&self) -> bool {
        self.bf16.any() && self.cpu.bf16.is_some()
    }

    /// The bf16 kernel that runs the CPU's bf16 products, when any do (for the logs).
    pub fn bf16_kernel(&self) -> Option<Bf16Kernel> {
        self.cpu.bf16.filter(|_| self.bf16.any())
    }

    /// What the linear layers' CPU kernels may use.
    pub(crate) fn linear_cpu(&self) -> Cpu {
        self.cpu.bf16_if(self.bf16.linear)
    }

    /// What the fused LM-head loss's CPU kernel may use.
    pub(crate) fn head_cpu(&self) -> Cpu {
        self.cpu.bf16_if(self.bf16.head)
    }

    /// What the attention's CPU kernels may use.
    pub(crate) fn attention_cpu(&self) -> Cpu {
        self.cpu.bf16_if(self.bf16.attention)
    }

    /// What the element-wise CPU kernels may use (no products).
    pub(crate) fn elementwise_cpu(&self) -> Cpu {
        self.cpu.bf16_if(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_runs_kernels_in_f32_with_what_the_cpu_has() {
        let c = Compute::default();
        assert_eq!((c.dtype, c.path, c.bf16), (DType::F32, Path::Kernels, Bf16Products::NONE));
        assert_eq!(c.cpu, Cpu::detect());
        assert!(!c.cpu_bf16() && c.bf16_kernel().is_none());
        assert_eq!(c.linear_cpu().bf16, None, "no class asked for bf16");
        let on = c.with_bf16(Bf16Products { head: true, ..Bf16Products::NONE });
        assert_eq!(on.head_cpu().bf16, Cpu::detect().bf16);
        assert_eq!((on.linear_cpu().bf16, on.attention_cpu().bf16, on.elementwise_cpu().bf16), (None, None, None));
        assert_eq!(on.cpu_bf16(), Cpu::detect().bf16.is_some());
    }

    #[test]
    fn a_cap_never_widens() {
        let cpu = Cpu::detect();
        for tier in Tier::ALL {
            assert_eq!(cpu.capped(tier).tier, tier.min(cpu.tier));
        }
    }
}
