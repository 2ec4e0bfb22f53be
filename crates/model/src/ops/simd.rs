//! Wide builds of the element-wise kernels, chosen at run time.
//!
//! The crate is compiled for the baseline x86-64 (SSE2), so the loops of the kernels that the
//! compiler vectorises — softmax rows, SwiGLU, RMSNorm, RoPE, AdamW — run four lanes wide without
//! FMA, on CPUs that have eight or sixteen. [`multiversion!`] compiles a kernel's body three times:
//! once as it is, once inside a function with AVX2 and FMA enabled (eight lanes: Intel since Haswell,
//! AMD since Zen 1, up to Zen 3), once with AVX-512 as well (sixteen lanes: Zen 4 and 5, Intel Xeons
//! since Skylake-SP). Closures in them, the rayon tasks included, inherit the features, and
//! `#[inline(always)]` helpers such as [`super::kernels::exp`] are compiled again inside each. The
//! entry point takes the widest copy that [`tier`] allows. The copies compute the same thing: rustc
//! does not reassociate float sums or fuse multiplies and adds on its own, so the wider builds
//! change speed, not results (tested on every tier the CPU at hand reaches).

use std::cell::Cell;

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

thread_local! {
    /// Set by [`capped`]: the widest copy this thread's calls may run.
    static CAP: Cell<Tier> = const { Cell::new(Tier::Avx512) };
}

/// The widest tier the CPU has (std caches the detection).
pub fn detected() -> Tier {
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

/// The copy a kernel called on this thread now runs: the CPU's widest, or narrower under [`capped`].
pub fn tier() -> Tier {
    detected().min(CAP.with(Cell::get))
}

/// Runs `f` with this thread's kernel calls on copies no wider than `cap`: how tests reach the
/// paths of CPUs narrower than the one at hand. A kernel decides on the thread that calls it and its
/// rayon tasks follow that choice; a kernel called from inside another's rayon tasks decides on the
/// worker thread, so tests call each kernel directly.
pub fn capped<R>(cap: Tier, f: impl FnOnce() -> R) -> R {
    struct Restore(Tier);
    impl Drop for Restore {
        fn drop(&mut self) {
            CAP.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CAP.with(|c| c.replace(cap)));
    f()
}

/// Defines `fn name(args) -> ret { body }` whose body is compiled three times, baseline, with AVX2 +
/// FMA and with AVX-512 as well, the copy taken by [`tier`]. Arguments must be plain names; no
/// generics, `self` or `impl Trait` arguments. The body is written inside the macro (rustfmt leaves
/// it alone) rather than in an `#[inline(always)]` function the copies call: closures take their
/// target features from the function they are written in, so the rayon tasks of an inlined body
/// would stay baseline.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            match $crate::ops::simd::tier() {
                $crate::ops::simd::Tier::Avx512 => {
                    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
                    fn avx512($($arg: $ty),*) $(-> $ret)? $body
                    // SAFETY: `tier()` is `Avx512` only where the CPU has the four features named
                    // above (those imply the rest that `avx512f` switches on, such as F16C).
                    return unsafe { avx512($($arg),*) };
                }
                $crate::ops::simd::Tier::Avx2 => {
                    #[target_feature(enable = "avx2,fma")]
                    fn avx2($($arg: $ty),*) $(-> $ret)? $body
                    // SAFETY: `tier()` is `Avx2` or wider only where the CPU has AVX2 and FMA.
                    return unsafe { avx2($($arg),*) };
                }
                $crate::ops::simd::Tier::Baseline => {}
            }
            $body
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;

    multiversion! {
        fn scaled_exps(x: &[f32], s: f32) -> Vec<f32> {
            x.iter().map(|&v| crate::ops::kernels::exp(v * s)).collect()
        }
    }

    #[test]
    fn the_cap_reaches_every_copy_the_cpu_has_and_they_agree() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.173).collect();
        let widest = scaled_exps(&x, 0.37);
        for cap in Tier::ALL {
            let (now, out) = capped(cap, || (tier(), scaled_exps(&x, 0.37)));
            assert_eq!(now, cap.min(detected()), "capped({cap:?}) runs {now:?}");
            assert_eq!(tier(), detected(), "the cap was not restored");
            assert_eq!(out, widest, "the {now:?} copy differs from the {:?} one", detected());
        }
    }
}
