//! Timings of CPU kernels alone, for `ember bench`: what the kernel modules would otherwise have to
//! expose for a benchmark to reach them.

use std::time::Instant;

use crate::compute::{Bf16Kernel, Cpu};
use crate::kernels::{attention_backward_in, attention_in, AttnShape};

/// The best forward and backward times of the causal attention kernels on one shape, in
/// milliseconds, with f32 products and, where `cpu` has a bf16 kernel, with bf16 products.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionTimes {
    pub f32_ms: (f64, f64),
    pub bf16_ms: Option<(f64, f64)>,
    /// The largest `|o_bf16 − o_f32|` over the largest `|o_f32|`.
    pub bf16_output_error: Option<f64>,
}

/// Times the attention kernels on random q/k/v of `(batch, positions, heads, key/value heads, head
/// size)`: `reps` runs each, f32 and bf16 alternating, the best kept.
pub fn attention(cpu: Cpu, shape: (usize, usize, usize, usize, usize), reps: usize) -> AttentionTimes {
    let (batch, seq, heads, kv_heads, head_dim) = shape;
    let s = AttnShape::causal(batch, seq, heads, kv_heads, head_dim);
    let (rows, width) = (batch * seq, s.packed_width());
    let mut qkv = noise(rows * width, 1);
    // Queries larger than keys, for peaked attention.
    for row in qkv.chunks_exact_mut(width) {
        row[..heads * head_dim].iter_mut().for_each(|q| *q *= 3.0);
    }
    let d_o = noise(rows * heads * head_dim, 2);
    let bf16 = cpu.bf16.is_some() && crate::bf16_gemm::supported();
    let mut best = [[f64::INFINITY; 2]; 2];
    let mut error = None;
    for _ in 0..reps.max(1) {
        let mut outputs = Vec::new();
        for (i, on) in [false, true].into_iter().enumerate().filter(|&(_, on)| !on || bf16) {
            let start = Instant::now();
            let out = attention_in(cpu, &qkv, &s, on);
            let forward = start.elapsed().as_secs_f64() * 1e3;
            let start = Instant::now();
            std::hint::black_box(attention_backward_in(cpu, &qkv, (&out.o, &out.lse), &d_o, &s, on));
            let backward = start.elapsed().as_secs_f64() * 1e3;
            best[i] = [best[i][0].min(forward), best[i][1].min(backward)];
            outputs.push(out.o);
        }
        if let [exact, rounded] = &outputs[..] {
            let scale = exact.iter().fold(f32::MIN_POSITIVE, |m, x| m.max(x.abs()));
            let diff = exact.iter().zip(rounded).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            error = Some(f64::from(diff / scale));
        }
    }
    AttentionTimes {
        f32_ms: (best[0][0], best[0][1]),
        bf16_ms: bf16.then_some((best[1][0], best[1][1])),
        bf16_output_error: error,
    }
}

/// The best time in seconds of `reps` square `n×n×n` products on the bf16 kernel `kernel` (f32 in
/// and out, the operands rounded to bf16, the sums f32), after a warm-up; `None` where the CPU lacks
/// the kernel.
pub fn bf16_gemm_seconds(kernel: Bf16Kernel, n: usize, reps: usize) -> Option<f64> {
    let a: Vec<f32> = (0..n * n).map(|i| (i % 997) as f32 / 997.0 - 0.5).collect();
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::INFINITY;
    for rep in 0..reps + 1 {
        let start = Instant::now();
        if !crate::bf16_gemm::gemm(kernel, &mut c, false, (&a, (n, 1)), (&a, (n, 1)), (n, n, n)) {
            return None;
        }
        if rep > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    Some(best)
}

/// `n` deterministic values in [-1, 1), different for each seed.
pub(crate) fn noise(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attention_timings_cover_what_the_cpu_runs() {
        let t = attention(Cpu::detect(), (1, 320, 2, 1, 32), 1);
        assert!(t.f32_ms.0 > 0.0 && t.f32_ms.1 > 0.0);
        let bf16 = Cpu::detect().bf16.is_some();
        assert_eq!(t.bf16_ms.is_some(), bf16);
        assert_eq!(t.bf16_output_error.is_some(), bf16);
        assert!(t.bf16_output_error.is_none_or(|e| e < 2e-2), "{:?}", t.bf16_output_error);
        let f32_only = attention(Cpu::f32_products(), (1, 320, 2, 1, 32), 1);
        assert!(f32_only.bf16_ms.is_none());
    }

    #[test]
    fn a_bf16_product_is_timed_where_the_kernel_runs() {
        for kernel in [Bf16Kernel::Avx512, Bf16Kernel::Amx] {
            assert_eq!(bf16_gemm_seconds(kernel, 64, 1).is_some(), kernel.runs_here(), "{kernel:?}");
        }
    }
}
