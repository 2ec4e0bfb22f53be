//! Which kernel multiplies each class of CPU products under `--precision bf16`, chosen by what this
//! CPU measures, not by its flags: the same AVX512_BF16 instruction runs at twice the f32 FMA's
//! rate on an AMD Zen 4/5 and at about half of it on an Intel Xeon without AMX (one port against
//! the FMA's two), where a bf16 product would be a slowdown.
//!
//! Measured before this module chose (`ember bench attention --batch 8 --seq 256 --heads 6
//! --kv-heads 6`): on 2 Xeon cores with AMX the vector kernel ran the attention at 0.65× f32 (0.69×
//! at 512 positions, 0.60× at 128), on 2 Zen 5 cores (9/3 heads) at 1.0× at 256, 1.23× at 512 and
//! 1.49× at 2,048; the linear layers' GEMMs on an Emerald Rapids Xeon without AMX at 198–201 GFLOP/s
//! against f32's 342.
//!
//! A [`Calibration`] times every candidate (f32, and each bf16 kernel the CPU runs) on the shapes of
//! its class, alternating, the best of a few repetitions kept; [`Calibration::choice`] then names the
//! fastest, a bf16 kernel only where it beats f32 by [`MARGIN`]. Measuring takes well under a
//! second; the caller caches the result per CPU (`ember_train`'s `calibration` module).

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::bench::noise;
use crate::compute::{Bf16Kernel, Cpu};
use crate::kernels::{linear, linear_backward, AttnShape, LinearGrads};

/// How much faster than f32 a bf16 kernel must measure to be chosen: noise between repetitions
/// must not put a run on a kernel that is no faster.
pub const MARGIN: f64 = 1.03;

/// The classes of products that `--precision bf16` may put on a bf16 kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// The linear layers' GEMMs, forward and both gradients (the LM head's share their kernel):
    /// timed on a `[1024, 576] · [576, 1536]` layer, SmolLM2-135M's MLP on 1,024 tokens.
    Linear,
    /// The causal attention's per-block products (on the vector kernel only): timed forward and
    /// backward on 512 positions, 9 query and 3 key/value heads of 64.
    Attention,
    /// Muon's Newton-Schulz iteration with bf16 operands (`ns_dtype = "bf16"`), each matrix on one
    /// thread: on the bf16 kernel or on f32 products of the bf16 values. Timed on a `128 × 344`
    /// matrix (the speedrun's MLP), five steps.
    NewtonSchulz,
}

impl Class {
    pub const ALL: [Class; 3] = [Class::Linear, Class::Attention, Class::NewtonSchulz];

    pub fn name(self) -> &'static str {
        match self {
            Class::Linear => "linear layers and LM head",
            Class::Attention => "attention",
            Class::NewtonSchulz => "Muon's Newton-Schulz (bf16 values)",
        }
    }

    /// The bf16 kernels this class can run on, of those `cpu` allows.
    fn candidates(self, cpu: Cpu) -> Vec<Bf16Kernel> {
        let allowed = |k: Bf16Kernel| match cpu.bf16 {
            Some(Bf16Kernel::Amx) => true,
            Some(Bf16Kernel::Avx512) => k == Bf16Kernel::Avx512,
            None => false,
        };
        let reachable = Bf16Kernel::reachable().into_iter().filter(|&k| allowed(k));
        match self {
            Class::Attention => reachable.filter(|&k| k == Bf16Kernel::Avx512).collect(),
            Class::Linear | Class::NewtonSchulz => reachable.collect(),
        }
    }

    /// The floating-point operations of one timed run of this class's shapes.
    fn flops(self) -> f64 {
        let (m, k, n) = LINEAR_SHAPE;
        match self {
            // Forward, input and weight gradients.
            Class::Linear => 3.0 * 2.0 * (m * k * n) as f64,
            Class::Attention => {
                let (batch, t, heads, _, dh) = ATTENTION_SHAPE;
                // Causal: half the score matrix. Forward two products, backward five (as the
                // kernels count them), each 2·T²/2·Dh a head.
                7.0 * (batch * heads) as f64 * (t * t * dh) as f64
            }
            Class::NewtonSchulz => {
                let (s, l, steps) = NS_SHAPE;
                // A step: X·Xᵀ, A·A and P·X.
                (steps * 2 * (s * s * l + s * s * s + s * s * l)) as f64
            }
        }
    }
}

const LINEAR_SHAPE: (usize, usize, usize) = (1024, 576, 1536);
const ATTENTION_SHAPE: (usize, usize, usize, usize, usize) = (1, 512, 9, 3, 64);
const NS_SHAPE: (usize, usize, usize) = (128, 344, 5);

/// One candidate's measured rate on a class's shapes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Rate {
    /// The bf16 kernel, `None` for f32.
    pub kernel: Option<Bf16Kernel>,
    /// Useful GFLOP/s: the class's operations over the best time.
    pub gflops: f64,
}

/// The measured rates of every candidate of each class on this CPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub linear: Vec<Rate>,
    pub attention: Vec<Rate>,
    pub newton_schulz: Vec<Rate>,
}

impl Calibration {
    /// Times f32 and every bf16 kernel `cpu` allows on each class's shapes, `reps` times each
    /// (alternating, after one warm-up), the best kept. Without a bf16 kernel only f32 is timed.
    pub fn measure(cpu: Cpu, reps: usize) -> Self {
        Self {
            linear: measure_class(Class::Linear, cpu, reps),
            attention: measure_class(Class::Attention, cpu, reps),
            newton_schulz: measure_class(Class::NewtonSchulz, cpu, reps),
        }
    }

    /// The rates of `class`.
    pub fn rates(&self, class: Class) -> &[Rate] {
        match class {
            Class::Linear => &self.linear,
            Class::Attention => &self.attention,
            Class::NewtonSchulz => &self.newton_schulz,
        }
    }

    /// The measured rate of `kernel` (`None`: f32) on `class`.
    pub fn rate(&self, class: Class, kernel: Option<Bf16Kernel>) -> Option<f64> {
        self.rates(class).iter().find(|r| r.kernel == kernel).map(|r| r.gflops)
    }

    /// The bf16 kernel `class` runs on: the fastest measured, where it beats f32 by [`MARGIN`] (a
    /// calibration without an f32 rate, or with rates that are not finite, chooses f32).
    pub fn choice(&self, class: Class) -> Option<Bf16Kernel> {
        let f32_rate = self.rate(class, None).filter(|r| r.is_finite() && *r > 0.0)?;
        let rates = self.rates(class).iter().filter(|r| r.kernel.is_some() && r.gflops.is_finite());
        let best = rates.max_by(|a, b| a.gflops.total_cmp(&b.gflops))?;
        (best.gflops >= f32_rate * MARGIN).then_some(best.kernel).flatten()
    }

    /// Whether every rate was measured on a kernel `cpu` allows, and every kernel it allows was
    /// measured: a cached calibration made with other kernels allowed is measured again.
    pub fn covers(&self, cpu: Cpu) -> bool {
        Class::ALL.iter().all(|&class| {
            let mut want: Vec<Option<Bf16Kernel>> = class.candidates(cpu).into_iter().map(Some).collect();
            want.push(None);
            let have: Vec<Option<Bf16Kernel>> = self.rates(class).iter().map(|r| r.kernel).collect();
            want.len() == have.len() && want.iter().all(|k| have.contains(k))
        })
    }
}

/// The best rates of f32 and each bf16 candidate on `class`'s shapes.
fn measure_class(class: Class, cpu: Cpu, reps: usize) -> Vec<Rate> {
    let kernels: Vec<Option<Bf16Kernel>> =
        std::iter::once(None).chain(class.candidates(cpu).into_iter().map(Some)).collect();
    let mut best = vec![f64::INFINITY; kernels.len()];
    let inputs = Inputs::new(class);
    for rep in 0..=reps.max(1) {
        for (i, &kernel) in kernels.iter().enumerate() {
            let seconds = inputs.time(class, Cpu { bf16: kernel, ..cpu });
            // The first round warms the caches and the thread pool.
            if rep > 0 {
                best[i] = best[i].min(seconds);
            }
        }
    }
    let flops = class.flops();
    kernels.into_iter().zip(best).map(|(kernel, s)| Rate { kernel, gflops: flops / s / 1e9 }).collect()
}

/// A class's operands, made once.
struct Inputs {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl Inputs {
    fn new(class: Class) -> Self {
        match class {
            Class::Linear => {
                let (m, k, n) = LINEAR_SHAPE;
                Self { a: noise(m * k, 1), b: noise(k * n, 2), c: noise(m * n, 3) }
            }
            Class::Attention => {
                let (batch, t, heads, kv_heads, dh) = ATTENTION_SHAPE;
                let s = AttnShape::causal(batch, t, heads, kv_heads, dh);
                Self { a: noise(batch * t * s.packed_width(), 4), b: noise(batch * t * heads * dh, 5), c: Vec::new() }
            }
            Class::NewtonSchulz => {
                let (s, l, _) = NS_SHAPE;
                Self { a: noise(s * l, 6), b: Vec::new(), c: Vec::new() }
            }
        }
    }

    /// Seconds for one run of `class`'s products on `cpu`.
    fn time(&self, class: Class, cpu: Cpu) -> f64 {
        let start = Instant::now();
        match class {
            Class::Linear => {
                let shape = LINEAR_SHAPE;
                std::hint::black_box(linear(cpu, &self.a, &self.b, None, shape));
                let need = LinearGrads { x: true, w: true, b: false };
                std::hint::black_box(linear_backward(cpu, &self.a, &self.b, &self.c, shape, need));
            }
            Class::Attention => {
                let (batch, t, heads, kv_heads, dh) = ATTENTION_SHAPE;
                let s = AttnShape::causal(batch, t, heads, kv_heads, dh);
                let bf16 = cpu.bf16.is_some();
                let out = crate::kernels::attention_in(cpu, &self.a, &s, bf16);
                let grads = crate::kernels::attention_backward_in(cpu, &self.a, (&out.o, &out.lse), &self.b, &s, bf16);
                std::hint::black_box(grads);
            }
            Class::NewtonSchulz => {
                let (s, l, steps) = NS_SHAPE;
                let h = crate::NsStep { coefficients: [3.4445, -4.7750, 2.0315], steps, eps: 1e-7, bf16: true };
                std::hint::black_box(crate::newton_schulz::orthogonalize(&self.a, s, l, h, cpu.bf16));
            }
        }
        start.elapsed().as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(f32_rate: f64, bf16: &[(Bf16Kernel, f64)]) -> Vec<Rate> {
        let mut v = vec![Rate { kernel: None, gflops: f32_rate }];
        v.extend(bf16.iter().map(|&(k, gflops)| Rate { kernel: Some(k), gflops }));
        v
    }

    #[test]
    fn a_bf16_kernel_is_chosen_only_where_it_measured_faster() {
        use Bf16Kernel::{Amx, Avx512};
        // Intel without AMX: the vector kernel at 58 % of f32.
        let intel = Calibration {
            linear: rates(342.0, &[(Avx512, 199.0)]),
            attention: rates(120.0, &[(Avx512, 80.0)]),
            newton_schulz: rates(60.0, &[(Avx512, 40.0)]),
        };
        assert_eq!(Class::ALL.map(|c| intel.choice(c)), [None; 3]);
        // Zen 4/5: twice f32.
        let zen = Calibration {
            linear: rates(180.0, &[(Avx512, 330.0)]),
            attention: rates(100.0, &[(Avx512, 125.0)]),
            newton_schulz: rates(50.0, &[(Avx512, 70.0)]),
        };
        assert_eq!(Class::ALL.map(|c| zen.choice(c)), [Some(Avx512); 3]);
        // Within the margin: f32.
        let close = Calibration {
            linear: rates(100.0, &[(Avx512, 102.0)]),
            attention: rates(100.0, &[]),
            newton_schulz: rates(100.0, &[]),
        };
        assert_eq!((close.choice(Class::Linear), close.choice(Class::Attention)), (None, None));
        // AMX: the fastest of the two.
        let amx = Calibration {
            linear: rates(340.0, &[(Amx, 1300.0), (Avx512, 200.0)]),
            attention: rates(1.0, &[]),
            newton_schulz: rates(1.0, &[]),
        };
        assert_eq!(amx.choice(Class::Linear), Some(Amx));
        // Broken numbers never choose bf16.
        let broken = Calibration {
            linear: rates(f64::NAN, &[(Avx512, 300.0)]),
            attention: rates(100.0, &[(Avx512, f64::INFINITY)]),
            newton_schulz: rates(0.0, &[(Avx512, 1.0)]),
        };
        assert_eq!(Class::ALL.map(|c| broken.choice(c)), [None; 3]);
    }

    #[test]
    fn the_measurement_times_every_kernel_the_cpu_allows() {
        for cpu in [Cpu::detect(), Cpu::f32_products(), Cpu { bf16: Some(Bf16Kernel::Avx512), ..Cpu::detect() }] {
            if cpu.bf16.is_some_and(|k| !k.runs_here()) {
                continue;
            }
            let c = Calibration::measure(cpu, 1);
            assert!(c.covers(cpu), "{cpu:?}: {c:?}");
            for class in Class::ALL {
                assert!(c.rates(class).iter().all(|r| r.gflops.is_finite() && r.gflops > 0.0), "{c:?}");
                assert_eq!(c.rates(class).len(), 1 + class.candidates(cpu).len());
            }
            if cpu.bf16.is_none() {
                assert_eq!(Class::ALL.map(|class| c.choice(class)), [None; 3]);
            }
            // Another CPU's allowance is not covered.
            let other = Cpu { bf16: if cpu.bf16.is_some() { None } else { Some(Bf16Kernel::Avx512) }, ..cpu };
            assert!(!c.covers(other) || Class::Linear.candidates(other) == Class::Linear.candidates(cpu));
        }
    }
}
