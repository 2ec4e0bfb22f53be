//! Wide builds of the element-wise kernels, chosen at run time.
//!
//! The crate is compiled for the baseline x86-64 (SSE2), so the loops of the kernels that the
//! compiler vectorises — softmax rows, SwiGLU, RMSNorm, RoPE, AdamW — run four lanes wide without
//! FMA, on CPUs that have sixteen. [`multiversion!`] compiles a kernel's body twice: once as it is,
//! once inside a function with AVX-512 and FMA enabled (closures in it, the rayon tasks included,
//! inherit the features, and `#[inline(always)]` helpers such as [`super::kernels::exp`] are
//! compiled again inside it). The entry point picks the wide copy when [`wide`] says the CPU has
//! the features. The two copies compute the same thing: rustc does not reassociate float sums or
//! fuse multiplies and adds on its own, so the wide build changes speed, not results (tested).

use std::cell::Cell;

thread_local! {
    /// Set by [`portable_only`]: this thread's calls run the baseline copy.
    static PORTABLE: Cell<bool> = const { Cell::new(false) };
}

/// Whether the CPU has what the wide copies are compiled for (std caches the detection).
pub fn detected() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether a kernel called on this thread now runs its wide copy.
pub fn wide() -> bool {
    detected() && !PORTABLE.with(Cell::get)
}

/// Runs `f` with this thread's kernel calls on their baseline copies: how tests reach the path a CPU
/// without AVX-512 takes. A kernel decides on the thread that calls it and its rayon tasks follow
/// that choice; a kernel called from inside another's rayon tasks decides on the worker thread, so
/// tests call each kernel directly.
pub fn portable_only<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            PORTABLE.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(PORTABLE.with(|p| p.replace(true)));
    f()
}

/// Defines `fn name(args) -> ret { body }` whose body is compiled twice, baseline and with
/// AVX-512 + FMA, the second taken when [`wide`] holds. Arguments must be plain names; no generics,
/// `self` or `impl Trait` arguments. The body is written inside the macro (rustfmt leaves it
/// alone) rather than in an `#[inline(always)]` function the two copies call: closures take their
/// target features from the function they are written in, so the rayon tasks of an inlined body
/// would stay baseline.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            if $crate::ops::simd::wide() {
                #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
                fn wide($($arg: $ty),*) $(-> $ret)? $body
                // SAFETY: `wide()` checked that this CPU has the four features named above (those
                // imply the rest that `avx512f` switches on, such as F16C, on every CPU that has it).
                return unsafe { wide($($arg),*) };
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
    fn the_portable_switch_reaches_both_copies_and_they_agree() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.173).collect();
        let wide_out = scaled_exps(&x, 0.37);
        let (flag, portable_out) = portable_only(|| (wide(), scaled_exps(&x, 0.37)));
        assert!(!flag, "portable_only left the wide copy on");
        assert_eq!(wide(), detected(), "the switch was not restored");
        assert_eq!(wide_out, portable_out);
    }
}
