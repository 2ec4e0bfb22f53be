//! A sampler's unnormalised probabilities: `e^((l − max)/T)` of each logit `l` at temperature `T`,
//! vectorised over a whole vocabulary (a libm `exp` a token was a tenth of a 16-row serving step).

use crate::activation::exp;
use crate::simd::multiversion;
use crate::Cpu;

/// `e^((l − max)·inv_t)` of one logit (`inv_t = 1/T`): zero for a banned logit (−∞), about 1e-38
/// where the true value is smaller (the vectorised `exp` clamps its input); NaN stays NaN.
#[inline(always)]
pub fn weight(l: f32, max: f32, inv_t: f32) -> f32 {
    if l == f32::NEG_INFINITY {
        0.0
    } else {
        exp((l - max) * inv_t)
    }
}

multiversion! {
    /// [`weight`] of every logit, the same bits as it gives one at a time, on every tier.
    pub fn weights(cpu: Cpu, logits: &[f32], max: f32, inv_t: f32) -> Vec<f32> {
        logits.iter().map(|&l| weight(l, max, inv_t)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{self, Tier};

    #[test]
    fn weights_are_the_exponentials_and_one_at_a_time_the_same() {
        let logits: Vec<f32> =
            (0..5000).map(|i| ((i * 7919) % 4001) as f32 * 0.01 - 20.0).chain([f32::NEG_INFINITY]).collect();
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for t in [0.3f32, 0.8, 1.0, 1.7] {
            let inv_t = 1.0 / t;
            for cap in Tier::ALL.into_iter().filter(|&c| c <= simd::detected()) {
                let got = weights(Cpu::detect().capped(cap), &logits, max, inv_t);
                for (&l, &w) in logits.iter().zip(&got) {
                    assert_eq!(w.to_bits(), weight(l, max, inv_t).to_bits(), "{cap:?}: logit {l}, T {t}");
                    let arg = (f64::from(l) - f64::from(max)) * f64::from(inv_t);
                    let want = arg.exp();
                    if want > 1e-30 {
                        // f32's rounding of the argument, relative to it, becomes the result's.
                        let tol = 3e-7 * (1.0 + arg.abs()) * want;
                        assert!((f64::from(w) - want).abs() <= tol, "logit {l}, T {t}: {w} vs {want}");
                    } else {
                        assert!(f64::from(w) < 1e-30, "logit {l}, T {t}: {w} for {want}");
                    }
                }
            }
        }
        assert_eq!(weight(f32::NEG_INFINITY, 3.0, 1.25), 0.0, "a banned token weighs nothing");
        assert!(weight(f32::NAN, 3.0, 1.25).is_nan());
    }
}
