//! Wide builds of the element-wise kernels, chosen at run time.
//!
//! The crate is compiled for the baseline x86-64 (SSE2), so the loops of the kernels that the
//! compiler vectorises — softmax rows, SwiGLU, RMSNorm, RoPE, AdamW — run four lanes wide without
//! FMA, on CPUs that have eight or sixteen. [`multiversion!`] compiles a kernel's body three times:
//! once as it is, once inside a function with AVX2 and FMA enabled (eight lanes: Intel since Haswell,
//! AMD since Zen 1, up to Zen 3), once with AVX-512 as well (sixteen lanes: Zen 4 and 5, Intel Xeons
//! since Skylake-SP). Closures in them, the rayon tasks included, inherit the features, and
//! `#[inline(always)]` helpers such as the kernels' `exp` are compiled again inside each. The
//! entry point takes the widest copy that its [`crate::Cpu`] argument allows (the run's
//! [`crate::Compute`]: no process-wide switch). The copies compute the same thing: rustc
//! does not reassociate float sums or fuse multiplies and adds on its own, so the wider builds
//! change speed, not results (tested on every tier the CPU at hand reaches).

/// The builds a [`multiversion!`] kernel has, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    /// The baseline x86-64 (SSE2), and every other architecture.
    Baseline,
    /// AVX2 and FMA.
    Avx2,
    /// AVX-512 (F and VL) with AVX2 and FMA.
    Avx512,
}

impl Tier {
    /// Every tier, narrowest first.
    pub const ALL: [Tier; 3] = [Tier::Baseline, Tier::Avx2, Tier::Avx512];
}

/// The widest tier the CPU has (std caches the detection).
pub(crate) fn detected() -> Tier {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
        if avx2 && std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512vl") {
            Tier::Avx512
        } else if avx2 {
            Tier::Avx2
        } else {
            Tier::Baseline
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Tier::Baseline
    }
}

/// Defines `fn name(cpu: Cpu, args) -> ret { body }` whose body is compiled three times, baseline,
/// with AVX2 + FMA and with AVX-512 as well, the copy taken by the first argument's `tier` (a
/// [`crate::Cpu`], never wider than the CPU: [`crate::Cpu::capped`] only narrows it). Arguments must
/// be plain names; no generics, `self` or `impl Trait` arguments. The body is written inside the
/// macro (rustfmt leaves it alone) rather than in an `#[inline(always)]` function the copies call: closures take their
/// target features from the function they are written in, so the rayon tasks of an inlined body
/// would stay baseline.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($cpu:ident: $cpu_ty:ty $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($cpu: $cpu_ty $(, $arg: $ty)*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            // The CPU's own tier bounds the copy too: a `Cpu` value made by hand cannot run
            // instructions the CPU lacks.
            match $crate::simd::detected().min($cpu.tier) {
                $crate::simd::Tier::Avx512 => {
                    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
                    fn avx512($cpu: $cpu_ty $(, $arg: $ty)*) $(-> $ret)? {
                        let _ = &$cpu;
                        $body
                    }
                    // SAFETY: `detected()` is `Avx512` only where the CPU has the four features
                    // named above (those imply the rest that `avx512f` switches on, such as F16C).
                    return unsafe { avx512($cpu $(, $arg)*) };
                }
                $crate::simd::Tier::Avx2 => {
                    #[target_feature(enable = "avx2,fma")]
                    fn avx2($cpu: $cpu_ty $(, $arg: $ty)*) $(-> $ret)? {
                        let _ = &$cpu;
                        $body
                    }
                    // SAFETY: `detected()` is `Avx2` or wider only where the CPU has AVX2 and FMA.
                    return unsafe { avx2($cpu $(, $arg)*) };
                }
                $crate::simd::Tier::Baseline => {}
            }
            let _ = &$cpu;
            $body
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;

    use crate::Cpu;

    multiversion! {
        fn scaled_exps(cpu: Cpu, x: &[f32], s: f32) -> Vec<f32> {
            x.iter().map(|&v| crate::activation::exp(v * s)).collect()
        }
    }

    #[test]
    fn every_copy_the_cpu_has_agrees() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.173).collect();
        let widest = scaled_exps(Cpu::detect(), &x, 0.37);
        for cap in Tier::ALL {
            let out = scaled_exps(Cpu::detect().capped(cap), &x, 0.37);
            assert_eq!(out, widest, "the {cap:?} copy differs from the {:?} one", detected());
        }
    }
}
